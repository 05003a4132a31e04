"""An engine-replica manifest (weightsync_agent/layout/replica_manifest.py, manifest.py): the engine's loader layout
joined with what it published, every tensor on the ``engine-replica`` path, refused by name where the layout says
the path cannot reproduce the engine's own load; and the manifest's own rules for the two paths."""

from __future__ import annotations

from typing import Any

import pytest

from weightsync_agent.layout.manifest import Manifest, ManifestError, TensorEntry

# A rule broken inside a pydantic validator surfaces as a ValidationError (a ValueError) carrying its message.
from weightsync_agent.layout.replica_manifest import assemble
from weightsync_agent.layout.traced_manifest import TraceRefusedError

FUSED = "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight"
NORM = "model.norm.weight"


def layout(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "sglang": "0.5.23",
        "tp_size": 2,
        "tp_rank": 1,
        "ep_size": 1,
        "dtype": "float32",
        "tensors": [
            {"name": FUSED, "dtype": "float32", "shape": [112, 128], "nbytes": 112 * 128 * 4},
            {"name": NORM, "dtype": "float32", "shape": [128], "nbytes": 512},
        ],
        "feeds": [
            {"name": "model.layers.0.self_attn.q_a_proj.weight", "dtype": "float32", "shape": [64, 128]},
            {"name": "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "dtype": "float32", "shape": [48, 128]},
            {"name": NORM, "dtype": "float32", "shape": [128]},
        ],
        "refused": [],
    }
    return base | changes


PUBLISHED = {FUSED: [1 << 20, 112 * 128, 4], NORM: [1 << 21, 128, 4]}


def build(rank: int = 1, **changes: Any) -> Manifest:
    return assemble(0, rank, layout(**changes), "127.0.0.1:9", PUBLISHED, checksum="tensor-sha256-8", model="/m")


def test_every_tensor_takes_the_engine_replica_path_and_the_manifest_names_the_replica() -> None:
    manifest = build()
    assert [(t.name, t.path, t.parts, t.address) for t in manifest.tensors] == [
        (FUSED, "engine-replica", (), 1 << 20),
        (NORM, "engine-replica", (), 1 << 21),
    ]
    replica = manifest.replica
    assert replica is not None
    assert (replica.engine, replica.engine_version, replica.model, replica.tp, replica.rank) == ("sglang", "0.5.23",
                                                                                               "/m", 2, 1)  # fmt: skip
    assert [f.name for f in replica.feeds][-1] == NORM and replica.feeds[0].nbytes == 64 * 128 * 4
    assert Manifest.model_validate(manifest.model_dump(by_alias=True)) == manifest  # as it travels between agents


def test_ranks_of_one_shape_are_different_replicas() -> None:
    """No cut tells two TP ranks' loader layouts apart (same names and shapes): the replica's rank does."""
    other = assemble(0, 0, layout(tp_rank=0), "127.0.0.1:9", PUBLISHED, checksum="tensor-sha256-8", model="/m")
    assert other.layout_fingerprint != build().layout_fingerprint


def test_what_the_layout_refused_is_refused_by_name() -> None:
    refused = [{"name": "buffer model.layers.0.gemma_weight", "reason": "derived in load_weights"}]
    with pytest.raises(TraceRefusedError, match=r"buffer model\.layers\.0\.gemma_weight: derived in load_weights"):
        build(refused=refused)


def test_names_the_engine_does_not_publish_or_the_replica_lacks_are_refused() -> None:
    tensors = [*layout()["tensors"], {"name": "lm_head.weight", "dtype": "float32", "shape": [4], "nbytes": 16}]
    with pytest.raises(ManifestError, match=r"has \['lm_head\.weight'\] which the engine does not publish"):
        build(tensors=tensors)


def test_a_size_the_engine_does_not_hold_is_refused() -> None:
    tensors = [layout()["tensors"][0], {"name": NORM, "dtype": "bfloat16", "shape": [128], "nbytes": 256}]
    with pytest.raises(ManifestError, match=r"model\.norm\.weight is bfloat16\[128\] in the engine replica"):
        build(tensors=tensors)


def test_a_replica_for_another_rank_or_repeated_feeds_are_refused() -> None:
    with pytest.raises(ValueError, match="built for rank 1, not rank 0"):
        Manifest.model_validate({**build().model_dump(), "rank": 0})
    feeds = [*layout()["feeds"], layout()["feeds"][0]]
    with pytest.raises(ManifestError, match="feeds repeat"):
        build(feeds=feeds)


def test_the_two_paths_each_have_their_own_rules() -> None:
    entry = {"name": NORM, "dtype": "float32", "shape": [128], "address": 4096, "nbytes": 512}
    part = {"source": NORM, "full_shape": [128], "dim": 0, "start": 0, "length": 128}
    with pytest.raises(ValueError, match="a traced tensor needs at least one part"):
        TensorEntry.model_validate(entry)
    with pytest.raises(ValueError, match="an engine-replica tensor has no parts"):
        TensorEntry.model_validate({**entry, "path": "engine-replica", "parts": [part]})
    loaded = TensorEntry.model_validate({**entry, "path": "engine-replica"})
    base = {"engine": 0, "rank": 0, "sessionId": "s", "regions": [{"address": 4096, "nbytes": 512}]}
    with pytest.raises(ValueError, match="take the engine-replica path, but no engine replica is given"):
        Manifest.model_validate({**base, "tensors": [loaded]})
    replica = build().replica
    assert replica is not None
    traced = TensorEntry.model_validate({**entry, "parts": [part]})
    with pytest.raises(ValueError, match="an engine replica fills every tensor of its rank"):
        Manifest.model_validate({**base, "tensors": [traced], "replica": {**replica.model_dump(), "rank": 0}})


FP8_FEEDS = [
    {"name": "w.weight", "dtype": "float8_e4m3fn", "shape": [300, 200]},
    {"name": "w.weight_scale_inv", "dtype": "float32", "shape": [3, 2]},
    {"name": NORM, "dtype": "bfloat16", "shape": [128]},
]
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}


