# mypy: ignore-errors
# (a Triton kernel: its parameters are typed by Triton's own annotations, which mypy cannot read)
"""The Triton kernel behind :func:`~weightsync_agent.layout.sglang_hash.tensor_hash.sglang_gpu_hash` for CUDA
tensors, used when triton is importable (it ships with CUDA builds of torch); :mod:`.tensor_hash` falls back
to torch ops without it.

Written from the algorithm (shared/notes/stock-engines.md §2), not copied from SGLang: one program per
8192-word tile, blocks of ``BLOCK`` words, both lanes in uint32, the tile's two lane sums written out as int32
bits. Finishing the tiles (fmix32 with the byte count, the mod 2**64 sum, splitmix64) happens on the host from
those sums, as for the other backends. Verified against the host port on an H200 by bench/sglang_hash_bench.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weightsync_agent.layout.sglang_hash.tensor_hash import (
    FMIX32_C1,
    FMIX32_C2,
    POS_A,
    POS_B,
    SEED1,
    SEED2,
    TILE_WORDS,
)

BLOCK = 1024


@triton.jit
def _tile_lane_sums(
    words_ptr,
    out1_ptr,
    out2_ptr,
    n_words,
    tile_words: tl.constexpr,
    block: tl.constexpr,
    seed_1: tl.constexpr,
    seed_2: tl.constexpr,
    mul_a: tl.constexpr,
    mul_b: tl.constexpr,
    fm1: tl.constexpr,
    fm2: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    acc1 = tl.zeros((block,), dtype=tl.uint32)
    acc2 = tl.zeros((block,), dtype=tl.uint32)
    for start in range(0, tile_words, block):
        idx = tile * tile_words + start + tl.arange(0, block)
        inside = idx < n_words
        w = tl.load(words_ptr + idx, mask=inside, other=0).to(tl.uint32, bitcast=True)
        i = idx.to(tl.uint32)  # the global word index, mod 2**32
        x = w ^ ((i * tl.full((), mul_a, tl.uint32) + tl.full((), seed_1, tl.uint32)) ^ ((i << 15) | (i >> 17)))
        y = w ^ ((i * tl.full((), mul_b, tl.uint32) + tl.full((), seed_2, tl.uint32)) ^ ((i << 13) | (i >> 19)))
        x ^= x >> 16
        x *= tl.full((), fm1, tl.uint32)
        x ^= x >> 13
        x *= tl.full((), fm2, tl.uint32)
        x ^= x >> 16
        y ^= y >> 16
        y *= tl.full((), fm1, tl.uint32)
        y ^= y >> 13
        y *= tl.full((), fm2, tl.uint32)
        y ^= y >> 16
        acc1 += tl.where(inside, x, tl.zeros_like(x))
        acc2 += tl.where(inside, y, tl.zeros_like(y))
    tl.store(out1_ptr + tile, tl.sum(acc1, axis=0).to(tl.uint32).to(tl.int32, bitcast=True))
    tl.store(out2_ptr + tile, tl.sum(acc2, axis=0).to(tl.uint32).to(tl.int32, bitcast=True))


def tile_sums(words: torch.Tensor) -> torch.Tensor:
    """Both lane sums of every tile of the contiguous int32 CUDA tensor ``words`` (all the tensor's words),
    as a ``(2, tiles)`` int32 tensor on its device."""
    tiles = -(-words.numel() // TILE_WORDS)
    out = torch.empty((2, tiles), dtype=torch.int32, device=words.device)
    _tile_lane_sums[(tiles,)](
        words,
        out[0],
        out[1],
        words.numel(),
        tile_words=TILE_WORDS,
        block=BLOCK,
        seed_1=SEED1,
        seed_2=SEED2,
        mul_a=POS_A,
        mul_b=POS_B,
        fm1=FMIX32_C1,
        fm2=FMIX32_C2,
    )
    return out
