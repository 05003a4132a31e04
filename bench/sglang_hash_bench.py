"""SGLang weight-hash benchmark: how fast a source computes the hash that ``/weights_checker`` reports.

    python bench/sglang_hash_bench.py [--mib 256] [--reps 3] [--threads 1 2] [--naive-mib 32] [--json PATH]
    python bench/sglang_hash_bench.py --gpu-only [--gpu-mib 1024]     # on a CUDA host: equality + GPU timings

Host part: MiB/s per core, hashing a ``--mib`` bfloat16 tensor per thread (each thread its own tensor, so
threads never share work), of

- the ``gpu_tensor_hash`` port (``weightsync_agent.layout.sglang_hash.tensor_hash``), each host backend: ``numba``
  (when installed), ``numpy`` (the fallback), ``torch`` (the device path, run on the CPU);
- ``sha256[:8]``, the hash SGLang reports for CPU engines;
- a naive numpy port (whole-array uint32 arithmetic, no chunking, like the note's; on ``--naive-mib``);

each also as a ratio to a plain memcpy of the same bytes (``np.copyto`` into a buffer already touched),
measured in the same run with the same thread count. torch gets one intra-op thread, so one thread is one core.
Best of ``--reps``. Every implementation's value is checked equal to the numpy backend's on the same tensor.

GPU part (only where CUDA is available): each device backend of the port (``torch`` ops, the ``triton``
kernel) against the host port, on tensors like the note's eight (bf16 1 GiB included, ``--gpu-mib``), and
against SGLang's own ``gpu_tensor_hash`` when sglang is importable there; then timings against a
device-to-device copy. A benchmark, not a test: it exits 1 only if a value differs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from weightsync_agent.layout.sglang_hash import tensor_hash as th
from weightsync_agent.layout.sglang_hash.tensor_hash import (
    numba_available,
    sglang_cpu_hash,
    sglang_gpu_hash,
    triton_available,
)

MiB = 1 << 20
M32 = 0xFFFFFFFF

# --- the naive baseline ---------------------------------------------------------------------------------


def naive_numpy_gpu_hash(raw: np.ndarray) -> str:
    """The straightforward numpy port: whole-array uint32 arithmetic (it wraps mod 2**32 by itself), one
    temporary array per step, no chunking."""
    b = raw.reshape(-1).view(np.uint8)
    if b.size % 4:
        b = np.concatenate([b, np.zeros(4 - b.size % 4, dtype=np.uint8)])
    w = b.view("<u4")
    n = w.size
    if n == 0:
        return "0" * 16
    u = np.uint32
    i = np.arange(n, dtype=np.uint32)

    def fmix(x: np.ndarray) -> np.ndarray:
        x = x ^ (x >> u(16))
        x = x * u(th.FMIX32_C1)
        x = x ^ (x >> u(13))
        x = x * u(th.FMIX32_C2)
        return x ^ (x >> u(16))

    def rotl(x: np.ndarray, r: int) -> np.ndarray:
        return (x << u(r)) | (x >> u(32 - r))

    k1 = fmix(w ^ ((i * u(th.POS_A) + u(th.SEED1)) ^ rotl(i, 15)))
    k2 = fmix(w ^ ((i * u(th.POS_B) + u(th.SEED2)) ^ rotl(i, 13)))
    tiles = -(-n // th.TILE_WORDS)
    pad = np.zeros(tiles * th.TILE_WORDS - n, dtype=np.uint32)
    s1 = np.concatenate([k1, pad]).reshape(tiles, -1).sum(axis=1, dtype=np.uint32)
    s2 = np.concatenate([k2, pad]).reshape(tiles, -1).sum(axis=1, dtype=np.uint32)
    nb = u((4 * n) & M32)
    h1 = fmix(s1 ^ nb).astype(np.uint64)
    h2 = fmix(s2 ^ nb).astype(np.uint64)
    total = int(((h1 << np.uint64(32)) | h2).sum(dtype=np.uint64))  # uint64 sum wraps mod 2**64
    return f"{th._splitmix64(total):016x}"


# --- host timing ----------------------------------------------------------------------------------------


def best_parallel(work: Callable[[int], Any], threads: int, reps: int) -> tuple[float, list[Any]]:
    """Best wall time of ``threads`` threads each running ``work(thread_index)`` at once; their last results."""
    best = float("inf")
    results: list[Any] = [None] * threads
    for _ in range(reps):

        def run(k: int) -> None:
            results[k] = work(k)

        pool = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
        start = time.perf_counter()
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
        best = min(best, time.perf_counter() - start)
    return best, results


def host_bench(mib: int, reps: int, thread_counts: list[int], naive_mib: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    most = max(thread_counts)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(mib * MiB // 2, generator=gen).bfloat16() for _ in range(most)]
    arrays = [t.view(torch.uint8).numpy() for t in tensors]
    copies = [np.ones_like(a) for a in arrays]  # touched, so the copy never page-faults
    for a in arrays:
        sglang_gpu_hash(a[: 3 * 4 * th.TILE_WORDS + 5])  # compile / warm every path once
    expected = [sglang_gpu_hash(a, backend="numpy") for a in arrays]

    cases: dict[str, Callable[[int], Any]] = {"memcpy": lambda k: np.copyto(copies[k], arrays[k])}
    if numba_available():
        cases["gpu-hash numba"] = lambda k: sglang_gpu_hash(arrays[k], backend="numba")
    cases["gpu-hash numpy"] = lambda k: sglang_gpu_hash(arrays[k], backend="numpy")
    cases["gpu-hash torch (cpu)"] = lambda k: sglang_gpu_hash(tensors[k], backend="torch")
    cases["sha256[:8]"] = lambda k: sglang_cpu_hash(arrays[k])
    naive_bytes = min(naive_mib, mib) * MiB
    cases["naive numpy port"] = lambda k: naive_numpy_gpu_hash(arrays[k][:naive_bytes])
    naive_expected = [sglang_gpu_hash(a[:naive_bytes], backend="numpy") for a in arrays]

    rows: list[dict[str, Any]] = []
    mismatches: list[str] = []
    for threads in thread_counts:
        memcpy_rate = 0.0
        for name, work in cases.items():
            size = naive_bytes if name == "naive numpy port" else mib * MiB
            seconds, results = best_parallel(work, threads, reps)
            rate = threads * size / MiB / seconds
            if name == "memcpy":
                memcpy_rate = rate
            elif name.startswith("gpu-hash") or name == "naive numpy port":
                want = naive_expected if name == "naive numpy port" else expected
                if results != want[:threads]:
                    mismatches.append(f"{name} x{threads}: {results} != {want[:threads]}")
            rows.append(
                {
                    "name": name,
                    "threads": threads,
                    "mib": size / MiB,
                    "seconds": seconds,
                    "mib_s": rate,
                    "mib_s_per_core": rate / threads,
                    "vs_memcpy": rate / memcpy_rate if memcpy_rate else 1.0,
                }
            )
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {mib} MiB bf16 per thread")
    print(f"{'':24}{'threads':>8}{'MiB/s':>10}{'MiB/s/core':>12}{'x memcpy':>10}")
    for r in rows:
        print(f"{r['name']:24}{r['threads']:>8}{r['mib_s']:>10.0f}{r['mib_s_per_core']:>12.0f}{r['vs_memcpy']:>10.3f}")
    for line in mismatches:
        print("MISMATCH", line)
    return {"rows": rows, "mismatches": mismatches, "numba": numba_available()}


# --- GPU: equality and timing -----------------------------------------------------------------------------


def sglang_kernel() -> tuple[str, Callable[[torch.Tensor], str]] | None:
    """SGLang's own ``gpu_tensor_hash``, where sglang is importable (module path differs across releases)."""
    for module in ("sglang.kernels.ops.memory.gpu_tensor_hash", "sglang.srt.layers.multimodal"):
        try:
            fn = importlib.import_module(module).gpu_tensor_hash
        except (ImportError, AttributeError):
            continue
        return f"sglang {module}", lambda t, fn=fn: f"{fn(t):016x}"
    return None


