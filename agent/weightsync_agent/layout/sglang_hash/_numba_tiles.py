"""The compiled CPU loop behind :func:`~weightsync_agent.layout.sglang_hash.tensor_hash.sglang_gpu_hash`.

Imported only when numba is installed (an optional dependency): :mod:`.tensor_hash` falls back to numpy without
it. One pass over the words, no temporaries, the GIL released; LLVM vectorises the inner loop, which is why
every step is written in uint32 (numba widens integer arithmetic to 64 bits unless each result is cast back).

Word ``i = base + k`` of tile ``t`` (``base = t * 8192 mod 2**32``, ``k < 8192``): since ``base`` has its low 13
bits clear, ``i * A + S = (base * A + S) + k * A`` and ``rotl(i, r) = rotl(base, r) ^ rotl(k, r)``, so the
per-word position terms need only the tile's constants and the in-tile offset ``k``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np

from weightsync_agent.layout.sglang_hash.tensor_hash import (
    FMIX32_C1,
    FMIX32_C2,
    POS_A,
    POS_B,
    SEED1,
    SEED2,
    TILE_WORDS,
)

_numba: Any = importlib.import_module("numba")  # ImportError here means "no numba": the caller falls back
_u32 = np.uint32
_M32 = 0xFFFFFFFF
TILE = TILE_WORDS
_F = TypeVar("_F", bound=Callable[..., Any])


def _inline(fn: _F) -> _F:
    """``njit(inline="always")``: a helper that numba inlines into its callers (so LLVM sees one loop)."""
    return cast(_F, _numba.njit(inline="always")(fn))


def _jit(fn: Callable[..., Any]) -> Any:
    """``njit(nogil=True)``, cached on disk where numba finds a writable cache directory."""
    try:
        return _numba.njit(nogil=True, cache=True)(fn)
    except RuntimeError:  # "cannot cache function …: no locator available" (read-only install, no cache dir)
        return _numba.njit(nogil=True)(fn)


@_inline
def _fmix32(x: Any) -> Any:
    x = _u32(x ^ (x >> _u32(16)))
    x = _u32(x * _u32(FMIX32_C1))
    x = _u32(x ^ (x >> _u32(13)))
    x = _u32(x * _u32(FMIX32_C2))
    return _u32(x ^ (x >> _u32(16)))


@_inline
def _lane(v: Any, k: Any, c: Any, r: Any, pos_mul: Any, rot: int) -> Any:
    """One lane of word ``base + k``: ``fmix32(v ^ ((k*pos_mul + c) ^ r ^ rotl(k, rot)))``."""
    rotl = _u32(_u32(k << _u32(rot)) | (k >> _u32(32 - rot)))
    return _fmix32(_u32(v ^ _u32(_u32(_u32(k * pos_mul) + c) ^ _u32(r ^ rotl))))


@_inline
def _tile_constants(tile: Any) -> Any:
    """``base*POS_A + SEED1``, ``rotl(base, 15)``, ``base*POS_B + SEED2``, ``rotl(base, 13)``, ``base = tile*8192``."""
    base = _u32((tile * TILE) & _M32)
    c1 = _u32(_u32(base * _u32(POS_A)) + _u32(SEED1))
    c2 = _u32(_u32(base * _u32(POS_B)) + _u32(SEED2))
    r1 = _u32(_u32(base << _u32(15)) | (base >> _u32(17)))
    r2 = _u32(_u32(base << _u32(13)) | (base >> _u32(19)))
    return c1, r1, c2, r2


@_inline
def _partial_tile(seg: Any, tile: Any, k0: Any, out1: Any, out2: Any, slot: Any) -> None:
    """Lane sums of ``seg``, the words of tile ``tile`` from in-tile offset ``k0``, into ``out[slot]``."""
    c1, r1, c2, r2 = _tile_constants(tile)
    h1 = _u32(0)
    h2 = _u32(0)
    for j in range(seg.size):
        k = _u32(k0 + j)
        h1 = _u32(h1 + _lane(seg[j], k, c1, r1, _u32(POS_A), 15))
        h2 = _u32(h2 + _lane(seg[j], k, c2, r2, _u32(POS_B), 13))
    out1[slot] = h1
    out2[slot] = h2


def _tile_sums_py(words: Any, first_index: int, out1: Any, out2: Any) -> None:
    """``out1[j], out2[j]``: the lane sums (mod 2**32) of ``words`` over tile ``first_index // TILE + j``, where
    ``words[m]`` is word ``first_index + m`` of the whole tensor. Tiles cut by the chunk get partial sums."""
    n = words.size
    if n == 0:
        return
    first_tile = first_index // TILE
    k0 = first_index - first_tile * TILE
    head = 0
    if k0 != 0 or n < TILE:  # a cut first tile
        head = min(n, TILE - k0)
        _partial_tile(words[:head], first_tile, k0, out1, out2, 0)
    body = words[head:]  # whole tiles, then maybe a cut last one; indexed from 0 by ranges, so it vectorises
    slot0 = 1 if head else 0
    tile0 = first_tile + slot0
    whole = body.size // TILE
    for t in range(whole):
        c1, r1, c2, r2 = _tile_constants(tile0 + t)
        h1 = _u32(0)
        h2 = _u32(0)
        off = t * TILE
        for k in range(TILE):  # constant trip count: the fast path
            h1 = _u32(h1 + _lane(body[off + k], _u32(k), c1, r1, _u32(POS_A), 15))
            h2 = _u32(h2 + _lane(body[off + k], _u32(k), c2, r2, _u32(POS_B), 13))
        out1[slot0 + t] = h1
        out2[slot0 + t] = h2
    if whole * TILE < body.size:
        _partial_tile(body[whole * TILE :], tile0 + whole, 0, out1, out2, slot0 + whole)


tile_sums: Callable[[Any, int, Any, Any], None] = _jit(_tile_sums_py)
