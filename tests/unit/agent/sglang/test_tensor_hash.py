"""SGLang's weight hashes, source side: golden values, a plain-Python reference, every backend, every cut."""

from __future__ import annotations

import functools
import hashlib
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync_agent.layout.sglang_hash import tensor_hash as th
from weightsync_agent.layout.sglang_hash.tensor_hash import (
    EMPTY_HASH,
    hash_for_device,
    numba_available,
    sglang_cpu_hash,
    sglang_gpu_hash,
)

TILE = 8192
M32 = 0xFFFFFFFF
M64 = 0xFFFFFFFFFFFFFFFF

# --- the reference: gpu_tensor_hash written out plainly, one word at a time ------------------------------------


def ref_fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    x ^= x >> 16
    return x


def ref_rotl32(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & M32


SEED = 0x243F6A88
S1 = SEED & M32
S2 = ((SEED * 0x9E3779B1) ^ 0xDEADBEEF) & M32


def ref_lanes(word: int, index: int) -> tuple[int, int]:
    i = index & M32
    k1 = ref_fmix32(word ^ (((i * 0x27D4EB2D + S1) & M32) ^ ref_rotl32(i, 15)))
    k2 = ref_fmix32(word ^ (((i * 0x165667B1 + S2) & M32) ^ ref_rotl32(i, 13)))
    return k1, k2


@functools.cache
def ref_gpu_hash(data: bytes) -> str:
    data = data + b"\0" * (-len(data) % 4)
    n = len(data) // 4
    if n == 0:
        return f"{0:016x}"
    total = 0
    for start in range(0, n, TILE):
        h1 = h2 = 0
        for i in range(start, min(n, start + TILE)):
            k1, k2 = ref_lanes(int.from_bytes(data[4 * i : 4 * i + 4], "little"), i)
            h1 += k1
            h2 += k2
        h1 = ref_fmix32((h1 & M32) ^ ((4 * n) & M32))
        h2 = ref_fmix32((h2 & M32) ^ ((4 * n) & M32))
        total += (h1 << 32) | h2
    x = total & M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    x ^= x >> 31
    return f"{x:016x}"


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


BACKENDS = [
    "numpy",
    "torch",
    pytest.param("numba", marks=pytest.mark.skipif(not numba_available(), reason="numba not installed")),
]

# --- golden values (docs/engines/sglang-hash.md; the numpy port there equals SGLang's Triton kernel on an H200) ---

GOLDEN = [
    (lambda: torch.tensor(list(range(256)), dtype=torch.uint8), "ac371f47da03664b"),
    (lambda: torch.arange(100000, dtype=torch.float32), "b1ba5ba1259c2e1d"),
    (lambda: torch.arange(4096).bfloat16().reshape(64, 64), "4834cbb740d95bae"),
    (lambda: torch.empty(0), "0000000000000000"),
]


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
@pytest.mark.parametrize(("make", "expected"), GOLDEN)
def test_golden_values(make, expected, backend):
    assert sglang_gpu_hash(make(), backend=backend) == expected


def test_golden_values_from_plain_bytes_and_the_reference():
    assert sglang_gpu_hash(bytes(range(256))) == "ac371f47da03664b"
    assert ref_gpu_hash(bytes(range(256))) == "ac371f47da03664b"
    assert ref_gpu_hash(raw(torch.arange(4096).bfloat16())) == "4834cbb740d95bae"
    assert sglang_gpu_hash(b"") == EMPTY_HASH


# --- against the reference ---------------------------------------------------------------------------------

SIZES = [
    *range(0, 13),  # every tail length, first words
    4 * 1000 + 1,
    4 * 8191,  # one word short of a tile
    4 * 8191 + 3,
    4 * 8192,  # exactly one tile
    4 * 8192 + 1,
    4 * 8192 + 2,
    4 * 8193,  # one word into the second tile
    4 * 2 * 8192 + 2,
    4 * (3 * 8192 + 17) + 3,  # several tiles, a cut last tile, a padded last word
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("nbytes", SIZES)
def test_equals_reference_on_sizes(nbytes, backend):
    data = random_bytes(nbytes, seed=nbytes)
    assert sglang_gpu_hash(data, backend=backend) == ref_gpu_hash(data)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=3000))
