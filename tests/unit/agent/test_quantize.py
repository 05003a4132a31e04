"""FP8 block quantization (weightsync_agent.layout.quantize): the DeepSeek-V3 checkpoint format, deterministic, bounded
error, and properties over random shapes (hypothesis)."""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync_agent.layout.quantize import FP8_MAX, dequantize, fp8_block, fp8_channel, int8_channel


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_the_checkpoint_format_of_a_deepseek_linear() -> None:
    weight = torch.randn(300, 200, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    quantized, scale_inv = fp8_block(weight)
    assert (quantized.dtype, list(quantized.shape)) == (torch.float8_e4m3fn, [300, 200])
    assert (scale_inv.dtype, list(scale_inv.shape)) == (torch.float32, [3, 2])  # ceil(300/128), ceil(200/128)
    block = weight[128:256, 0:128].float()
    assert scale_inv[1, 0] == block.abs().max() / FP8_MAX
    assert quantized.float().abs().max() == FP8_MAX  # each block's largest element lands on the largest code


def test_the_same_bf16_gives_the_same_bytes() -> None:
    weight = torch.randn(256, 384, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert digest(*fp8_block(weight)) == digest(*fp8_block(weight.clone()))
    other = weight.clone()
    other[5, 7] += 1
    assert digest(*fp8_block(weight)) != digest(*fp8_block(other))


def test_a_zero_block_is_zeros_and_a_finite_scale() -> None:
    weight = torch.zeros(128, 256, dtype=torch.bfloat16)
    weight[:, 128:] = 1.0
    quantized, scale_inv = fp8_block(weight)
    assert torch.equal(scale_inv, torch.tensor([[1.0, 1.0 / FP8_MAX]]))  # float32
    assert torch.equal(dequantize(quantized, scale_inv), weight.float())


def reference_fp8_block(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The format's definition in whole-tensor passes (the quantizer works a few block rows at a time)."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(grid[0], block[0], grid[1], block[1])
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    scaled = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return scaled.view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn), scale_inv


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 700),
    cols=st.integers(1, 300),
    block=st.sampled_from([(128, 128), (64, 32), (1, 16), (7, 5)]),
    seed=st.integers(0, 2**16),
    pass_bytes=st.sampled_from([1, 4096, 4 << 20]),
)
def test_the_quantizer_gives_the_formats_bytes_whatever_its_passes(
    rows: int, cols: int, block: tuple[int, int], seed: int, pass_bytes: int
) -> None:
    import weightsync_agent.layout.quantize as quantize

    weight = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 5).to(torch.bfloat16)
    want = reference_fp8_block(weight, block)
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(quantize, "CPU_PASS_BYTES", pass_bytes)
        got = fp8_block(weight, block)
    assert digest(*got) == digest(*want)


def test_only_2d_weights() -> None:
    with pytest.raises(ValueError, match="2-D weight"):
        fp8_block(torch.zeros(2, 3, 4))


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 300),
    cols=st.integers(1, 300),
    block=st.sampled_from([(128, 128), (64, 32), (1, 16)]),
    seed=st.integers(0, 2**16),
    magnitude=st.sampled_from([1e-3, 1.0, 1e3]),
)
def test_dequantized_is_within_e4m3s_rounding_of_the_weight(
    rows: int, cols: int, block: tuple[int, int], seed: int, magnitude: float
) -> None:
    weight = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * magnitude).to(torch.bfloat16)
    quantized, scale_inv = fp8_block(weight, block)
    assert torch.isfinite(quantized.float()).all() and torch.isfinite(scale_inv).all()
    error = (dequantize(quantized, scale_inv, block) - weight.float()).abs()
    scale = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    # e4m3 keeps 3 mantissa bits: relative half-ulp 1/16 of the value, and subnormals' absolute 2^-10 step.
    bound = weight.float().abs() / 16 + scale * 2.0**-10
    assert (error <= bound * (1 + 1e-6)).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (bench/quantize_bench.py on the GPU machine)")
@pytest.mark.parametrize(("rows", "cols"), [(300, 200), (4096, 1024), (129, 7)])
def test_the_same_bytes_on_cpu_and_gpu(rows: int, cols: int) -> None:
    """A division by a Python number is a reciprocal multiplication on CUDA: the quantizer divides by tensors."""
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    gpu = [t.cpu() for t in fp8_block(weight.cuda())]
    assert digest(*fp8_block(weight)) == digest(*gpu)


