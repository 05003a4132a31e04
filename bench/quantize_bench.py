"""The quantizers (``weightsync_agent.layout.quantize``: FP8 block, FP8 and INT8 per channel): their throughput against
a plain copy of the same bytes on the same device, and whether CPU and GPU give the same bytes.

For each device (the CPU, and the GPU when there is one): a copy of a BF16 weight (the baseline: what staging the
BF16 bytes costs), then each quantizer of it. Prints GB/s of BF16 input and the ratio quantize / copy. With a GPU it
also quantizes seeded weights of several shapes on both and compares the bytes (weight and scale): the quantizers
are meant to be deterministic across devices (docs/engines/engine-replicas.md, "FP8 targets").

    python bench/quantize_bench.py [--rows 4096] [--cols 14336] [--repeat 3]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))  # not installed on the GPU machine
from weightsync_agent.layout.quantize import fp8_block, fp8_channel, int8_channel

#: name -> quantizer of a 2-D weight; the channel ones store their scale in the weight's dtype, as checkpoints do.
QUANTIZERS = {
    "fp8_block": fp8_block,
    "fp8_channel": lambda w: fp8_channel(w, w.dtype),
    "int8_channel": lambda w: int8_channel(w, w.dtype),
}

SHAPES = [(128, 128), (300, 200), (4096, 1024), (7168, 2048), (129, 7)]


def timed(device: str, run: Any, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat + 1):  # the first is a warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=14336)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, devices: {', '.join(devices)}")
    nbytes = args.rows * args.cols * 2
    for device in devices:
        weight = torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        weight = weight.to(device)
        copy = timed(device, lambda w=weight: w.clone(), args.repeat)
        baseline = nbytes / copy / 1e9
        print(f"{device}: {args.rows}x{args.cols} bf16 ({nbytes / 1e9:.2f} GB): copy {baseline:.1f} GB/s")
        for name, quantizer in QUANTIZERS.items():
            quantize = timed(device, lambda w=weight, q=quantizer: q(w), args.repeat)
            print(f"  {name}: {nbytes / quantize / 1e9:.2f} GB/s of bf16 input, quantize/copy {quantize / copy:.1f}x")
    if "cuda" in devices:
        same = total = 0
        for name, quantizer in QUANTIZERS.items():
            for index, (rows, cols) in enumerate(SHAPES):
                for scale in (1e-3, 1.0, 300.0):
                    seeded = torch.Generator().manual_seed(index)
                    weight = (torch.randn(rows, cols, generator=seeded) * scale).to(torch.bfloat16)
                    cpu, gpu = digest(*quantizer(weight)), digest(*quantizer(weight.cuda()))
                    same, total = same + (cpu == gpu), total + 1
                    if cpu != gpu:
                        print(f"DIFFERENT bytes, {name} of {rows}x{cols} x{scale}: cpu {cpu}, gpu {gpu}")
        print(f"CPU and GPU bytes equal in {same} of {total} weights ({', '.join(QUANTIZERS)})")
        return 0 if same == total else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
