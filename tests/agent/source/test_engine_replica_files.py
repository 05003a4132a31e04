"""An engine replica's files (weightsync_agent/source/replica.py): the engine replica a loader fills and the feed
replica the trainer stages into, created by the sidecar and attached by the trainer, with real shared files."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from weightsync_agent.engine_python import ENV_ENGINE_PYTHON
from weightsync_agent.layout.replica_manifest import assemble
from weightsync_agent.source.agent import SourceAgent
from weightsync_agent.source.feed_window import FeedWindow
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


#: Two layers' feeds of 64 KiB each and a head: large enough that giving a layer back frees whole pages.
BIG = [4096, 4]
LAYERED = {
    **LAYOUT,
    "feeds": [
        {"name": "model.layers.0.a.weight", "dtype": "float32", "shape": BIG},
        {"name": "model.layers.0.b.weight", "dtype": "float32", "shape": BIG},
        {"name": "model.layers.1.a.weight", "dtype": "float32", "shape": BIG},
        {"name": NORM, "dtype": "float32", "shape": [4]},
    ],
    "layer_groups": [[0, 1], [2], [3]],
}
LAYERS = [["model.layers.0.a.weight", "model.layers.0.b.weight"], ["model.layers.1.a.weight"], [NORM]]


@pytest.fixture
def directory(tmp_path: Path) -> Iterator[Path]:
    """A directory on tmpfs where there is one (/dev/shm, as the pods' replicas are): pages given back show there."""
    if not Path("/dev/shm").is_dir():
        yield tmp_path
        return
    made = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="ws-feed-"))
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_a_feed_gives_back_the_memory_of_what_was_loaded_and_refuses_to_be_read_again(directory: Path) -> None:
    manifest = assemble(0, 0, LAYERED, "s:1", {FUSED: [1 << 20, 28, 4], NORM: [1 << 21, 4, 4]},
                        checksum="tensor-sha256-8", model="/m")  # fmt: skip
    assert manifest.replica is not None and manifest.replica.layer_groups == ((0, 1), (2,), (3,))
    sidecar = ReplicaSet.for_manifests([manifest], shm_dir=directory, pin=False)
    trainer = ReplicaSet.attach(directory, pin=False)
    try:
        [feed] = sidecar.feeds.values()
        assert feed.shm_path is not None
        values = {name: torch.full(BIG, float(i + 1)) for i, name in enumerate(LAYERS[0] + LAYERS[1])}
        trainer.stage_many({**values, NORM: torch.ones(4)})
        staged = allocated(feed.shm_path)
        freed = feed.release(LAYERS[0])
        assert freed >= 2 * 64 * 1024 - 2 * 4096  # whole pages inside the layer's two tensors
        assert staged - allocated(feed.shm_path) >= freed - 4096  # the file's pages went back to the system
        [trainer_feed] = trainer.feeds.values()
        assert not trainer_feed.tensor(LAYERS[0][0])[1:-1].any()  # the trainer's mapping reads zeros there
        assert torch.equal(trainer_feed.tensor(LAYERS[1][0]), values[LAYERS[1][0]])  # the next layer is untouched
        # Still staged for this version (a publish finds the feed complete), but never read again as if it were.
        assert feed.is_complete() and not feed.missing()
        assert feed.released(LAYERS[0] + LAYERS[1]) == sorted(LAYERS[0])
        trainer.stage(LAYERS[0][0], values[LAYERS[0][0]])  # staged again: its bytes are back
        assert feed.released(LAYERS[0]) == [LAYERS[0][1]]
        assert torch.equal(feed.tensor(LAYERS[0][0]), values[LAYERS[0][0]])
        sidecar.reset()
        assert feed.released(LAYERS[0]) == [] and len(feed.missing()) == 4
    finally:
        trainer.close()
        sidecar.close(unlink=True)


class Loader:
    """Stands for an engine replica's loader process (its load reads the feed, here into a list)."""

    def __init__(self, feed: Any, groups: list[list[str]]) -> None:
        self.feed, self.layer_groups = feed, groups
        self.loads: list[tuple[list[str], list[float]]] = []

    def load(self, timeout: float, names: list[str] | None = None) -> float:
        assert names is not None
        self.loads.append((names, [float(self.feed.tensor(n).reshape(-1)[0]) for n in names]))
        return 0.001