def cuda_seconds(fn: Callable[[], Any], reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def gpu_bench(gpu_mib: int, reps: int) -> dict[str, Any]:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    cases: dict[str, torch.Tensor] = {
        "bf16 128x128": torch.randn(128, 128, device=dev, generator=gen).bfloat16(),
        "bf16 1280x5120": torch.randn(1280, 5120, device=dev, generator=gen).bfloat16(),
        "fp32 1000": torch.randn(1000, device=dev, generator=gen),
        "uint8 3 B": torch.randint(0, 256, (3,), dtype=torch.uint8, device=dev, generator=gen),
        "uint8 32773 B": torch.randint(0, 256, (32773,), dtype=torch.uint8, device=dev, generator=gen),
        "bf16 slice non-contiguous": torch.randn(512, 300, device=dev, generator=gen).bfloat16()[:, 7:200],
        "bf16 odd offset": torch.randn(3 * 8192 + 5, device=dev, generator=gen).bfloat16()[1:],
        f"bf16 {gpu_mib} MiB": torch.randn(gpu_mib * MiB // 2, device=dev, generator=gen).bfloat16(),
    }
    if hasattr(torch, "float8_e4m3fn"):
        cases["fp8_e4m3 4096x4096"] = torch.randn(4096, 4096, device=dev, generator=gen).to(torch.float8_e4m3fn)
    kernels: list[tuple[str, Callable[[torch.Tensor], str]]] = [
        ("port, torch ops", lambda t: sglang_gpu_hash(t, backend="torch")),
    ]
    if triton_available():
        kernels.append(("port, triton kernel", lambda t: sglang_gpu_hash(t, backend="triton")))
    own = sglang_kernel()
    if own is not None:
        kernels.append(own)
    mismatches: list[str] = []
    host = "numba" if numba_available() else "numpy"
    print(f"gpu: {torch.cuda.get_device_name()}; reference = the port on the host ({host})")
    for name, t in cases.items():
        want = sglang_gpu_hash(t.cpu())
        got: dict[str, str] = {}
        for kernel, fn in kernels:
            try:
                got[kernel] = fn(t)
            except Exception as e:  # SGLang's kernel refuses some layouts (a misaligned view, say)
                got[kernel] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
        bad = {k: v for k, v in got.items() if v != want and not v.startswith("error")}
        if bad:
            mismatches.append(f"{name}: host {want}, {bad}")
        errors = {k: v for k, v in got.items() if v.startswith("error")}
        verdict = "DIFFERENT " + json.dumps(bad) if bad else f"equal ({len(got) - len(errors)} kernels)"
        print(f"  {name:28} {want}  {verdict}" + (f"  {json.dumps(errors)}" if errors else ""))
    big = cases[f"bf16 {gpu_mib} MiB"]
    dst = torch.empty_like(big)
    timings = {"d2d copy": cuda_seconds(lambda: dst.copy_(big), reps)}
    for name, fn in kernels:
        timings[name] = cuda_seconds(lambda fn=fn: fn(big), reps)
    for name, seconds in timings.items():
        gib_s = gpu_mib / 1024 / seconds
        print(f"  {name:40} {seconds * 1e3:8.2f} ms {gib_s:8.1f} GiB/s  x copy {timings['d2d copy'] / seconds:.3f}")
    return {"device": torch.cuda.get_device_name(), "timings_s": timings, "mismatches": mismatches}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--naive-mib", type=int, default=32)
    parser.add_argument("--gpu-mib", type=int, default=1024)
    parser.add_argument("--gpu-only", action="store_true")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    report: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__, "numpy": np.__version__}
    if not args.gpu_only:
        report["host"] = host_bench(args.mib, args.reps, args.threads, args.naive_mib)
    if torch.cuda.is_available():
        report["gpu"] = gpu_bench(args.gpu_mib, args.reps)
    elif args.gpu_only:
        print("no CUDA device")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    bad = report.get("host", {}).get("mismatches", []) + report.get("gpu", {}).get("mismatches", [])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
