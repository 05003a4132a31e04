"""FP8 block quantization of BF16 trainer tensors, in the checkpoint format DeepSeek-V3 and Kimi-K2 ship.

An RL trainer is BF16; an FP8 rollout engine loads what its FP8 checkpoint holds: per linear weight ``[out, in]`` a
``float8_e4m3fn`` weight and a float32 ``<name>_scale_inv`` of shape ``[ceil(out/B0), ceil(in/B1)]`` (``config.json``
``quantization_config``: ``{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [B0, B1]}``, 128 x 128 in the
published checkpoints), with ``w ~ fp8 x scale_inv`` per block. The source quantizes the trainer's tensors into that
format and hands them to the engine's own loader (an engine replica, docs/engines/engine-replicas.md), as a checkpoint
would: the trainer's client quantizes where it stages (on the trainer's GPU, ``bench/quantize_bench.py``), and the
tests make FP8 checkpoints with it.

Deterministic by construction, so that the same BF16 in gives the same bytes out on CPU and GPU:
``scale_inv = amax(|block|) / 448`` in float32 (1 for an all-zero block: any value dequantizes zeros to zero), and
``fp8 = clamp(w / scale_inv, -448, 448)`` cast to e4m3 — float32 divisions by tensors and a cast, each correctly
rounded (IEEE round-to-nearest-even) on both. No fused multiply-add, no reciprocal (``bench/quantize_bench.py``
compares the bytes on the GPU machine).

Also per output channel, as a compressed-tensors W8A8 checkpoint stores it (symmetric, ``weight`` ``[out, in]``,
``weight_scale`` ``[out, 1]`` in the model's dtype, ``w ~ weight x scale``): INT8 (:func:`int8_channel`) and FP8 e4m3
(:func:`fp8_channel`), the two quantized formats vLLM's CPU build computes with here (its per-tensor FP8 path needs a
kernel the CPU build lacks, ``static_scaled_fp8_quant``); deterministic by the same rules.

Imports only ``torch``: the GPU machine's benchmark loads it without the rest of weightsync.
"""

from __future__ import annotations

import torch

#: The largest finite ``float8_e4m3fn`` value.
FP8_MAX = 448.0
#: The published checkpoints' block.
BLOCK = (128, 128)
#: A block-quantized weight's scale in the checkpoint and in the engine: ``<weight name>_scale_inv``.
SCALE_SUFFIX = "_scale_inv"
#: The largest INT8 magnitude a symmetric scheme uses (-128 is never produced).
INT8_MAX = 127.0


#: Float32 bytes a CPU pass of :func:`fp8_block` works on: a few block rows at a time stay in cache (measured 2.6x
#: faster than whole-tensor passes on the 2-core machine); a GPU does the tensor in one pass.
CPU_PASS_BYTES = 4 << 20


def fp8_block(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 weight, float32 scale_inv)`` of a 2-D ``weight`` (any float dtype, any device) in ``block`` blocks;
    edge blocks are the remainders (no padding in the outputs)."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 block quantization takes a 2-D weight, not {list(weight.shape)}")
    rows, cols = weight.shape
    b0, b1 = block
    grid = (-(-rows // b0), -(-cols // b1))
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=weight.device)
    scale_inv = torch.empty(grid, dtype=torch.float32, device=weight.device)
    width = grid[1] * b1
    block_rows = grid[0] if weight.is_cuda else max(1, CPU_PASS_BYTES // (b0 * width * 4))
    for first in range(0, grid[0], block_rows):
        count = min(block_rows, grid[0] - first)
        top, bottom = first * b0, min(rows, (first + count) * b0)
        if bottom - top == count * b0 and width == cols:
            padded = weight[top:bottom].to(torch.float32, copy=True)
        else:  # edge blocks: zeros never raise a block's amax
            padded = weight.new_zeros((count * b0, width), dtype=torch.float32)
            padded[: bottom - top, :cols] = weight[top:bottom]
        blocks = padded.view(count, b0, grid[1], b1)
        amax = torch.maximum(blocks.amax(dim=(1, 3)), blocks.amin(dim=(1, 3)).neg())  # |block|'s max, no |.| copy
        # A tensor divisor, not the number: CUDA divides a tensor by a Python scalar as a multiplication by its
        # reciprocal (rounded twice), the CPU does not; measured, 12 of 15 weights' scales differed in their last bit.
        scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
        blocks.div_(scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
        quantized[top:bottom] = padded[: bottom - top, :cols]
        scale_inv[first : first + count] = scale
    return quantized, scale_inv


def dequantize(quantized: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """The float32 weight ``quantized x scale_inv`` per block (what an engine computes with), over the last two dims
    (fused experts keep their leading one)."""
    rows, cols = quantized.shape[-2:]
    expanded = scale_inv.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)[..., :rows, :cols]
    return quantized.float() * expanded


def fp8_channel(weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8_e4m3fn weight, scale [out, 1])`` of a 2-D ``weight``, symmetric per output channel: ``scale =
    amax(|row|) / 448`` in float32 (1 for an all-zero row), rounded to ``scale_dtype`` (checkpoints store it in the
    model's dtype), then ``fp8 = clamp(w / scale, -448, 448)`` with that stored scale, cast to e4m3."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 channel quantization takes a 2-D weight, not {list(weight.shape)}")
    full = weight.float()
    scale = _channel_scale(full, FP8_MAX, scale_dtype)
    quantized = (full / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous()
    return quantized, scale.contiguous()


def _channel_scale(full: torch.Tensor, largest: float, scale_dtype: torch.dtype) -> torch.Tensor:
    """Per output channel of float32 ``full``: ``amax(|row|) / largest`` (1 for an all-zero row), rounded to
    ``scale_dtype``. A tensor divisor, as in fp8_block: the same bytes on CPU and GPU."""
    amax = full.abs().amax(dim=1, keepdim=True)
    return torch.where(amax > 0, amax / torch.full_like(amax, largest), torch.ones_like(amax)).to(scale_dtype)


def int8_channel(weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 weight, scale [out, 1])`` of a 2-D ``weight``, symmetric per output channel: ``scale = amax(|row|) /
    127`` in float32 (1 for an all-zero row), rounded to ``scale_dtype`` (checkpoints store it in the model's dtype),
    then ``int8 = round_half_even(w / scale)`` with that stored scale, clamped to +-127."""
    if weight.dim() != 2:
        raise ValueError(f"INT8 channel quantization takes a 2-D weight, not {list(weight.shape)}")
    full = weight.float()
    scale = _channel_scale(full, INT8_MAX, scale_dtype)
    quantized = torch.round(full / scale.float()).clamp(-INT8_MAX, INT8_MAX).to(torch.int8).contiguous()
    return quantized, scale.contiguous()
