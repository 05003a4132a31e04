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


def fp8_block(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 weight, float32 scale_inv)`` of a 2-D ``weight`` (any float dtype, any device) in ``block`` blocks;
    edge blocks are the remainders (no padding in the outputs)."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 block quantization takes a 2-D weight, not {list(weight.shape)}")
    rows, cols = weight.shape
    b0, b1 = block
    grid = (-(-rows // b0), -(-cols // b1))
    full = weight.float()
    padded = full.new_zeros(grid[0] * b0, grid[1] * b1)
    padded[:rows, :cols] = full
    blocks = padded.view(grid[0], b0, grid[1], b1)
    amax = blocks.abs().amax(dim=(1, 3))
    # A tensor divisor, not the number: CUDA divides a tensor by a Python scalar as a multiplication by its
    # reciprocal (rounded twice), the CPU does not; measured, 12 of 15 weights' scales differed in their last bit.
    scale_inv = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    scaled = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    quantized = scaled.view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn).contiguous()
    return quantized, scale_inv.contiguous()


def dequantize(quantized: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """The float32 weight ``quantized x scale_inv`` per block (what an engine computes with), over the last two dims
    (fused experts keep their leading one)."""
    rows, cols = quantized.shape[-2:]
    expanded = scale_inv.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)[..., :rows, :cols]
    return quantized.float() * expanded
