"""Gated workarounds for the stock SGLang server on a CPU-only machine (docs/engines/sglang-testing.md).

This directory itself goes on the SGLang server's ``PYTHONPATH`` (only for ``--device cpu``): its
``sitecustomize.py`` installs the post-import hooks named in ``WEIGHTSYNC_SGLANG_CPU_WORKAROUNDS`` and
``_weightsync_vllm_custom_ops.py`` is the placeholder module one of them serves. The project side only needs
:data:`DIRECTORY` and the names below; it never imports the hooks (they run inside the SGLang venv).
"""

from __future__ import annotations

import json
from pathlib import Path

DIRECTORY = Path(__file__).resolve().parent
ENV_ENABLE = "WEIGHTSYNC_SGLANG_CPU_WORKAROUNDS"
ENV_LOG = "WEIGHTSYNC_SGLANG_WORKAROUND_LOG"
MARKER = "weightsync-sglang-cpu-workaround:"

ROTARY_VLLM_PLACEHOLDER = "rotary_vllm_placeholder"  # always, on CPU
REGISTER_PER_PARAMETER = "register_per_parameter"  # with the transfer-engine flag (Mooncake writes)
NO_PYNCCL = "no_pynccl"  # TP >= 2
ABSORBED_MLA = "absorbed_mla_on_torch_native"  # MLA models (DeepSeek-V2/V3, Kimi-K2)

#: Test faults (not workarounds): armed by name, fired while a trigger file exists (the semantic gate's tests).
ENV_FAULTS = "WEIGHTSYNC_SGLANG_TEST_FAULTS"
ENV_FAULT_TRIGGER = "WEIGHTSYNC_SGLANG_FAULT_TRIGGER"
SKIP_POST_LOAD = "skip_post_load_on_trigger"  # a session ends without post_load_weights (stale derived weights)


def fault_env(fault: str, trigger: Path) -> dict[str, str]:
    """The server environment arming test fault ``fault``, fired while file ``trigger`` exists."""
    return {ENV_FAULTS: fault, ENV_FAULT_TRIGGER: str(trigger)}


def workarounds_for(tp: int, *, transfer_engine: bool = True, mla: bool = False) -> list[str]:
    """The workarounds a CPU server with this TP size needs; ``mla``: the model attends with MLA."""
    names = [ROTARY_VLLM_PLACEHOLDER]
    if mla:
        names.append(ABSORBED_MLA)
    if transfer_engine:
        names.append(REGISTER_PER_PARAMETER)
    if tp >= 2:
        names.append(NO_PYNCCL)
    return names


def uses_mla(model_dir: Path) -> bool:
    """Whether the model in ``model_dir`` attends with MLA (its config has a ``kv_lora_rank``, as DeepSeek-V2/V3's)."""
    config = json.loads((model_dir / "config.json").read_text())
    return bool(config.get("kv_lora_rank"))
