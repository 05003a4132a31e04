"""Broadcast mode into the STOCK SGLang server (PyPI 0.5.23, unedited, on CPU) through its own routes.

Trainer rank 0's agent forms a torch custom process group (gloo: this machine has no GPU) that every SGLang
TP rank joins through ``/init_weights_update_group``; each round it tells SGLang the full HF tensors of a
chunk (``/update_weights_from_distributed``, which blocks while SGLang receives and runs its own
``load_weights``, cutting its shards) while broadcasting them, then verifies every rank with SGLang's
``/weights_checker`` against hashes it computed from the full tensors cut by the manifests, and only then
relabels. Rank 1 stages but sends nothing.

- ``test_broadcast_rounds_into_stock_sglang_verify_and_generate_like_hf`` (TP=1, TP=2, real agents): two
  rounds; the engine reports the version, its checksums equal the trainer's bytes per rank, and greedy
  ``/generate`` equals an HF ``transformers`` forward of the trainer's weights.
- ``test_a_failed_broadcast_round_never_relabels_and_the_next_repairs`` (TP=1, the sender and driver in this
  process over the real adapter): the sender drops its group after the first chunk (as if killed): SGLang's
  receive fails at once, the round fails and the version stays; a wrong hash fails verification naming the
  parameter, the version stays; the next round, over a group formed anew, lands and verifies.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sglang_helpers import assert_generates_like_hf
from test_sglang_rounds import TEMPLATE

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync.plan import plan_for
from weightsync.ports import free_port
from weightsync_agent.http.client import HttpCallError
from weightsync_agent.layout.sglang_hash.tensor_hash import sglang_cpu_hash
from weightsync_agent.modes.broadcast.layout import broadcast_round_plan
from weightsync_agent.modes.broadcast.sender import BroadcastSource
from weightsync_agent.rounds.driver import RoundDriver
from weightsync_agent.source.report import SourceReport
from weightsync_agent.targets.adapter import AdapterSettings
from weightsync_agent.targets.engine_client import EngineClient
from weightsync_agent.targets.engine_trace import ENV_ENGINE_PYTHON
from weightsync_agent.targets.sglang.adapter import SglangAdapter
from weightsync_agent.transport.custom_group import CustomGroupSender
from weightsync_testing.engine_harness import SglangEngines
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.server_process import retire
from weightsync_testing.sglang_models import trained_state
from weightsync_testing.trainer_ranks import publish_all

EMBED = "model.embed_tokens.weight"


def spec(tp: int, trainers: int = 2) -> WeightSyncGroupSpec:
    return WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": trainers, "template": TEMPLATE},
            "inference": {"engines": 1, "ranksPerEngine": tp, "ranksPerPod": tp, "adapter": "sglang",
                          "template": TEMPLATE},
            "transfer": {"mode": "broadcast", "bucketSizeMiB": 1, "timeoutSeconds": 60},
        }
    )  # fmt: skip


def held_checksums(engine: EngineClient) -> dict[tuple[int, str], str]:
    _, answer = engine.request("POST", "/weights_checker", body={"action": "checksum"}, timeout=60)
    return {
        (int(e["parallelism_info"][0]["tp_rank"]), name): value
        for e in answer["ranks"]
        for name, value in e["checksums"].items()
    }


@pytest.fixture(params=[1, 2], ids=["tp1", "tp2"])
def group(request: pytest.FixtureRequest, sglang_py: Path, tiny_llama: Path, tmp_path: Path) -> Iterator[LoopbackGroup]:
    harness = SglangEngines(tiny_llama, python=str(sglang_py), dtype="float32", log_dir=tmp_path / "sglang")
    with LoopbackGroup(spec(request.param), group=f"sg-bcast-tp{request.param}", engines=harness) as running:
        running.start(timeout=300)
        yield running


def test_broadcast_rounds_into_stock_sglang_verify_and_generate_like_hf(
    group: LoopbackGroup, sglang_py: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    clients = [group.client(rank) for rank in range(2)]
    engine = group.engines[0].client(timeout=60)
    tp = group.plan.layout.ranks_per_engine
    try:
        assert len(clients[0].replicas) == 1 and len(clients[1].replicas) == 0  # rank 0 holds the full tensors
        for version in (1, 2):
            full = trained_state(tiny_llama, version)
            began = time.monotonic()
            outcomes = publish_all(clients, full, version)
            print(f"\nbroadcast round v{version} at TP={tp}: {time.monotonic() - began:.3f} s")
            assert all(getattr(o, "ok", False) for o in outcomes), [str(o) for o in outcomes]
            assert engine.weight_version() == str(version)

            # SGLang's own checksums of its live weights equal the sha256[:8] of the trainer's bytes, per rank.
            held = held_checksums(engine)
            for rank, shard in enumerate(full[EMBED].chunk(tp, dim=0)):
                assert held[(rank, EMBED)] == sglang_cpu_hash(shard), rank
            for rank in range(tp):
                assert held[(rank, "model.norm.weight")] == sglang_cpu_hash(full["model.norm.weight"])
                layer = "model.layers.1.self_attn."
                q, k, v = (full[f"{layer}{p}_proj.weight"].chunk(tp, dim=0)[rank] for p in "qkv")
                assert held[(rank, layer + "qkv_proj.weight")] == sglang_cpu_hash(torch.cat([q, k, v])), rank

            assert_generates_like_hf(engine, sglang_py, tiny_llama, full, version, tmp_path)
        # What ran: every SGLang TP rank joined one custom group over gloo, once, from SGLang's own route.
        server = group.harness.servers[0]  # type: ignore[attr-defined]
        joins = [line for line in server.log_path.read_text().splitlines() if "init custom process group" in line]
        assert len(joins) == tp and all("backend=gloo" in line for line in joins), joins
    finally:
        for client in clients:
            client.close()


class Tampering:
    """Rank 0's SourceControl with one parameter's reported hash flipped (a wrong hash from the sender)."""

    def __init__(self, inner: BroadcastSource, name: str) -> None:
        self.inner, self.source, self.name = inner, inner.source, name

    def prepare(self, version: int, deadline: float) -> SourceReport:
        return self.inner.prepare(version, deadline)

    def publish(self, version: int, deadline: float) -> SourceReport:
        report = self.inner.publish(version, deadline)
        ((target, sums),) = report.checksums.items()
        index = [t.name for t in self.inner.manifests[target].tensors].index(self.name)
        wrong = list(sums)
        wrong[index] = "0" * 16
        return SourceReport(source=report.source, ok=report.ok, checksums={target: wrong}, bytes=report.bytes)


def test_a_failed_broadcast_round_never_relabels_and_the_next_repairs(
    sglang_py: Path, tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from weightsync_testing.sglang_server import launch_sglang

    monkeypatch.setenv(ENV_ENGINE_PYTHON, str(sglang_py))
    plan = plan_for(spec(1), group="g", namespace="ns")
    server = launch_sglang(tiny_llama, tp=1, python=sglang_py, dtype="float32", log_dir=tmp_path / "sglang")
    source: BroadcastSource | None = None
    try:
        settings = AdapterSettings(engine=0, url=server.url, ranks=1, bucket_bytes=plan.transfer.bucket_bytes,
                                   call_timeout=30, engine_side=True)  # fmt: skip
        adapter = SglangAdapter(settings)
        assert adapter.readiness().ready
        source = BroadcastSource(plan, {(0, 0): adapter.manifest(0)}, {0: adapter}, call_timeout=30)
        assert source.layout.world_size == 2 and set(source.expected) == set(trained_state(tiny_llama, 0))
        engine = EngineClient(server.url, timeout=60)

        def run(version: int, control: object) -> str | None:
            driver = RoundDriver(broadcast_round_plan(plan), {0: adapter}, {0: control},  # type: ignore[dict-item]
                                 timeout_seconds=60, call_timeout=30, retries=0)  # fmt: skip
            try:
                result = driver.run(version)
            finally:
                driver.close()
            return None if result.result == "Succeeded" else f"{result.result}: {result.reason}"

        def stage(version: int) -> dict[str, torch.Tensor]:
            full = trained_state(tiny_llama, version)
            source.reset()
            source.stage_many(full)
            return full

        source.connect(f"tcp://127.0.0.1:{free_port()}")
        assert isinstance(source.group, CustomGroupSender) and source.group.backend == "gloo"
        first_group = source.group.group_name
        full = stage(1)
        assert run(1, source) is None
        assert engine.weight_version() == "1" and held_checksums(engine)[(0, EMBED)] == sglang_cpu_hash(full[EMBED])

        # The sender drops its group after the first chunk, as if it died: SGLang, blocked receiving the second
        # chunk, fails at once (gloo: the peer's sockets closed), so the round fails and nothing is relabelled.
        chunks = len(list(source._chunks()))
        assert chunks >= 2
        stage(2)
        sender_group = source.group

        def kill(index: int, _: int) -> None:
            if index == 0:
                sender_group.close("killed by the test")

        source.progress = kill
        began = time.monotonic()
        failed = run(2, source)
        # Whichever notices first: this side's broken group, or SGLang's failed receive of chunk 1.
        assert failed is not None and ("killed by the test" in failed or "did not load chunk 1" in failed), failed
        assert time.monotonic() - began < 30  # not SGLang's 30-minute collective timeout
        assert engine.weight_version() == "1"
        assert source.group is None  # dropped: the next round must form the group anew
        source.progress = None
        # SGLang still answers admin calls (its scheduler is not stuck in a broadcast) and left the old group.
        with pytest.raises(HttpCallError, match="does not exist"):
            engine.request("POST", "/destroy_weights_update_group", body={"group_name": first_group}, timeout=30)

        # A wrong hash from the sender: SGLang's checksum disagrees, verification fails naming the parameter.
        source.connect(f"tcp://127.0.0.1:{free_port()}")
        assert source.group is not None and source.group.group_name != first_group
        stage(3)
        failed = run(3, Tampering(source, "model.norm.weight"))
        assert failed is not None and "failed verification of version 3" in failed and "model.norm.weight" in failed
        assert engine.weight_version() == "1"

        # The next round lands and verifies over the same group.
        full = stage(4)
        assert run(4, source) is None
        assert engine.weight_version() == "4"
        held = held_checksums(engine)
        assert held[(0, EMBED)] == sglang_cpu_hash(full[EMBED]) and held[(0, "model.norm.weight")] == sglang_cpu_hash(
            full["model.norm.weight"]
        )
    finally:
        if source is not None:
            source.close()
        retire(server.stop)
