"""FP8 block targets cut on tile edges: the scale entry a weight's cut needs (``block_scale_cut``), and the manifest's
refusals of cuts and scale entries that no checkpoint could fill."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync_agent.layout.manifest import (
    Manifest,
    ManifestError,
    Region,
    ShardPart,
    TensorEntry,
    block_scale_cut,
)
from weightsync_agent.layout.quantize import fp8_block


@st.composite
def tile_aligned_cuts(draw: st.DrawFn) -> tuple[torch.Tensor, tuple[int, int], ShardPart]:
    block = draw(st.sampled_from([(4, 4), (8, 2), (2, 8), (16, 16)]))
    rows, cols = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    dim = draw(st.integers(0, 1))
    size, tile = (rows, cols)[dim], block[dim]
    tiles = -(-size // tile)
    first = draw(st.integers(0, tiles - 1))
    last = draw(st.integers(first + 1, tiles))
    start, end = first * tile, min(last * tile, size)
    full = torch.randn(rows, cols, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    return full, block, ShardPart(source="w", full_shape=(rows, cols), dim=dim, start=start, length=end - start)


@settings(max_examples=150, deadline=None)
@given(tile_aligned_cuts())
def test_the_tiles_of_a_cut_on_tile_edges_are_what_quantizing_the_cut_gives(
    case: tuple[torch.Tensor, tuple[int, int], ShardPart],
) -> None:
    """Quantizing the whole trainer tensor and cutting weight and scale tiles as ``block_scale_cut`` says equals
    quantizing the cut itself: the source may quantize once per trainer tensor for every target."""
    full, block, part = case
    shape, cat_dim, (scale_part,) = block_scale_cut("w", part.shape, part.dim, (part,), block)
    weight, scale = fp8_block(full, block)
    cut_weight, cut_scale = fp8_block(full.narrow(part.dim, part.start, part.length), block)
    assert scale_part.source == "w_scale_inv" and scale_part.full_shape == tuple(scale.shape)
    assert shape == tuple(cut_scale.shape) and cat_dim == part.dim
    got = scale.narrow(scale_part.dim, scale_part.start, scale_part.length)
    assert torch.equal(got, cut_scale)
    assert torch.equal(weight.narrow(part.dim, part.start, part.length).view(torch.uint8), cut_weight.view(torch.uint8))


def test_fused_parts_stack_their_tiles_and_a_cut_inside_a_tile_is_refused_by_name() -> None:
    q = ShardPart(source="q", full_shape=(256, 64), dim=0, start=128, length=128)
    k = ShardPart(source="k", full_shape=(200, 64), dim=0, start=128, length=72)  # ends at the tensor's end
    shape, _, (qs, ks) = block_scale_cut("qkv", (200, 64), 0, (q, k), (128, 128))
    assert shape == (2, 1) and (qs.start, qs.length, ks.start, ks.length) == (1, 1, 1, 1)
    inside = ShardPart(source="q", full_shape=(256, 64), dim=0, start=64, length=128)
    with pytest.raises(ManifestError, match=r"q\[64:192\] along dim 0 is not on 128-wide tile edges"):
        block_scale_cut("qkv", (128, 64), 0, (inside,), (128, 128))
    short_first = ShardPart(source="k", full_shape=(200, 64), dim=0, start=128, length=72)
    with pytest.raises(ManifestError, match="not whole 128-tiles, and another part follows"):
        block_scale_cut("kq", (200, 64), 0, (short_first, q), (128, 128))


def entry(
    name: str, dtype: str, shape: tuple[int, int], address: int, parts: tuple[ShardPart, ...], **more: object
) -> TensorEntry:
    nbytes = shape[0] * shape[1] * (1 if dtype == "float8_e4m3fn" else 4)
    fields = {"name": name, "dtype": dtype, "shape": shape, "address": address, "nbytes": nbytes, "parts": parts}
    return TensorEntry.model_validate(fields | more)


def test_a_manifest_refuses_an_fp8_weight_whose_scale_entry_is_not_its_tiles() -> None:
    weight_part = ShardPart(source="w", full_shape=(256, 128), dim=0, start=0, length=256)
    weight = entry("w", "float8_e4m3fn", (256, 128), 0x1000, (weight_part,), quantize="fp8-block", block=(128, 128),
                   scale="w_scale_inv")  # fmt: skip
    tiles = ShardPart(source="w_scale_inv", full_shape=(2, 1), dim=0, start=0, length=2)
    good = entry("w_scale_inv", "float32", (2, 1), 0x1000 + 256 * 128, (tiles,))
    region = (Region(address=0x1000, nbytes=1 << 20),)
    Manifest(engine=0, rank=0, session_id="s", tensors=(weight, good), regions=region)
    one_tile = ShardPart(source="w_scale_inv", full_shape=(1, 1), dim=0, start=0, length=1)
    wrong = entry("w_scale_inv", "float32", (1, 1), 0x1000 + 256 * 128, (one_tile,))
    with pytest.raises(ValueError, match=r"must be float32 \[2, 1\]"):
        Manifest(engine=0, rank=0, session_id="s", tensors=(weight, wrong), regions=region)
    with pytest.raises(ValueError, match="a block goes with fp8-block"):
        entry("w", "float8_e4m3fn", (256, 128), 0x1000, (weight_part,), quantize="fp8-block", scale="w_scale_inv")
    with pytest.raises(ValueError, match="2-D float8_e4m3fn cut"):
        entry("w", "float32", (256, 128), 0x1000, (weight_part,), quantize="fp8-block", block=(128, 128),
              scale="w_scale_inv")  # fmt: skip
