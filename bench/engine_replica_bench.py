"""What an engine replica costs a source: staging a DeepSeek-V3-shaped model's tensors and running SGLang's own
``load_weights`` over them into the replica file, against plain staging of the same bytes and a memcpy.

The model is ``deepseek_v3`` from the tiny-model maker, widened (``--hidden``, ``--layers``, ``--experts``): MLA, a
dense first layer, then MoE layers with a shared expert. The engine replica is what a source builds for an
engine-replica target (``layout/replica_manifest.py``, ``source/engine_loader.py``): the rank's layout from SGLang's
code, the replica and feed files in ``/dev/shm``, and the loader process in SGLang's Python. Measured per round:

* memcpy: one copy of the trainer's bytes (the floor of any staging);
* plain staging: ``stage()`` of every tensor into a replica that holds them whole (what the trace path pays for the
  same bytes: a copy into shared memory, cut or not);
* feed staging: ``stage()`` into the engine replica's feed (with ``--fp8``, quantizing the BF16 tensors as the FP8
  checkpoint stores them, on the CPU here; a trainer's GPU quantizes at 118 GB/s, bench/quantize_bench.py);
* engine replica load: the loader's ``load_weights`` over the feed into the replica (the extra an engine replica
  costs);

as GB/s of the trainer's bytes, per CPU thread, and as ratios to memcpy. Absolute numbers mean something on the GPU
machine's 16 cores; this machine's 2 give the ratios. Needs the SGLang venv (``WEIGHTSYNC_SGLANG_PYTHON``).

    python bench/engine_replica_bench.py [--hidden 1024] [--layers 4] [--experts 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable

import torch

from weightsync_agent.engine_python import ENV_ENGINE_PYTHON
from weightsync_agent.layout.manifest import ITEMSIZE
from weightsync_agent.layout.replica_manifest import assemble
from weightsync_agent.source.engine_loader import EngineLoader
from weightsync_agent.source.replica import Replica, ReplicaLayout, ReplicaSet
from weightsync_agent.targets.engine_trace import run_replica_layout
from weightsync_testing.sglang_env import sglang_python
from weightsync_testing.sglang_models import ensure_fp8_model, ensure_tiny_model, trained_state


def best(run: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat + 1):  # the first is a warm-up
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="an FP8 block target: the trainer's BF16 tensors quantized as they are staged",
    )
    args = parser.parse_args()
    python = str(sglang_python())
    os.environ[ENV_ENGINE_PYTHON] = python
    shape = {
        "hidden_size": args.hidden,
        "intermediate_size": 4 * args.hidden,
        "moe_intermediate_size": args.hidden // 2,
        "num_hidden_layers": args.layers,
        "n_routed_experts": args.experts,
        "q_lora_rank": args.hidden // 2,
        "kv_lora_rank": args.hidden // 4,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
    }
    model = ensure_tiny_model(python, "deepseek_v3", shape=shape, timeout=900)
    full = trained_state(model, 1)
    dtype = "float32"
    if args.fp8:
        model, dtype = ensure_fp8_model(model, (128, 128)), "bfloat16"
        full = {name: t.to(torch.bfloat16) for name, t in full.items()}
    layout = run_replica_layout("sglang", model=str(model), tp=1, rank=0, dtype=dtype, who="bench")
    published = {
        t["name"]: [4096 * (i + 1) << 20, t["nbytes"] // ITEMSIZE[t["dtype"]], ITEMSIZE[t["dtype"]]]
        for i, t in enumerate(layout["tensors"])
    }
    published |= {name: [1 << 40, 1, 4] for name in layout.get("kept", [])}  # the engine's own (KV-cache scales)
    manifest = assemble(0, 0, layout, "bench:1", published, checksum="tensor-sha256-8", model=str(model))
    nbytes = sum(t.numel() * t.element_size() for t in full.values())
    target = "an FP8 block target" if args.fp8 else "a float32 target"
    print(f"model: {len(full)} trainer tensors, {nbytes / 2**20:.0f} MiB {dtype}, into {target}; replica "
          f"{manifest.total_bytes / 2**20:.0f} MiB; {torch.get_num_threads()} CPU threads")  # fmt: skip
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        replicas = ReplicaSet.for_manifests([manifest], shm_dir=shm, pin=False)
        [engine] = list(replicas)
        loader = EngineLoader(engine, replicas.feed_for(engine))
        try:
            flat = torch.empty(nbytes, dtype=torch.uint8)
            views = [t.reshape(-1).view(torch.uint8) for t in full.values()]

            def memcpy() -> None:
                at = 0
                for view in views:
                    flat[at : at + view.numel()].copy_(view)
                    at += view.numel()

            def stage() -> None:
                replicas.reset()
                replicas.stage_many(full)

            whole = [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                     for n, t in full.items()]  # fmt: skip
            plain = ReplicaSet([], [Replica(ReplicaLayout.of_feeds({"feeds": whole}), pin=False)])

            def stage_plain() -> None:
                plain.reset()
                plain.stage_many(full)

            copy_s = best(memcpy, args.repeat)
            plain_s = best(stage_plain, args.repeat)
            stage_s = best(stage, args.repeat)
            load_s = min(loader.load(600) for _ in range(args.repeat + 1))
        finally:
            loader.close()
            replicas.close(unlink=True)
    threads = torch.get_num_threads()
    rows = [("memcpy", copy_s), ("plain staging", plain_s), ("feed staging" + (" (quantizing)" if args.fp8 else ""),
            stage_s), ("engine replica load", load_s), ("feed staging + load", stage_s + load_s)]  # fmt: skip
    print(f"{'step':<26} {'seconds':>8} {'GB/s':>8} {'GB/s/thread':>12} {'x memcpy':>9}")
    for name, seconds in rows:
        rate = nbytes / seconds / 1e9
        print(f"{name:<26} {seconds:8.3f} {rate:8.2f} {rate / threads:12.2f} {seconds / copy_s:9.1f}")


if __name__ == "__main__":
    main()
