"""A test-only vLLM general plugin: vLLM's CPU build keeps its linear weights as plain tensors, as its CUDA build does.

Why: weightsync's live p2p path writes vLLM's own parameters in place. On CUDA with an unquantized model they are
ordinary tensors; vLLM's CPU build (the only vLLM that serves on this project's CI machines) instead repacks every
linear weight into a oneDNN handle after loading and leaves ``layer.weight`` empty, so the plugin refuses the
live placement there (tested too). To run the live path end to end in CI, this plugin turns that repacking off:
with ``vllm._custom_ops._supports_onednn`` false, ``dispatch_cpu_unquantized_gemm`` takes vLLM's own fallback for
CPUs without oneDNN, ``torch.nn.functional.linear`` on the weight it keeps.

Gated: it refuses to load (the server fails to start, naming it) unless vLLM is the release it was checked against
and the attribute it turns off is there; it says in the server's log that it is on. Used only by
``tests/engines/vllm/test_vllm_live_rounds.py`` (``VllmEngines(plain_linears=True)`` puts this directory on the
server's ``PYTHONPATH``); never in production, where CUDA weights are plain anyway.
"""

from __future__ import annotations

import logging

VALIDATED_VLLM = "0.32.0"

logger = logging.getLogger("weightsync_vllm_plain_linears")


def register() -> None:
    import vllm
    from vllm import _custom_ops as ops

    if vllm.__version__ != VALIDATED_VLLM:
        raise RuntimeError(
            f"weightsync-vllm-plain-linears was checked against vLLM {VALIDATED_VLLM}, not "
            f"{vllm.__version__}: re-check dispatch_cpu_unquantized_gemm before using it"
        )
    if not hasattr(ops, "_supports_onednn"):
        raise RuntimeError("vllm._custom_ops._supports_onednn is gone: the CPU GEMM dispatch changed")
    ops._supports_onednn = False
    logger.warning("weightsync-vllm-plain-linears (test only): CPU linear weights stay plain tensors (no oneDNN)")