def test_equals_reference_on_any_bytes(data, backend):
    assert sglang_gpu_hash(data, backend=backend) == ref_gpu_hash(data)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(257, dtype=torch.bfloat16),  # odd bf16 count: 514 bytes, padded
        lambda: torch.randn(3, 5, dtype=torch.float16),
        lambda: torch.randn(9999, dtype=torch.float32),
        lambda: torch.randint(0, 256, (8195,), dtype=torch.uint8),
        lambda: torch.randint(-(2**62), 2**62, (4097,), dtype=torch.int64),
        lambda: torch.tensor(3.25),  # 0-dim
        lambda: torch.tensor([True, False, True]),
    ],
    ids=["bf16", "fp16", "fp32", "uint8", "int64", "scalar", "bool"],
)
def test_dtypes_hash_their_raw_bytes(make, backend):
    t = make()
    assert sglang_gpu_hash(t, backend=backend) == ref_gpu_hash(raw(t))


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_tensors_hash_as_contiguous(backend):
    base = torch.randn(64, 96).bfloat16()
    for t in (base[:, 5:70], base.t(), base[::3], base[1:, 1:].t()[::2]):
        assert not t.is_contiguous()
        assert sglang_gpu_hash(t, backend=backend) == sglang_gpu_hash(t.contiguous(), backend=backend)
        assert sglang_gpu_hash(t, backend=backend) == ref_gpu_hash(raw(t))


@pytest.mark.parametrize("backend", BACKENDS)
def test_views_at_odd_byte_offsets(backend):
    """A parameter inside a flat buffer need not start on a 4-byte boundary; it hashes its own bytes."""
    flat = torch.randn(3 * TILE + 11).bfloat16()
    for offset in (1, 2, 3):
        t = flat[offset:]
        assert sglang_gpu_hash(t, backend=backend) == ref_gpu_hash(raw(t))
    u8 = torch.randint(0, 256, (4 * TILE + 9,), dtype=torch.uint8)
    assert sglang_gpu_hash(u8[3:], backend=backend) == ref_gpu_hash(raw(u8[3:]))


def test_every_input_type_gives_the_same_hash():
    t = torch.randn(1001, dtype=torch.float16)
    expected = ref_gpu_hash(raw(t))
    data = raw(t)
    for value in (t, t.numpy(), data, bytearray(data), memoryview(data), np.frombuffer(data, dtype=np.uint8)):
        assert sglang_gpu_hash(value) == expected
        assert sglang_gpu_hash(value, backend="numpy") == expected
        assert sglang_gpu_hash(value, backend="torch") == expected


# --- chunking never changes the value -----------------------------------------------------------------------

CHUNKED = random_bytes(4 * (3 * TILE + 5) + 3, seed=7)  # 3 tiles, 6 words and a padded word


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk_words", [7, 1000, TILE - 1, TILE, TILE + 1, 2 * TILE + 3, 3 * TILE, 10**7])
def test_chunk_size_does_not_change_the_value(chunk_words, backend):
    assert sglang_gpu_hash(CHUNKED, backend=backend, chunk_words=chunk_words) == ref_gpu_hash(CHUNKED)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None)
@given(chunk_words=st.integers(min_value=1, max_value=5 * TILE))
def test_any_chunk_size(chunk_words, backend):
    data = CHUNKED[: 4 * (TILE + 300) + 1]
    assert sglang_gpu_hash(data, backend=backend, chunk_words=chunk_words) == ref_gpu_hash(data)


def test_chunk_words_must_be_positive():
    with pytest.raises(ValueError, match="chunk_words"):
        sglang_gpu_hash(b"abcd", chunk_words=0)


# --- tile sums far into a tensor: the word index wraps at 2**32 ----------------------------------------------


def ref_tile_sums(words: np.ndarray, first_index: int) -> tuple[list[int], list[int]]:
    first_tile = first_index // TILE
    tiles = (first_index + words.size - 1) // TILE - first_tile + 1
    s1, s2 = [0] * tiles, [0] * tiles
    for m, w in enumerate(words.tolist()):
        k1, k2 = ref_lanes(w, first_index + m)
        slot = (first_index + m) // TILE - first_tile
        s1[slot] = (s1[slot] + k1) & M32
        s2[slot] = (s2[slot] + k2) & M32
    return s1, s2


def host_tile_sums():
    sums = [("numpy", th._numpy_tile_sums)]
    kernel = th._numba_tile_sums()
    if kernel is not None:
        sums.append(("numba", kernel))
    return sums


def torch_tile_sums(words: np.ndarray, first_index: int) -> tuple[list[int], list[int]]:
    first_tile = first_index // TILE
    tiles = (first_index + words.size - 1) // TILE - first_tile + 1
    sums1 = torch.zeros(first_tile + tiles, dtype=torch.int64)
    sums2 = torch.zeros_like(sums1)
    th._torch_accumulate(torch.from_numpy(words.view(np.int32).copy()), first_index, sums1, sums2)
    return (sums1[first_tile:] & M32).tolist(), (sums2[first_tile:] & M32).tolist()


