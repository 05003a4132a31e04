"""SGLang's per-parameter content hashes, computed on the source side, bit-identical to the engine's.

SGLang (0.5.16 on) answers ``/weights_checker {"action": "checksum"}`` with ``"%016x"`` of a 64-bit hash per
parameter and TP rank; ``srt/managers/mm_utils.py`` ``tensor_hash`` picks it by the tensor's device:

* a CUDA (or ROCm) tensor: ``gpu_tensor_hash``, a Triton kernel (``kernels/ops/memory/gpu_tensor_hash.py``),
  here :func:`sglang_gpu_hash`;
* a CPU tensor: the first 8 bytes of sha256 over the tensor's raw bytes, big-endian, here :func:`sglang_cpu_hash`.

:func:`hash_for_device` picks one by the engine's device.

``gpu_tensor_hash``: the tensor's bytes (C order), zero-padded to a multiple of 4, are read as little-endian
uint32 words ``w[0..n)``. Word ``i`` (its index in the whole tensor, mod 2**32) gives two lanes
``k1 = fmix32(w[i] ^ ((i*POS_A + SEED1) ^ rotl(i, 15)))`` and ``k2 = fmix32(w[i] ^ ((i*POS_B + SEED2) ^ rotl(i, 13)))``.
Each tile of 8192 words sums each lane mod 2**32 and becomes ``fmix32(sum1 ^ 4n) << 32 | fmix32(sum2 ^ 4n)``, where
``4n`` is the padded byte count of the whole tensor (mod 2**32); the tiles are summed mod 2**64 and the total is
finished with splitmix64. An empty tensor hashes to 0.

Four implementations, one value (``tests/unit/agent/sglang`` checks them against a plain-Python reference):

* ``numba``: a compiled loop (:mod:`._numba_tiles`) for host memory whenever numba is importable, an optional
  dependency; faster than a memcpy of the same bytes;
* ``numpy``: vectorised uint32 arithmetic on cache-sized blocks, the host fallback without numba;
* ``triton``: a Triton kernel (:mod:`._triton_tiles`) for CUDA tensors whenever triton is importable, so a
  trainer hashes on its GPU, before the copy to the replica, at close to memory bandwidth;
* ``torch``: the numpy arithmetic as int32 torch ops on the tensor's own device: the accelerator fallback
  without triton (about 40x slower than the kernel on an H200, still far faster than a host hash).

Each releases the GIL while it computes, so threads can hash different tensors at once. Words are processed in
chunks of ``chunk_words`` to bound memory; a chunk continues the global word index and may cut a tile anywhere
(partial tile sums are added up before the tile is finished), so the chunk size never changes the value.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Final, Literal, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

HashInput: TypeAlias = torch.Tensor | np.ndarray | bytes | bytearray | memoryview
"""What the hashes take: a tensor (any dtype, shape, strides, device) or a C-contiguous buffer of raw bytes."""

Backend: TypeAlias = Literal["auto", "numba", "numpy", "torch", "triton"]
U32Array: TypeAlias = npt.NDArray[np.uint32]
TileSums: TypeAlias = Callable[[U32Array, int], tuple[U32Array, U32Array]]

TILE_WORDS: Final = 8192
SEED: Final = 0x243F6A88
SEED1: Final = SEED & 0xFFFFFFFF
SEED2: Final = ((SEED * 0x9E3779B1) ^ 0xDEADBEEF) & 0xFFFFFFFF
FMIX32_C1: Final = 0x85EBCA6B
FMIX32_C2: Final = 0xC2B2AE35
POS_A: Final = 0x27D4EB2D
POS_B: Final = 0x165667B1
SPLITMIX_C1: Final = 0xBF58476D1CE4E5B9
SPLITMIX_C2: Final = 0x94D049BB133111EB
EMPTY_HASH: Final = "0000000000000000"

_M32: Final = 0xFFFFFFFF
_M64: Final = 0xFFFFFFFFFFFFFFFF
_NUMPY_ROWS: Final = 8  # tiles per numpy block: two uint32 temporaries of 256 KiB, cache-sized
_DEFAULT_CHUNK_WORDS: Final = {"numba": 1 << 26, "numpy": 1 << 20, "torch_cpu": 1 << 16, "torch_device": 1 << 24}


# --- the public functions ------------------------------------------------------------------------------------


def sglang_cpu_hash(data: HashInput, *, bf16_as_fp32: bool = False) -> str:
    """SGLang's hash of a CPU tensor: ``"%016x"`` of the first 8 bytes of sha256 over its raw bytes, big-endian.

    A tensor on another device is copied to the host first. ``bf16_as_fp32`` reproduces SGLang releases from before
    sgl-project/sglang#21123, whose ``tensor_hash`` converted a bfloat16 CPU tensor to float32 before hashing.
    hashlib releases the GIL while it hashes.
    """
    if bf16_as_fp32 and isinstance(data, torch.Tensor) and data.dtype == torch.bfloat16:
        data = data.float()
    return hashlib.sha256(_host_bytes(data).data).digest()[:8].hex()


def sglang_gpu_hash(data: HashInput, *, backend: Backend = "auto", chunk_words: int | None = None) -> str:
    """SGLang's ``gpu_tensor_hash`` of ``data`` as ``"%016x"`` (the module docstring gives the algorithm).

    ``backend="auto"``: for an accelerator tensor ``triton`` if it is installed (CUDA), else ``torch``, on the
    tensor's own device; for host memory ``numba`` if it is installed, else ``numpy``. ``numba`` and ``numpy``
    copy an accelerator tensor to the host first; ``torch`` hashes host memory on the CPU; ``triton`` takes CUDA
    tensors only. ``chunk_words`` (default: per backend; unused by ``triton``) bounds the words processed at
    once; it does not change the value.
    """
    return f"{_gpu_hash_value(data, backend, chunk_words):016x}"


def hash_for_device(engine_device: str) -> Callable[[HashInput], str]:
    """The hash SGLang reports for parameters on ``engine_device``: ``"cuda"`` (also ``"cuda:N"``, ``"hip"``,
    ``"rocm"``) → :func:`sglang_gpu_hash`, ``"cpu"`` → :func:`sglang_cpu_hash`."""
    kind = engine_device.split(":", 1)[0].strip().lower()
    if kind in ("cuda", "hip", "rocm"):
        return sglang_gpu_hash
    if kind == "cpu":
        return sglang_cpu_hash
    raise ValueError(f"no SGLang weight hash is known for engine device {engine_device!r} (known: cuda, cpu)")


def numba_available() -> bool:
    """Whether the compiled host implementation can be used (numba importable)."""
    return _numba_tile_sums() is not None


def triton_available() -> bool:
    """Whether the Triton kernel can be used for CUDA tensors (triton importable)."""
    return _triton_tile_sums() is not None


# --- dispatch and the parts the implementations share ----------------------------------------------------------


def _gpu_hash_value(data: HashInput, backend: Backend, chunk_words: int | None) -> int:
    if chunk_words is not None and chunk_words < 1:
        raise ValueError(f"chunk_words must be positive, got {chunk_words}")
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        raise NotImplementedError("the gpu_tensor_hash port assumes a little-endian host")
    on_device = isinstance(data, torch.Tensor) and data.device.type != "cpu"
    if backend == "auto" and on_device and isinstance(data, torch.Tensor):
        backend = "triton" if data.device.type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        device_sums = _triton_tile_sums()
        if device_sums is None:
            raise RuntimeError("backend='triton' needs triton, which is not importable here")
        if not isinstance(data, torch.Tensor) or data.device.type != "cuda":
            raise ValueError("backend='triton' hashes CUDA tensors only")
        return _triton_hash(_tensor_bytes(data.detach()), device_sums)
    if backend == "torch":
        if isinstance(data, torch.Tensor):
            flat = _tensor_bytes(data.detach())
        else:  # host bytes: copy, since torch wants a writable array
            flat = torch.from_numpy(_host_bytes(data).copy())
        default = "torch_device" if flat.device.type != "cpu" else "torch_cpu"
        return _torch_hash(flat, chunk_words or _DEFAULT_CHUNK_WORDS[default])
    if backend == "auto":
        backend = "numba" if numba_available() else "numpy"
    if backend == "numba":
        kernel = _numba_tile_sums()
        if kernel is None:
            raise RuntimeError("backend='numba' needs numba, which is not importable here")
        return _host_hash(_host_bytes(data), kernel, chunk_words or _DEFAULT_CHUNK_WORDS["numba"])
    if backend == "numpy":
        return _host_hash(_host_bytes(data), _numpy_tile_sums, chunk_words or _DEFAULT_CHUNK_WORDS["numpy"])
    raise ValueError(f"unknown backend {backend!r}")


def _tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in C order as a 1-D uint8 tensor on its device (a view when it is contiguous)."""
    t = t.resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8)  # reshape first: a 0-dim tensor cannot change its element size


