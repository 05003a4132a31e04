"""An engine replica's files (weightsync_agent/source/replica.py): the engine replica a loader fills and the feed
replica the trainer stages into, created by the sidecar and attached by the trainer, with real shared files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import xxhash

from weightsync_agent.engine_python import ENV_ENGINE_PYTHON
from weightsync_agent.layout.replica_manifest import assemble
from weightsync_agent.source.agent import SourceAgent
from weightsync_agent.source.replica import FEED_SUFFIX, REPLICA_SUFFIX, ReplicaError, ReplicaLayout, ReplicaSet

FUSED = "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight"
Q_A, KV_A, NORM = "model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "n"
LAYOUT = {
    "sglang": "0.5.23",
    "tp_size": 1,
    "dtype": "float32",
    "tensors": [
        {"name": FUSED, "dtype": "float32", "shape": [7, 4], "nbytes": 112},
        {"name": NORM, "dtype": "float32", "shape": [4], "nbytes": 16},
    ],
    "feeds": [
        {"name": Q_A, "dtype": "float32", "shape": [4, 4]},
        {"name": KV_A, "dtype": "float32", "shape": [3, 4]},
        {"name": NORM, "dtype": "float32", "shape": [4]},
    ],
}
MANIFEST = assemble(0, 0, LAYOUT, "s:1", {FUSED: [1 << 20, 28, 4], NORM: [1 << 21, 4, 4]},
                    checksum="tensor-sha256-8", model="/m")  # fmt: skip


def test_the_sidecar_creates_an_engine_replica_and_its_feed_and_the_trainer_stages_into_the_feed(
    tmp_path: Path,
) -> None:
    sidecar = ReplicaSet.for_manifests([MANIFEST], shm_dir=tmp_path, pin=False, digest_grain=64)
    trainer = ReplicaSet.attach(tmp_path, pin=False)
    try:
        assert {p.suffix for p in tmp_path.iterdir()} == {REPLICA_SUFFIX, FEED_SUFFIX}
        [replica] = list(trainer)
        assert replica.layout.replica == MANIFEST.replica.model_dump(mode="json")  # type: ignore[union-attr]
        assert trainer.full_names() == {Q_A, KV_A, NORM}  # what the trainer stages: the loader's inputs
        assert trainer.parts == 2 + 3 and len(trainer.missing()) == 5
        q_a = torch.arange(16, dtype=torch.float32).reshape(4, 4)
        assert trainer.stage(Q_A, q_a) == 1  # into the feed only: no cut fills an engine replica
        [feed] = sidecar.feeds.values()
        assert torch.equal(feed.tensor(Q_A), q_a) and not sidecar[MANIFEST.layout_fingerprint].staged([0, 1])
        assert trainer.stage_many({KV_A: torch.ones(3, 4), NORM: torch.full((4,), 2.0)}) == 2
        engine = sidecar[MANIFEST.layout_fingerprint]
        assert feed.is_complete() and sidecar.feed_for(engine) is feed and not engine.is_complete()
        # The loader (another process) writes the engine replica's file; the sidecar then files it as loaded.
        loader_view = ReplicaSet.attach(tmp_path, pin=False)[MANIFEST.layout_fingerprint]
        loader_view.raw(FUSED).copy_(torch.cat([q_a, torch.ones(3, 4)]).reshape(-1).view(torch.uint8))
        loader_view.raw(NORM).copy_(torch.full((4,), 2.0).view(torch.uint8))
        engine.mark_loaded()
        assert engine.is_complete() and not sidecar.missing()
        assert engine.digest(0) == f"{xxhash.xxh3_64_intdigest(engine.buffer[:64].numpy().tobytes()):016x}"
        sidecar.reset()  # a commit: the next version loads again
        assert len(sidecar.missing()) == sidecar.parts
        loader_view.close()
    finally:
        trainer.close()
        sidecar.close(unlink=True)


def test_only_an_engine_replica_is_marked_loaded_and_its_feeds_are_never_empty(tmp_path: Path) -> None:
    replicas = ReplicaSet.for_manifests([MANIFEST], pin=False)
    try:
        [feed] = replicas.feeds.values()
        with pytest.raises(ReplicaError, match="is not an engine replica"):
            feed.mark_loaded()
        with pytest.raises(ReplicaError, match="has no feed"):
            replicas.feed_for(feed)
    finally:
        replicas.close()
    with pytest.raises(ReplicaError, match="takes no 0-d or empty trainer tensor"):
        ReplicaLayout.of_feeds({"feeds": [{"name": "scale", "dtype": "float32", "shape": []}]})


def test_a_bf16_weight_staged_into_an_fp8_feed_is_quantized_with_its_scale(tmp_path: Path) -> None:
    from weightsync_agent.layout.quantize import fp8_block

    layout = {**LAYOUT, "quantization": {"quant_method": "fp8", "weight_block_size": [2, 2]}}
    layout["feeds"] = [
        {"name": Q_A, "dtype": "float8_e4m3fn", "shape": [4, 4]},
        {"name": Q_A + "_scale_inv", "dtype": "float32", "shape": [2, 2]},
        {"name": KV_A, "dtype": "float32", "shape": [3, 4]},
        {"name": NORM, "dtype": "float32", "shape": [4]},
    ]
    manifest = assemble(0, 0, layout, "s:1", {FUSED: [1 << 20, 28, 4], NORM: [1 << 21, 4, 4]},
                        checksum="tensor-sha256-8", model="/m")  # fmt: skip
    sidecar = ReplicaSet.for_manifests([manifest], shm_dir=tmp_path, pin=False)
    trainer = ReplicaSet.attach(tmp_path, pin=False)
    try:
        assert trainer.full_names() == {Q_A, KV_A, NORM}  # the scale comes with its weight
        weight = torch.randn(4, 4, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        assert trainer.stage(Q_A, weight) == 2
        [feed] = sidecar.feeds.values()
        quantized, scale = fp8_block(weight, (2, 2))
        assert torch.equal(feed.tensor(Q_A).view(torch.uint8), quantized.view(torch.uint8))
        assert torch.equal(feed.tensor(Q_A + "_scale_inv"), scale)
        with pytest.raises(ReplicaError, match=r"quantizes it \(fp8-block\); stage a 2-D float tensor"):
            trainer.stage(Q_A, torch.ones(16))
    finally:
        trainer.close()
        sidecar.close(unlink=True)


def test_a_loader_that_cannot_start_is_named_and_not_started_again_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each start imports the engine and builds its model: after a failure the source waits before the next try,
    and leaves no replica files behind."""
    monkeypatch.setenv(ENV_ENGINE_PYTHON, str(tmp_path / "no-such-python"))
    sources = SourceAgent("g", [0], make_transport=lambda: None, replica_root=lambda r: tmp_path / f"rank{r}")  # type: ignore[arg-type,return-value]
    with pytest.raises(ReplicaError, match=r"cannot start the engine's Python .*no-such-python"):
        sources.replica_set(0, [MANIFEST])
    with pytest.raises(ReplicaError, match=r"cannot start the engine's Python .* \(tried again in \d+ s\)"):
        sources.replica_set(0, [MANIFEST])
    assert not list((tmp_path / "rank0").glob("*")) and 0 not in sources.replicas
