"""One TP rank of a vLLM engine whose weights live on a GPU, with weightsync's backend plugin (a GPU test's peer).

The plugin is registered as vLLM loads it (``weightsync_engine.vllm.plugin.register``) and its ``WeightsyncEngine`` made
by vLLM's own factory (``WeightTransferEngineFactory.create_engine``, what vLLM's worker calls for
``--weight-transfer-config '{"backend": "weightsync"}'``), then driven as vLLM's routes drive it: ``parse_init_info``
+ ``init_transfer_engine`` with ``placement: parameters`` (the live adapter's request), then one command per stdin
line, each answered with one JSON line on stdout:

* ``start`` / ``finish``: ``start_weight_update`` / ``finish_weight_update`` (the round's window);
* ``sums``: vLLM's own digest of every parameter (``compute_tensor_digests``, the code behind ``/weight_checker``);
* ``fastsums``: the same through the plugin's worker extension (``parallel_digests``, pinned chunks on a pool);
* ``quit``.

What is not vLLM's: the model (bf16 CUDA parameters shaped like a small decoder layer) and the worker's config
(this rank alone: TP rank 0, an unquantized model in bfloat16), the rank tag with it.

    python vllm_live_member.py --device N|cpu --directory D
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace

import torch

from weightsync_testing.vllm_standalone import module_with, vllm_tensor_digests

SHAPES = {
    "model.embed_tokens.weight": (1024, 256),
    "model.layers.0.self_attn.qkv_proj.weight": (384, 256),
    "model.layers.0.self_attn.o_proj.weight": (256, 256),
    "model.layers.0.mlp.gate_up_proj.weight": (1024, 256),
    "model.layers.0.mlp.down_proj.weight": (256, 512),
    "model.layers.0.input_layernorm.weight": (256,),
    "model.norm.weight": (256,),
}


def cuda_model(device: torch.device) -> torch.nn.Module:
    """vLLM's parameter names, each a bf16 tensor on ``device`` (allocated one by one, as a model's parameters are)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    return module_with(
        {name: torch.randn(shape, generator=generator).to(torch.bfloat16).to(device) for name, shape in SHAPES.items()}
    )


def answer(payload: object) -> None:
    print(json.dumps(payload), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", required=True, help="a CUDA device index, or cpu (to try the script anywhere)")
    parser.add_argument("--directory", required=True)
    args = parser.parse_args()
    device = torch.device("cpu") if args.device == "cpu" else torch.device("cuda", int(args.device))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    compute_tensor_digests = vllm_tensor_digests()

    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    import weightsync_engine.vllm.engine
    from weightsync_engine.vllm.plugin import BACKEND, register
    from weightsync_engine.vllm.worker_extension import parallel_digests

    register()
    weightsync_engine.vllm.engine.rank_tag = lambda: "dp0-pp0-tp0"  # this rank alone: no parallel groups to ask
    model = cuda_model(device)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
        model_config=SimpleNamespace(dtype=torch.bfloat16, quantization=None, model="cuda-model"),
    )
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend=BACKEND), vllm_config, device, model
    )  # type: ignore[arg-type]
    init = {"directory": args.directory, "host": "127.0.0.1", "placement": "parameters", "request": "gpu-test"}
    engine.init_transfer_engine(engine.parse_init_info(init))
    answer({"ready": type(engine).__name__})
    for line in sys.stdin:
        command = line.strip()
        if command == "start":
            engine.start_weight_update()
        elif command == "finish":
            engine.finish_weight_update()
        elif command == "sums":
            if device.type == "cuda":
                torch.cuda.synchronize()
            answer({"sums": compute_tensor_digests(model)})
            continue
        elif command == "fastsums":
            answer({"sums": parallel_digests(model.named_parameters())})
            continue
        elif command == "quit":
            break
        answer({"done": command})
    engine.shutdown()


if __name__ == "__main__":
    main()