def _host_bytes(data: HashInput) -> npt.NDArray[np.uint8]:
    """The raw bytes of ``data`` in host memory as a 1-D uint8 array, without a copy where possible."""
    if isinstance(data, torch.Tensor):
        t = data.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        return _tensor_bytes(t).numpy()
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def _fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * FMIX32_C1) & _M32
    x ^= x >> 13
    x = (x * FMIX32_C2) & _M32
    return x ^ (x >> 16)


def _lanes(word: int, index: int) -> tuple[int, int]:
    """Both lanes of one word at global ``index``, in Python ints."""
    i = index & _M32
    p1 = ((i * POS_A + SEED1) & _M32) ^ (((i << 15) | (i >> 17)) & _M32)
    p2 = ((i * POS_B + SEED2) & _M32) ^ (((i << 13) | (i >> 19)) & _M32)
    return _fmix32(word ^ p1), _fmix32(word ^ p2)


def _splitmix64(x: int) -> int:
    x &= _M64
    x ^= x >> 30
    x = (x * SPLITMIX_C1) & _M64
    x ^= x >> 27
    x = (x * SPLITMIX_C2) & _M64
    return x ^ (x >> 31)


def _fmix32_np(x: U32Array) -> U32Array:
    x = x ^ (x >> np.uint32(16))
    x *= np.uint32(FMIX32_C1)
    x ^= x >> np.uint32(13)
    x *= np.uint32(FMIX32_C2)
    x ^= x >> np.uint32(16)
    return x


