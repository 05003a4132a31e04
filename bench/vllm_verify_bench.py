"""What vLLM's ``/weight_checker`` costs a live round: vLLM's own digest of every parameter, against its baselines.

    python bench/vllm_verify_bench.py [--gib 8] [--device 0] [--reps 2] [--json PATH]
    python bench/vllm_verify_bench.py --dry-run            # anywhere: a tiny model on CPU (checks the harness)

In live p2p mode (and broadcast) into stock vLLM, the round's verify step is ``/weight_checker {"action":
"checksum"}``: in each worker, vLLM's ``compute_tensor_digests`` (``vllm/model_executor/model_loader/
weight_checksum.py``, loaded here by path: the same code) copies every parameter to the host and takes its sha256,
while vLLM is paused. This measures it on parameters shaped like Llama-3-8B's decoder layers in bf16 (``--gib`` of
them on one device, as one TP rank holds them), with two baselines of the same bytes measured in the same run:

* ``d2h``: a device-to-host copy of every parameter into pinned memory (the copy the digest cannot avoid);
* ``sha256``: ``hashlib.sha256`` over the same bytes already in host memory (the hash alone, one core);

and ``parallel_digests``: weightsync's worker extension (``weightsync_engine/vllm/worker_extension.py``, what the live
adapter calls through ``/collective_rpc`` where the server has it): the same digests, parameters hashed on a thread
pool; checked equal to vLLM's, key for key.

Prints seconds and GB/s (10^9 B/s) for each, and the digest's time as a ratio to each baseline: where the pause
goes in a live round's verification. Best of ``--reps``. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from weightsync_testing.vllm_standalone import module_with, vllm_tensor_digests

#: One Llama-3-8B decoder layer as vLLM holds it at TP 1 (fused qkv and gate_up), bf16.
LAYER = {
    "self_attn.qkv_proj.weight": (6144, 4096),
    "self_attn.o_proj.weight": (4096, 4096),
    "mlp.gate_up_proj.weight": (28672, 4096),
    "mlp.down_proj.weight": (4096, 14336),
    "input_layernorm.weight": (4096,),
    "post_attention_layernorm.weight": (4096,),
}
TINY_LAYER = {"self_attn.qkv_proj.weight": (96, 64), "mlp.down_proj.weight": (64, 128), "input_layernorm.weight": (64,)}


def model(layer: dict[str, tuple[int, ...]], gib: float, device: torch.device) -> torch.nn.Module:
    """``layer``'s parameters repeated for ``gib`` GiB of bf16 on ``device``, under vLLM's names."""
    per_layer = sum(torch.Size(shape).numel() * 2 for shape in layer.values())
    layers = max(1, int(gib * 2**30 // per_layer))
    return module_with(
        {
            f"model.layers.{index}.{name}": torch.empty(shape, dtype=torch.bfloat16, device=device).uniform_(-1, 1)
            for index in range(layers)
            for name, shape in layer.items()
        }
    )


def best(reps: int, run: Callable[[], Any], sync: Callable[[], None]) -> float:
    times = []
    for _ in range(reps):
        sync()
        began = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - began)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8.0, help="parameters on the device (default 8)")
    parser.add_argument("--device", default="0", help="CUDA device index (default 0)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on CPU")
    args = parser.parse_args()
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", int(args.device))
    sync: Callable[[], None] = (lambda: None) if args.dry_run else torch.cuda.synchronize
    net = model(TINY_LAYER if args.dry_run else LAYER, 0.001 if args.dry_run else args.gib, device)
    params = [p for _, p in net.named_parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=not args.dry_run) for p in params]
    digests = vllm_tensor_digests()

    def d2h() -> None:
        for target, p in zip(host, params, strict=True):
            target.copy_(p, non_blocking=True)

    def sha_only() -> None:
        for target in host:
            hashlib.sha256(target.view(torch.uint8).numpy()).hexdigest()

    from weightsync_engine.vllm.worker_extension import parallel_digests

    seconds = {
        "d2h": best(args.reps, d2h, sync),
        "sha256": best(args.reps, sha_only, sync),
        "vllm_digests": best(args.reps, lambda: digests(net), sync),
        "parallel_digests": best(args.reps, lambda: parallel_digests(net.named_parameters()), sync),
    }
    if parallel_digests(net.named_parameters()) != digests(net):
        raise SystemExit("the worker extension's digests differ from vLLM's")
    result = {
        "device": "cpu" if args.dry_run else torch.cuda.get_device_name(device),
        "bytes": nbytes,
        "parameters": len(params),
        "seconds": seconds,
        "gbps": {k: nbytes / v / 1e9 for k, v in seconds.items()},
        "digests_over_d2h": seconds["vllm_digests"] / seconds["d2h"],
        "digests_over_sha256": seconds["vllm_digests"] / seconds["sha256"],
        "parallel_over_vllm": seconds["parallel_digests"] / seconds["vllm_digests"],
        "parallel_over_d2h": seconds["parallel_digests"] / seconds["d2h"],
    }
    for name, value in seconds.items():
        print(f"{name:>16}: {value:8.3f} s  {nbytes / value / 1e9:7.2f} GB/s  ({nbytes / 1e9:.2f} GB)")
    print(f"vLLM's digests take {result['digests_over_d2h']:.1f} x the copy and "
          f"{result['digests_over_sha256']:.2f} x the hash alone; the extension's "
          f"{result['parallel_over_vllm']:.3f} x vLLM's ({result['parallel_over_d2h']:.1f} x the copy)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
