"""Bad input is refused with an error that names the offending thing, before any byte reaches an engine.

Real reference engines (in this process, so their weight buffers can be compared byte for byte), real
tensors, the memory transport and, where it matters, real Mooncake. What ``tests/agent/source`` already
covers is not repeated: stage-time dtype/shape checks on toy layouts, manifests that miss planned targets,
a source rank outside the plan, and the replica refusing an incomplete publish; ``tests/unit/agent``
covers agents whose ranks the plan does not know. Here: manifests as an engine serves them (tampered on
the wire), the reference model's own layouts, a coordinator handed peers the plan does not know, and a
plan asking engines for ranks they do not have.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from aiohttp import web

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync.plan import Plan, Target, plan_for
from weightsync_agent.http.client import HttpCallError
from weightsync_agent.http.server import BackgroundServer
from weightsync_agent.rounds.driver import RoundDriver, RoundError
from weightsync_agent.source.replica import IncompleteReplicaError, ReplicaError
from weightsync_agent.source.writer import InProcessSourceControl, Source
from weightsync_agent.targets.engine_client import EngineClient
from weightsync_agent.targets.reference.adapter import reference_adapter
from weightsync_agent.transport.base import Transport
from weightsync_agent.transport.memory import MemoryTransport
from weightsync_agent.transport.mooncake import MooncakeTransport
from weightsync_testing.reference_engine.model import full_state
from weightsync_testing.reference_engine.server import ReferenceEngine, serve_in_thread

TEMPLATE = {"spec": {"containers": [{"name": "main"}]}}
TP = 2
BUCKET_BYTES = 64 << 10
INFO = "/remote_instance_transfer_engine_info"


def make_plan(engines: int = 1, tp: int = TP, sources: int = 1) -> Plan:
    spec = WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": sources, "template": TEMPLATE},
            "inference": {"engines": engines, "ranksPerEngine": tp, "adapter": "reference", "template": TEMPLATE},
            "transfer": {"bucketSizeMiB": 1, "timeoutSeconds": 30},
        }
    )
    return plan_for(spec, group="bad", namespace="ns")


class Engine:
    """A reference engine in this process, served over HTTP, with its initial weights kept for comparison."""

    def __init__(self, transports: list[Transport]) -> None:
        self.engine = ReferenceEngine(engine=0, tp=TP, seed=3, transports=transports)
        # Round 1 open, as the driver opens it before any write: outside a round the memory refuses every write.
        self.engine.pause("abort")
        self.engine.begin("1")
        self.initial = [w.buffer.clone() for w in self.engine.weights]
        self.server = serve_in_thread(self.engine).start()
        self.client = EngineClient(self.server.url, timeout=10)

    def untouched(self) -> bool:
        return all(torch.equal(w.buffer, b) for w, b in zip(self.engine.weights, self.initial, strict=True))

    def close(self) -> None:
        self.server.stop()
        self.engine.close()


@pytest.fixture
def engine() -> Iterator[Engine]:
    served = Engine([MemoryTransport() for _ in range(TP)])
    try:
        yield served
    finally:
        served.close()


# --- Malformed manifests, as a source fetches them --------------------------------------------------

Tamper = Callable[[dict[str, Any]], None]


def _tensor(name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda m: next(t for t in m["tensors"] if t["name"] == name)


QKV = _tensor("model.layers.0.self_attn.qkv_proj.weight")
NORM = _tensor("model.layers.0.input_layernorm.weight")


def _drop(field: str) -> Tamper:
    return lambda m: QKV(m).pop(field)


def _overlapping_region(m: dict[str, Any]) -> None:
    region = m["regions"][0]
    m["regions"].append({"address": region["address"] + 64, "nbytes": 128})


def _beyond_region(m: dict[str, Any]) -> None:
    region = m["regions"][0]
    last = m["tensors"][-1]
    last["address"] = region["address"] + region["nbytes"] - last["nbytes"] + 4  # 4 bytes past the buffer


def _parts_do_not_tile(m: dict[str, Any]) -> None:
    QKV(m)["parts"][0]["length"] -= 1  # q is one row short: the parts no longer add up to the tensor


def _slice_past_full(m: dict[str, Any]) -> None:
    QKV(m)["parts"][0]["start"] = QKV(m)["parts"][0]["fullShape"][0]


CASES: dict[str, tuple[Tamper, str]] = {
    "missing nbytes": (_drop("nbytes"), r"tensors\.\d+\.nbytes\s+Field required"),
    "missing parts": (_drop("parts"), r"a traced tensor needs at least one part"),
    "missing session": (lambda m: m.pop("sessionId"), r"sessionId\s+Field required"),
    "negative length": (
        lambda m: QKV(m)["parts"][0].update(length=-3),
        r"tensors\.\d+\.parts\.0\.length\s+Input should be greater than or equal to 1",
    ),
    "negative nbytes": (
        lambda m: NORM(m).update(nbytes=-256),
        r"tensors\.\d+\.nbytes\s+Input should be greater than or equal to 0",
    ),
    "unknown dtype": (lambda m: NORM(m).update(dtype="float4"), r"tensors\.\d+\.dtype"),
    "wrong nbytes": (
        lambda m: NORM(m).update(nbytes=NORM(m)["nbytes"] * 2),
        r"layers\.0\.input_layernorm\.weight: nbytes \d+ does not match shape",
    ),
    "parts do not tile": (_parts_do_not_tile, r"qkv_proj\.weight: part from .*q_proj\.weight has shape|add up to"),
    "slice past the full tensor": (_slice_past_full, r"q_proj\.weight: slice \[\d+, \d+\) exceeds dim 0"),
    "padding that does not add up": (
        lambda m: QKV(m).update(padding=1),
        r"qkv_proj\.weight: parts add up to \d+ plus 1 padding along dim 0, tensor has \d+",
    ),
    "negative padding": (
        lambda m: QKV(m).update(padding=-2),
        r"tensors\.\d+\.padding\s+Input should be greater than or equal to 0",
    ),
    "an expert index on one part only": (
        lambda m: QKV(m)["parts"][1].update(at=[0]),
        r"qkv_proj\.weight: parts index 0 and 1 leading dims; one count only",
    ),
    "an expert index off the tensor": (
        lambda m: (QKV(m).update(catDim=1), [p.update(at=[99999]) for p in QKV(m)["parts"]]),
        r"qkv_proj\.weight: part from .*q_proj\.weight lands at \[99999\], off the tensor",
    ),
    "tensors overlap": (
        lambda m: NORM(m).update(address=QKV(m)["address"]),
        r"tensors .* and .* overlap in the engine's memory",
    ),
    "overlapping regions": (_overlapping_region, r"regions \[0x[0-9a-f]+, \+\d+\) and \[0x[0-9a-f]+, \+128\) overlap"),
    "beyond the registered buffer": (_beyond_region, r"lm_head\.weight is not inside any registered region"),
}


def tampering_proxy(real: EngineClient, tamper: Tamper | None, raw: str | None = None) -> web.Application:
    """Serves the real engine's transfer-engine info, with rank 1's manifest tampered (or replaced by ``raw``)."""

    async def info(request: web.Request) -> web.StreamResponse:
        rank = int(request.query["rank"])
        answer = real.request("GET", INFO, query={"rank": rank})[1]
        if rank == 1:
            if raw is not None:
                return web.Response(text=raw, content_type="application/json")
            manifest = copy.deepcopy(answer["remote_instance_transfer_engine_info"][1])
            assert tamper is not None
            tamper(manifest)
            answer["remote_instance_transfer_engine_info"][1] = manifest
        return web.json_response(answer)

    app = web.Application()
    app.add_routes([web.get(INFO, info)])
    return app


def fetch_manifests_and_publish(client: EngineClient, plan: Plan, source_transport: Transport) -> None:
    """What a source agent does: fetch every planned target's manifest, build the source, publish."""
    manifests = {t: client.manifest(t[1]) for t in plan.sources[0].targets}
    with Source(source_transport, plan, 0, manifests, BUCKET_BYTES, pin=False) as source:
        source.replicas.stage_many(full_state(seed=11))
        assert source.publish(1, timeout=10).ok