def _finish(sums1: U32Array, sums2: U32Array, n_words: int) -> int:
    """The hash from every tile's two lane sums (mod 2**32): finish each tile, add them mod 2**64, splitmix64."""
    nbytes = np.uint32((4 * n_words) & _M32)
    high = int(_fmix32_np(sums1 ^ nbytes).sum(dtype=np.uint64))  # < 2**64 for fewer than 2**32 tiles
    low = int(_fmix32_np(sums2 ^ nbytes).sum(dtype=np.uint64))
    return _splitmix64((high << 32) + low)


def _tile_constants(first_tile: int, count: int) -> tuple[U32Array, U32Array, U32Array, U32Array]:
    """Per tile ``t``, with ``base = t * 8192 mod 2**32``: ``base*POS_A + SEED1``, ``rotl(base, 15)``,
    ``base*POS_B + SEED2``, ``rotl(base, 13)``; word ``base + k`` then has position terms
    ``(k*POS_A + c1) ^ r1 ^ rotl(k, 15)`` and ``(k*POS_B + c2) ^ r2 ^ rotl(k, 13)`` (low 13 bits of ``base`` clear)."""
    base = (np.arange(first_tile, first_tile + count, dtype=np.uint64) * np.uint64(TILE_WORDS)) & np.uint64(_M32)
    m = np.uint64(_M32)
    c1 = ((base * np.uint64(POS_A) + np.uint64(SEED1)) & m).astype(np.uint32)
    c2 = ((base * np.uint64(POS_B) + np.uint64(SEED2)) & m).astype(np.uint32)
    r1 = (((base << np.uint64(15)) | (base >> np.uint64(17))) & m).astype(np.uint32)
    r2 = (((base << np.uint64(13)) | (base >> np.uint64(19))) & m).astype(np.uint32)
    return c1, r1, c2, r2