def test_an_fp8_checkpoints_weights_are_made_from_the_trainers_tensors_with_their_scales() -> None:
    replica = build(feeds=FP8_FEEDS, quantization=FP8_CONFIG).replica
    assert replica is not None
    weight, scale, norm = replica.feeds
    assert (weight.quantize, weight.block, weight.scale) == ("fp8-block", (128, 128), "w.weight_scale_inv")
    assert scale.quantize is None and norm.quantize is None


@pytest.mark.parametrize(
    ("feeds", "quantization", "message"),
    [
        (FP8_FEEDS, None, "weightsync makes FP8 block-quantized weights only"),
        (FP8_FEEDS, {"quant_method": "fp8"}, "weightsync makes FP8 block-quantized weights only"),
        (FP8_FEEDS[:1], FP8_CONFIG, r"FP8 weight w\.weight has no w\.weight_scale_inv"),
        ([FP8_FEEDS[0], {**FP8_FEEDS[1], "shape": [2, 2]}], FP8_CONFIG, r"must be a float32 \[3, 2\]"),
    ],
)
def test_a_quantized_format_weightsync_cannot_make_is_refused(
    feeds: list[dict[str, Any]], quantization: Any, message: str
) -> None:
    with pytest.raises(ManifestError, match=message):
        build(feeds=feeds, quantization=quantization)


def test_parameters_no_checkpoint_tensor_writes_are_kept_by_the_engine_and_never_written() -> None:
    """An FP8 model's KV-cache ``k_scale``: the engine publishes it, its own load leaves it at its own value."""
    published = {**PUBLISHED, "attn.k_scale": [1 << 22, 1, 4]}
    manifest = assemble(0, 1, layout(kept=["attn.k_scale"]), "s:9", published, checksum="tensor-sha256-8", model="/m")
    assert "attn.k_scale" not in {t.name for t in manifest.tensors}
    assert manifest.replica is not None and manifest.replica.kept == ("attn.k_scale",)
    with pytest.raises(ManifestError, match="which its engine replica lacks"):  # kept by no one: not a kept name
        assemble(0, 1, layout(), "s:9", published, checksum="tensor-sha256-8", model="/m")


def test_layer_groups_name_each_feed_once_or_the_manifest_is_refused() -> None:
    assert build(layer_groups=[[0, 1], [2]]).replica.layer_groups == ((0, 1), (2,))  # type: ignore[union-attr]
    assert build().replica.layer_groups == ()  # type: ignore[union-attr]  # not checked layerwise: one load
    for groups in ([[0, 1]], [[0, 1], [1, 2]], [[0, 1], [2, 3]], [[0, 1, 2], []], [[0, 1], [-2]]):
        with pytest.raises(ValueError, match="must hold each of its 3 feeds exactly once"):
            build(layer_groups=groups)