@pytest.mark.parametrize("case", list(CASES))
def test_a_malformed_manifest_is_refused_naming_the_field(engine: Engine, case: str) -> None:
    tamper, message = CASES[case]
    with BackgroundServer(tampering_proxy(engine.client, tamper)) as proxy, MemoryTransport() as sender:
        with pytest.raises(HttpCallError) as refused:
            fetch_manifests_and_publish(EngineClient(proxy.url, timeout=10), make_plan(), sender)
        text = str(refused.value)
        assert "rank 1: weights info is not a manifest" in text, text
        assert re.search(message, text), text
    assert engine.untouched()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"rank": 1, "remote_instance_transfer_engine_info": ["s", {"engine": 0', "expected a JSON object, got str"),
        ('{"rank": 1, "remote_instance_transfer_engine_info": ["s", "{broken"]}', "valid dictionary"),
        ('{"rank": 1, "remote_instance_transfer_engine_info": {"sessionId": "s"}}', r"expected \[session_id"),
    ],
    ids=["truncated JSON", "manifest not an object", "no session/manifest pair"],
)
def test_an_unparsable_transfer_engine_info_is_refused(engine: Engine, raw: str, message: str) -> None:
    with BackgroundServer(tampering_proxy(engine.client, None, raw)) as proxy, MemoryTransport() as sender:
        with pytest.raises(HttpCallError, match=message) as refused:
            fetch_manifests_and_publish(EngineClient(proxy.url, timeout=10), make_plan(), sender)
        assert INFO in str(refused.value)  # the route; the caller knows the rank it asked for
    assert engine.untouched()