@functools.cache
def _offset_tables() -> tuple[U32Array, U32Array, U32Array, U32Array]:
    """Per in-tile offset ``k``: ``k*POS_A``, ``rotl(k, 15)``, ``k*POS_B``, ``rotl(k, 13)`` (mod 2**32)."""
    k = np.arange(TILE_WORDS, dtype=np.uint64)
    m = np.uint64(_M32)
    ka = ((k * np.uint64(POS_A)) & m).astype(np.uint32)
    kb = ((k * np.uint64(POS_B)) & m).astype(np.uint32)
    r15 = (((k << np.uint64(15)) | (k >> np.uint64(17))) & m).astype(np.uint32)
    r13 = (((k << np.uint64(13)) | (k >> np.uint64(19))) & m).astype(np.uint32)
    return ka, r15, kb, r13


def _segments(first_index: int, count: int) -> Iterator[tuple[int, int, int, int]]:
    """Cut words ``[first_index, first_index + count)`` into runs ``(start, stop, tile, k0)``: chunk offsets
    ``start:stop`` in tile ``tile`` from in-tile offset ``k0``. A run is either part of one tile or whole tiles
    (``k0 == 0`` and a multiple of 8192 words)."""
    end = first_index + count
    full_lo = -(-first_index // TILE_WORDS)  # first whole tile
    full_hi = end // TILE_WORDS  # one past the last whole tile
    if full_lo > full_hi:  # inside one tile
        yield 0, count, first_index // TILE_WORDS, first_index % TILE_WORDS
        return
    if first_index < full_lo * TILE_WORDS:
        yield 0, full_lo * TILE_WORDS - first_index, first_index // TILE_WORDS, first_index % TILE_WORDS
    if full_lo < full_hi:
        yield full_lo * TILE_WORDS - first_index, full_hi * TILE_WORDS - first_index, full_lo, 0
    if full_hi * TILE_WORDS < end:
        yield full_hi * TILE_WORDS - first_index, count, full_hi, 0


# --- host implementations: numba (optional) and numpy ---------------------------------------------------------


@functools.cache
def _numba_tile_sums() -> TileSums | None:
    try:
        module = importlib.import_module("weightsync_agent.layout.sglang_hash._numba_tiles")
    except ImportError:
        return None
    kernel = module.tile_sums

    def tile_sums(words: U32Array, first_index: int) -> tuple[U32Array, U32Array]:
        tiles = (first_index + words.size - 1) // TILE_WORDS - first_index // TILE_WORDS + 1
        out1 = np.empty(tiles, dtype=np.uint32)
        out2 = np.empty(tiles, dtype=np.uint32)
        kernel(words, first_index, out1, out2)
        return out1, out2

    return tile_sums


def _numpy_tile_sums(words: U32Array, first_index: int) -> tuple[U32Array, U32Array]:
    """Lane sums per tile touched by ``words`` (word ``first_index`` onwards): vectorised uint32 arithmetic over
    blocks of up to ``_NUMPY_ROWS`` tiles, so the temporaries stay in cache. numpy releases the GIL in each op."""
    first_tile = first_index // TILE_WORDS
    tiles = (first_index + words.size - 1) // TILE_WORDS - first_tile + 1
    out1 = np.zeros(tiles, dtype=np.uint32)
    out2 = np.zeros(tiles, dtype=np.uint32)
    ka, r15, kb, r13 = _offset_tables()
    c1, s1, c2, s2 = (c[:, None] for c in _tile_constants(first_tile, tiles))
    x = np.empty(_NUMPY_ROWS * TILE_WORDS, dtype=np.uint32)
    t = np.empty_like(x)
    for start, stop, tile, k0 in _segments(first_index, words.size):
        width = min(stop - start, TILE_WORDS)
        rows_total = (stop - start) // width
        for row in range(0, rows_total, _NUMPY_ROWS):
            rows = min(_NUMPY_ROWS, rows_total - row)
            w = words[start + row * width : start + (row + rows) * width].reshape(rows, width)
            xv = x[: rows * width].reshape(rows, width)
            tv = t[: rows * width].reshape(rows, width)
            slot = tile + row - first_tile
            for c, r, k_mul, k_rot, out in ((c1, s1, ka, r15, out1), (c2, s2, kb, r13, out2)):
                np.add(k_mul[k0 : k0 + width], c[slot : slot + rows], out=xv)
                xv ^= r[slot : slot + rows]
                xv ^= k_rot[k0 : k0 + width]
                xv ^= w
                _numpy_fmix32_(xv, tv)
                xv.sum(axis=1, dtype=np.uint32, out=out[slot : slot + rows])
    return out1, out2


def _numpy_fmix32_(x: U32Array, t: U32Array) -> None:
    """fmix32 in place, ``t`` a scratch array of ``x``'s shape."""
    np.right_shift(x, np.uint32(16), out=t)
    x ^= t
    np.multiply(x, np.uint32(FMIX32_C1), out=x)
    np.right_shift(x, np.uint32(13), out=t)
    x ^= t
    np.multiply(x, np.uint32(FMIX32_C2), out=x)
    np.right_shift(x, np.uint32(16), out=t)
    x ^= t


def _host_hash(raw: npt.NDArray[np.uint8], tile_sums: TileSums, chunk_words: int) -> int:
    nbytes = raw.size
    n_words = (nbytes + 3) // 4
    if n_words == 0:
        return 0
    whole = nbytes // 4
    n_tiles = -(-n_words // TILE_WORDS)
    sums1 = np.zeros(n_tiles, dtype=np.uint32)
    sums2 = np.zeros(n_tiles, dtype=np.uint32)

    def add(words: U32Array, first_index: int) -> None:
        part1, part2 = tile_sums(words, first_index)
        t0 = first_index // TILE_WORDS
        sums1[t0 : t0 + part1.size] += part1  # uint32 arrays wrap: sums mod 2**32
        sums2[t0 : t0 + part2.size] += part2

    words = raw[: whole * 4].view(np.uint32)  # little-endian host: these are the little-endian words
    for a in range(0, whole, chunk_words):
        add(words[a : a + chunk_words], a)
    if whole < n_words:  # the last 1-3 bytes, zero-padded to a word
        last = np.zeros(4, dtype=np.uint8)
        last[: nbytes - whole * 4] = raw[whole * 4 :]
        add(last.view(np.uint32), whole)
    return _finish(sums1, sums2, n_words)


# --- triton implementation (CUDA, optional) -------------------------------------------------------------------


@functools.cache
def _triton_tile_sums() -> Callable[[torch.Tensor], torch.Tensor] | None:
    try:
        module = importlib.import_module("weightsync_agent.layout.sglang_hash._triton_tiles")
    except ImportError:
        return None
    kernel: Callable[[torch.Tensor], torch.Tensor] = module.tile_sums
    return kernel


@torch.inference_mode()
def _triton_hash(flat: torch.Tensor, tile_sums: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """The hash of the 1-D uint8 CUDA tensor ``flat``: tile sums from the kernel over the whole words; the last
    1-3 bytes (a zero-padded word) are added on the host, so an odd byte count costs no copy of the tensor."""
    nbytes = flat.numel()
    n_words = (nbytes + 3) // 4
    if n_words == 0:
        return 0
    whole = nbytes // 4
    sums = np.zeros((2, -(-n_words // TILE_WORDS)), dtype=np.uint32)
    if whole:
        body = flat[: whole * 4]
        if body.storage_offset() % 4:  # misaligned inside a larger buffer: copy to reinterpret as words
            body = body.clone()
        part = tile_sums(body.view(torch.int32)).cpu().numpy().view(np.uint32)
        sums[:, : part.shape[1]] = part
    if whole < n_words:
        last = int.from_bytes(bytes(flat[whole * 4 :].cpu().tolist()) + bytes(4), "little") & _M32
        k1, k2 = _lanes(last, whole)
        tile = whole // TILE_WORDS
        sums[0, tile] = (int(sums[0, tile]) + k1) & _M32
        sums[1, tile] = (int(sums[1, tile]) + k2) & _M32
    return _finish(sums[0], sums[1], n_words)


# --- torch implementation (any device) ------------------------------------------------------------------------


def _i32(v: int) -> int:
    """``v mod 2**32`` as the int32 with the same bits."""
    v &= _M32
    return v - (1 << 32) if v >= 1 << 31 else v


def _as_i32(v: torch.Tensor) -> torch.Tensor:
    """int64 values in ``[0, 2**32)`` as int32 tensors with the same bits (no out-of-range casts)."""
    return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32)


@functools.cache
def _torch_offset_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ka, r15, kb, r13 = (torch.from_numpy(a.view(np.int32)).to(device) for a in _offset_tables())
    return ka, r15, kb, r13


def _torch_tile_constants(
    first_tile: int, count: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_tile_constants` computed on ``device`` (no host round trip), as int32 columns."""
    base = (torch.arange(first_tile, first_tile + count, dtype=torch.int64, device=device) * TILE_WORDS) & _M32
    c1 = (base * POS_A + SEED1) & _M32
    c2 = (base * POS_B + SEED2) & _M32
    r1 = ((base << 15) | (base >> 17)) & _M32
    r2 = ((base << 13) | (base >> 19)) & _M32
    return _as_i32(c1)[:, None], _as_i32(r1)[:, None], _as_i32(c2)[:, None], _as_i32(r2)[:, None]


def _torch_fmix32_(x: torch.Tensor, t: torch.Tensor) -> None:
    """fmix32 in place on int32 ``x`` (wrapping multiply; right shifts masked to be logical)."""
    torch.bitwise_right_shift(x, 16, out=t)
    x.bitwise_xor_(t.bitwise_and_(0xFFFF))
    x.mul_(_i32(FMIX32_C1))
    torch.bitwise_right_shift(x, 13, out=t)
    x.bitwise_xor_(t.bitwise_and_(0x7FFFF))
    x.mul_(_i32(FMIX32_C2))
    torch.bitwise_right_shift(x, 16, out=t)
    x.bitwise_xor_(t.bitwise_and_(0xFFFF))


def _torch_accumulate(words: torch.Tensor, first_index: int, sums1: torch.Tensor, sums2: torch.Tensor) -> None:
    """Add the lane sums of int32 ``words`` (word ``first_index`` onwards) to the int64 per-tile ``sums``."""
    device = words.device
    ka, r15, kb, r13 = _torch_offset_tables(device)
    for start, stop, tile, k0 in _segments(first_index, words.numel()):
        width = min(stop - start, TILE_WORDS)
        rows = (stop - start) // width
        w = words[start:stop].view(rows, width)
        c1, s1, c2, s2 = _torch_tile_constants(tile, rows, device)
        t = torch.empty_like(w)
        for c, r, k_mul, k_rot, sums in ((c1, s1, ka, r15, sums1), (c2, s2, kb, r13, sums2)):
            x = torch.add(k_mul[k0 : k0 + width], c)
            x.bitwise_xor_(r).bitwise_xor_(k_rot[k0 : k0 + width]).bitwise_xor_(w)
            _torch_fmix32_(x, t)
            sums[tile : tile + rows] += x.sum(dim=1, dtype=torch.int64)


@torch.inference_mode()
def _torch_hash(flat: torch.Tensor, chunk_words: int) -> int:
    """The hash of the 1-D uint8 tensor ``flat``, computed with torch ops on its device; one host sync at the end."""
    nbytes = flat.numel()
    n_words = (nbytes + 3) // 4
    if n_words == 0:
        return 0
    whole = nbytes // 4
    n_tiles = -(-n_words // TILE_WORDS)
    sums1 = torch.zeros(n_tiles, dtype=torch.int64, device=flat.device)
    sums2 = torch.zeros_like(sums1)
    aligned = flat.storage_offset() % 4 == 0
    words = flat[: whole * 4].view(torch.int32) if aligned else None
    for a in range(0, whole, chunk_words):
        b = min(whole, a + chunk_words)
        # a misaligned view (a tensor inside a larger buffer) cannot be reinterpreted in place: copy the chunk
        chunk = words[a:b] if words is not None else flat[a * 4 : b * 4].clone().view(torch.int32)
        _torch_accumulate(chunk, a, sums1, sums2)
    if whole < n_words:  # the last 1-3 bytes, zero-padded to a word
        last = torch.zeros(4, dtype=torch.uint8, device=flat.device)
        last[: nbytes - whole * 4] = flat[whole * 4 :]
        _torch_accumulate(last.view(torch.int32), whole, sums1, sums2)
    both = (torch.stack((sums1, sums2)) & _M32).cpu().numpy().astype(np.uint32)
    return _finish(both[0], both[1], n_words)