# --- INT8 per output channel (compressed-tensors W8A8) -------------------------------------------------------------


def test_int8_channel_is_the_w8a8_checkpoint_format() -> None:
    weight = torch.randn(48, 32, generator=torch.Generator().manual_seed(2))
    quantized, scale = int8_channel(weight, torch.bfloat16)
    assert (quantized.dtype, list(quantized.shape), scale.dtype, list(scale.shape)) == (
        torch.int8, [48, 32], torch.bfloat16, [48, 1]
    )  # fmt: skip
    assert scale[3, 0] == (weight[3].abs().max() / 127).to(torch.bfloat16)  # the stored scale, in the model's dtype
    assert quantized.abs().max() <= 127 and (quantized == -128).sum() == 0  # symmetric
    assert digest(*int8_channel(weight, torch.bfloat16)) == digest(*int8_channel(weight.clone(), torch.bfloat16))


def test_int8_channel_zero_rows_and_shapes() -> None:
    weight = torch.zeros(4, 8)
    weight[1] = torch.arange(8) - 4.0
    quantized, scale = int8_channel(weight)
    assert scale[0, 0] == 1 and not quantized[0].any()  # an all-zero row: a finite scale, zeros
    with pytest.raises(ValueError, match="2-D"):
        int8_channel(torch.zeros(2, 2, 2))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_int8_dequantized_is_within_half_a_step(rows: int, cols: int, seed: int) -> None:
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    quantized, scale = int8_channel(weight)
    error = (quantized.float() * scale - weight).abs()
    assert bool((error <= scale * 0.5 + 1e-6).all())  # round to nearest with the scale it stores


# --- FP8 per output channel (compressed-tensors W8A8 FP8) ----------------------------------------------------------


def test_fp8_channel_is_the_w8a8_fp8_checkpoint_format() -> None:
    weight = torch.randn(48, 32, generator=torch.Generator().manual_seed(5))
    quantized, scale = fp8_channel(weight, torch.bfloat16)
    assert (quantized.dtype, list(quantized.shape), scale.dtype, list(scale.shape)) == (
        torch.float8_e4m3fn, [48, 32], torch.bfloat16, [48, 1]
    )  # fmt: skip
    assert scale[3, 0] == (weight[3].abs().max() / FP8_MAX).to(torch.bfloat16)  # the stored scale, the model's dtype
    assert quantized.float().abs().max() <= FP8_MAX and torch.isfinite(quantized.float()).all()
    assert digest(*fp8_channel(weight, torch.bfloat16)) == digest(*fp8_channel(weight.clone(), torch.bfloat16))
    zeros = torch.zeros(2, 8)
    zero_weight, zero_scale = fp8_channel(zeros)
    assert (zero_scale == 1).all() and not zero_weight.float().any()  # an all-zero row: a finite scale, zeros
    with pytest.raises(ValueError, match="2-D"):
        fp8_channel(torch.zeros(2, 2, 2))


@given(rows=st.integers(1, 40), cols=st.integers(1, 40), seed=st.integers(0, 2**16), magnitude=st.sampled_from(
    [1e-6, 1e-2, 1.0, 300.0]))  # fmt: skip
def test_fp8_channel_dequantized_is_within_e4m3s_rounding(rows: int, cols: int, seed: int, magnitude: float) -> None:
    weight = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * magnitude).to(torch.bfloat16)
    quantized, scale = fp8_channel(weight)
    error = (quantized.float() * scale - weight.float()).abs()
    bound = weight.float().abs() / 16 + scale * 2.0**-9  # half-ulp of e4m3's 3 mantissa bits; its subnormal step
    assert (error <= bound * (1 + 1e-6)).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (bench/quantize_bench.py on the GPU machine)")
def test_fp8_channel_gives_the_same_bytes_on_cpu_and_gpu() -> None:
    weight = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    gpu = [t.cpu() for t in fp8_channel(weight.cuda(), torch.bfloat16)]
    assert digest(*fp8_channel(weight, torch.bfloat16)) == digest(*gpu)