def test_the_untampered_proxy_path_does_publish(engine: Engine) -> None:
    """The control for the two tests above: the same path with nothing tampered writes the engine."""
    with BackgroundServer(tampering_proxy(engine.client, lambda m: None)) as proxy, MemoryTransport() as sender:
        fetch_manifests_and_publish(EngineClient(proxy.url, timeout=10), make_plan(), sender)
    assert not engine.untouched()


# --- Wrong sizes or dtypes from the trainer -------------------------------------------------------


def reference_source(engine: Engine, transport: Transport) -> Source:
    plan = make_plan()
    manifests = {t: engine.client.manifest(t[1]) for t in plan.sources[0].targets}
    return Source(transport, plan, 0, manifests, BUCKET_BYTES, pin=False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.to(torch.bfloat16), r"dtype torch\.bfloat16 differs from the target's torch\.float32"),
        (
            lambda t: t.t().contiguous(),
            r"shape \[64, 128\] differs from the full shape the target expects, \[128, 64\]",
        ),
        (lambda t: t[:-1], r"shape \[127, 64\] differs"),
    ],
    ids=["dtype", "transposed", "one row short"],
)
def test_a_mis_shaped_trainer_tensor_names_both_tensors_and_writes_nothing(
    engine: Engine, change: Callable[[torch.Tensor], torch.Tensor], message: str
) -> None:
    full = full_state(seed=11)
    name = "model.layers.1.mlp.gate_proj.weight"
    with MemoryTransport() as sender, reference_source(engine, sender) as source:
        replicas = [r.buffer.clone() for r in source.replicas]
        with pytest.raises(ReplicaError, match=message) as refused:
            source.replicas.stage(name, change(full[name]))
        assert repr(name) in str(refused.value) and "'model.layers.1.mlp.gate_up_proj.weight'" in str(refused.value)
        assert all(torch.equal(r.buffer, b) for r, b in zip(source.replicas, replicas, strict=True))
        # The round then refuses to send a version the bad tensor should have been part of.
        source.replicas.stage_many({n: t for n, t in full.items() if n != name})
        with pytest.raises(IncompleteReplicaError, match=r"layers\.1\.mlp\.gate_up_proj\.weight \(from " + name):
            source.publish(1, timeout=10)
    assert engine.untouched()


def test_a_tensor_missing_at_publish_over_mooncake_writes_nothing_then_the_full_version_lands() -> None:
    """The same refusal with real Mooncake sessions; staging the missing tensor then publishes bit-exact."""
    served = Engine([MooncakeTransport("127.0.0.1", "tcp", timeout_seconds=5) for _ in range(TP)])
    try:
        full = full_state(seed=12)
        missing = "model.layers.0.self_attn.k_proj.weight"
        with (
            MooncakeTransport("127.0.0.1", "tcp", timeout_seconds=5) as sender,
            reference_source(served, sender) as source,
        ):
            source.replicas.stage_many({n: t for n, t in full.items() if n != missing})
            with pytest.raises(IncompleteReplicaError, match=r"qkv_proj\.weight \(from " + re.escape(missing)):
                source.publish(1, timeout=10)
            assert served.untouched()
            source.replicas.stage(missing, full[missing])
            result = source.publish(1, timeout=10)
            assert result.ok, result.summary()
            for rank, memory in enumerate(served.engine.memory):
                assert memory.verify(BUCKET_BYTES, list(result.targets[(0, rank)].checksums)).ok, rank
            assert not served.untouched()
    finally:
        served.close()


# --- Plans naming ranks nobody has -----------------------------------------------------------------


def test_a_coordinator_handed_peers_the_plan_does_not_know_is_refused(engine: Engine) -> None:
    plan = make_plan()
    engine.engine.abort(None)  # no round open: the driver must not open one either
    with MemoryTransport() as sender, reference_source(engine, sender) as source:
        control = reference_adapter(0, engine.client.base_url, bucket_bytes=BUCKET_BYTES)
        sources = {0: InProcessSourceControl(source)}
        with pytest.raises(RoundError, match=r"does not know engines \[3\] or sources \[\]"):
            RoundDriver(plan, {0: control, 3: control}, sources)
        with pytest.raises(RoundError, match=r"does not know engines \[\] or sources \[2\]"):
            RoundDriver(plan, {0: control}, {**sources, 2: sources[0]})
    assert engine.untouched() and engine.client.status()["round"] is None  # nothing was begun either


def test_a_plan_asking_an_engine_for_a_rank_it_lacks_fails_at_the_manifest(engine: Engine) -> None:
    plan = make_plan(tp=4)  # the engine runs TP2
    targets: tuple[Target, ...] = plan.sources[0].targets
    assert (0, 3) in targets
    with pytest.raises(HttpCallError, match="Failed to get transfer engine info for rank 2") as refused:
        for target in targets:
            engine.client.manifest(target[1])
    assert refused.value.status == 400
    assert engine.untouched()