def test_a_streamed_feed_loads_each_layer_once_it_is_staged_and_holds_only_what_is_not_loaded_yet(
    directory: Path,
) -> None:
    """The trainer streams layer 1, then layer 0, then the head; the source loads each as soon as it is staged, in
    the order staged, and gives it back: the feed never holds more than the layer being staged and loaded."""
    manifest = assemble(0, 0, LAYERED, "s:1", {FUSED: [1 << 20, 28, 4], NORM: [1 << 21, 4, 4]},
                        checksum="tensor-sha256-8", model="/m")  # fmt: skip
    sidecar = ReplicaSet.for_manifests([manifest], shm_dir=directory, pin=False)
    trainer = ReplicaSet.attach(directory, pin=False)
    try:
        [feed] = sidecar.feeds.values()
        assert feed.shm_path is not None
        loader = Loader(feed, LAYERS)
        trainer.reset()
        trainer.mark_stream(7, "open")
        peak = [0]
        order = [LAYERS[1], LAYERS[0], LAYERS[2]]

        def stream() -> None:
            with trainer.streaming():
                for step, names in enumerate(order):
                    for name in names:
                        trainer.stage(name, torch.full(BIG if name != NORM else [4], 10.0 + step))
                    peak[0] = max(peak[0], allocated(feed.shm_path))  # type: ignore[arg-type]
                    deadline = time.monotonic() + 10
                    while len(loader.loads) <= step and time.monotonic() < deadline:  # the source took it
                        time.sleep(0.005)
            trainer.mark_stream(7, "closed")

        worker = threading.Thread(target=stream)
        worker.start()
        seconds = SourceAgent._load_groups(0, 7, time.monotonic() + 20, [loader], LAYERS)  # type: ignore[list-item]
        worker.join()
        assert seconds > 0 and [names for names, _ in loader.loads] == order  # as staged, each once
        assert [values for _, values in loader.loads] == [[10.0], [11.0, 11.0], [12.0]]  # read before given back
        assert peak[0] <= 2 * 64 * 1024 + 3 * 4096 < 3 * 64 * 1024  # never the whole model's feed
        assert feed.released([n for names in LAYERS for n in names]) == sorted(n for names in LAYERS for n in names)
        with pytest.raises(ReplicaError, match="was given back after an earlier version's load"):
            SourceAgent._load_groups(0, 8, time.monotonic() + 5, [loader], LAYERS)  # type: ignore[list-item]
    finally:
        trainer.close()
        sidecar.close(unlink=True)


#: Four layers of one 64 KiB feed each: a window (twice the largest layer) of 128 KiB holds two of them.
FOUR = [f"model.layers.{i}.a.weight" for i in range(4)]
FOUR_LAYERS = {
    **LAYOUT,
    "feeds": [{"name": name, "dtype": "float32", "shape": BIG} for name in FOUR],
    "layer_groups": [[0], [1], [2], [3]],
}


class SlowLoader(Loader):
    def load(self, timeout: float, names: list[str] | None = None) -> float:
        time.sleep(0.15)  # the engine's load_weights, slower than staging
        return super().load(timeout, names)


def four_layer_files(directory: Path) -> tuple[ReplicaSet, ReplicaSet]:
    manifest = assemble(0, 0, FOUR_LAYERS, "s:1", {FUSED: [1 << 20, 28, 4], NORM: [1 << 21, 4, 4]},
                        checksum="tensor-sha256-8", model="/m")  # fmt: skip
    sidecar = ReplicaSet.for_manifests([manifest], shm_dir=directory, pin=False)
    return sidecar, ReplicaSet.attach(directory, pin=False)


def test_a_streamed_feed_stays_within_its_window_when_the_trainer_outruns_the_loader(directory: Path) -> None:
    sidecar, trainer = four_layer_files(directory)
    try:
        [feed] = sidecar.feeds.values()
        window = FeedWindow(trainer)
        assert list(window.windows.values()) == [2 * 64 * 1024]  # twice the largest layer
        loader = SlowLoader(feed, [[name] for name in FOUR])
        trainer.reset()
        trainer.mark_stream(3, "open")
        peak = [0]

        def stream() -> None:
            with trainer.streaming():
                for name in FOUR:
                    window.room(name)
                    trainer.stage(name, torch.full(BIG, 1.0))
                    peak[0] = max(peak[0], feed.held_bytes())
            trainer.mark_stream(3, "closed")

        worker = threading.Thread(target=stream)
        worker.start()
        SourceAgent._load_groups(0, 3, time.monotonic() + 30, [loader], [[name] for name in FOUR])  # type: ignore[list-item]
        worker.join()
        assert [names for names, _ in loader.loads] == [[name] for name in FOUR]
        assert window.waited > 0.1  # the trainer waited for the loader
        assert peak[0] <= 2 * 64 * 1024 + 3 * 4096, peak  # never more than the window (and the file's header pages)
    finally:
        trainer.close()
        sidecar.close(unlink=True)


def test_staging_goes_on_past_the_window_when_no_layer_is_taken_and_stops_waiting_when_the_version_ended(
    directory: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sidecar, trainer = four_layer_files(directory)
    try:
        window = FeedWindow(trainer, stall_seconds=0.3)
        for name in FOUR[:2]:
            window.room(name)
            trainer.stage(name, torch.full(BIG, 1.0))  # nothing loads them
        began = time.monotonic()
        assert window.room(FOUR[2]) >= 0.3 and time.monotonic() - began < 5  # went on after the stall
        assert "took no layer for 0 s while its feed holds" in caplog.text  # said once
        assert window.room(FOUR[3], ended=lambda: True) < 0.1  # the version already ended: no wait
    finally:
        trainer.close()
        sidecar.close(unlink=True)