@pytest.mark.parametrize(
    "first_index",
    [2**32 - 5, 2**32 - TILE - 3, 2**32, 2**33 + 4099, 5 * 2**32 - 1],
    ids=["just-before-wrap", "tile-before-wrap", "at-wrap", "second-wrap", "fifth-wrap"],
)
def test_tile_sums_where_the_word_index_wraps(first_index):
    words = np.random.default_rng(first_index % 1000).integers(0, 2**32, TILE + 13, dtype=np.uint64)
    words = words.astype(np.uint32)
    expected = ref_tile_sums(words, first_index)
    for name, tile_sums in host_tile_sums():
        got = tile_sums(words, first_index)
        assert (got[0].tolist(), got[1].tolist()) == expected, name
    assert torch_tile_sums(words, first_index) == expected


# --- the CPU engine's hash: sha256[:8] ------------------------------------------------------------------------


def sha_prefix(data: bytes) -> str:
    return f"{int.from_bytes(hashlib.sha256(data).digest()[:8], 'big'):016x}"


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(17, 33).bfloat16(),
        lambda: torch.randn(1000, dtype=torch.float16),
        lambda: torch.randn(3, 4, 5),
        lambda: torch.randint(0, 256, (7,), dtype=torch.uint8),
        lambda: torch.arange(11, dtype=torch.int64),
        lambda: torch.randn(40, 50).bfloat16()[:, 3:9],  # non-contiguous
        lambda: torch.empty(0, dtype=torch.bfloat16),
        lambda: torch.tensor(1.5),
    ],
)
def test_cpu_hash_is_sha256_prefix_of_raw_bytes(make):
    t = make()
    assert sglang_cpu_hash(t) == sha_prefix(raw(t))
    assert sglang_cpu_hash(raw(t)) == sha_prefix(raw(t))


def test_cpu_hash_of_buffers_and_legacy_bf16():
    data = random_bytes(1001)
    assert sglang_cpu_hash(data) == sha_prefix(data) == sglang_cpu_hash(memoryview(data))
    assert sglang_cpu_hash(b"") == sha_prefix(b"") == "e3b0c44298fc1c14"
    t = torch.randn(64).bfloat16()
    assert sglang_cpu_hash(t, bf16_as_fp32=True) == sha_prefix(raw(t.float()))
    assert sglang_cpu_hash(t, bf16_as_fp32=True) != sglang_cpu_hash(t)


# --- choosing by the engine's device; threads ------------------------------------------------------------------


def test_hash_for_device():
    assert hash_for_device("cuda") is sglang_gpu_hash
    assert hash_for_device("cuda:3") is sglang_gpu_hash
    assert hash_for_device("CPU") is sglang_cpu_hash
    assert hash_for_device("cpu") is sglang_cpu_hash
    with pytest.raises(ValueError, match="npu"):
        hash_for_device("npu")


def test_numba_backend_without_numba_says_so():
    if numba_available():
        pytest.skip("numba is installed")
    with pytest.raises(RuntimeError, match="numba"):
        sglang_gpu_hash(b"abcd", backend="numba")


@pytest.mark.parametrize("backend", BACKENDS)
def test_threads_hash_different_tensors_correctly(backend):
    tensors = [torch.randn(TILE * 3 + i).bfloat16() for i in range(6)]
    expected = [ref_gpu_hash(raw(t)) for t in tensors]
    results: dict[int, str] = {}

    def work(i: int) -> None:
        results[i] = sglang_gpu_hash(tensors[i], backend=backend, chunk_words=5000)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(tensors))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [results[i] for i in range(len(tensors))] == expected


def test_triton_backend_takes_cuda_tensors_only():
    if not th.triton_available():
        with pytest.raises(RuntimeError, match="triton"):
            sglang_gpu_hash(torch.zeros(4), backend="triton")
    else:
        with pytest.raises(ValueError, match="CUDA"):
            sglang_gpu_hash(torch.zeros(4), backend="triton")


DEVICE_BACKENDS = [
    "auto",
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not th.triton_available(), reason="triton not installed")),
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_cuda_tensors_hash_on_device_like_the_reference(backend):
    for t in (
        torch.randn(3 * TILE + 7).bfloat16(),  # 2 * 24583 bytes: a cut last tile, a padded last word
        torch.randint(0, 256, (4 * TILE + 3,), dtype=torch.uint8),  # a padded last word opening a new tile
        torch.randint(0, 256, (4 * TILE - 1,), dtype=torch.uint8),  # a padded last word inside the last tile
        torch.randn(64, 96).bfloat16()[:, 5:70],
        torch.empty(0),
    ):
        assert sglang_gpu_hash(t.cuda(), backend=backend) == ref_gpu_hash(raw(t))
    t = torch.randn(3 * TILE + 7).bfloat16()
    assert sglang_gpu_hash(t.cuda()[1:], backend=backend) == ref_gpu_hash(raw(t[1:]))  # misaligned view
