"""The agent's two seams (docs/architecture.md): engine adapters and sync modes, and what depends on them."""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Collection, Mapping
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import get_args

import pytest
import torch
import xxhash

from weightsync.api import engines
from weightsync.api.engines import ENGINE_KINDS, EngineKind, Refusal, Request, SyncModeName, refusal
from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync.plan import Plan, plan_for
from weightsync_agent.http.client import HttpCallError
from weightsync_agent.layout.manifest import Manifest, Region, ShardPart, TensorEntry
from weightsync_agent.modes.broadcast.checksums import target_checksums
from weightsync_agent.modes.broadcast.mode import BroadcastMode
from weightsync_agent.modes.p2p.mode import P2PMode
from weightsync_agent.modes.registry import MODES, make_mode
from weightsync_agent.source.agent import SourceAgent
from weightsync_agent.source.control import RoundScope, SourceControl
from weightsync_agent.source.report import SourceReport
from weightsync_agent.source.writer import SourceConfigError
from weightsync_agent.targets.adapter import (
    AdapterSettings,
    AdapterUnavailableError,
    BroadcastReception,
    EngineAdapter,
    Readiness,
)
from weightsync_agent.targets.agent import EngineAgent
from weightsync_agent.targets.registry import ADAPTERS, MODE_ADAPTERS, SEAM, make_adapter, resolve, settings_for
from weightsync_agent.targets.vllm.adapter import VllmAdapter
from weightsync_agent.targets.vllm.live_adapter import VllmLiveAdapter
from weightsync_agent.targets.vllm.nccl_adapter import VllmNcclAdapter

AGENT = Path(__file__).resolve().parents[3] / "agent" / "weightsync_agent"
SETTINGS = AdapterSettings(engine=0, url="http://127.0.0.1:9", ranks=2, bucket_bytes=1 << 20)


# --- Engine adapters ---------------------------------------------------------------------------------


def test_every_registered_path_resolves_to_an_adapter_of_its_kind() -> None:
    """The registry names classes by ``"module:Class"`` (imported on use): each must be there, an EngineAdapter, and
    of the kind it is registered under."""
    registered = {path: kind for kind, path in ADAPTERS.items()}
    registered |= {path: kind for (kind, _, _), path in MODE_ADAPTERS.items()}
    for path, kind in registered.items():
        factory = resolve(path)
        assert isinstance(factory, type), path
        assert {"manifest", "pause", "begin", "verify", "commit", "abort"} <= SEAM
        assert all(callable(getattr(factory, name)) for name in SEAM), path
        assert factory.kind == kind, path
    with pytest.raises(TypeError, match="AdapterSettings is not an EngineAdapter"):
        resolve("weightsync_agent.targets.adapter:AdapterSettings")


def test_every_registered_adapter_declares_its_contract_capabilities() -> None:
    for kind, path in ADAPTERS.items():
        adapter = resolve(path)(SETTINGS)
        assert adapter.kind == kind
        assert adapter.capabilities == ENGINE_KINDS[kind].capabilities  # type: ignore[index]


def test_every_kind_the_contract_calls_available_has_an_adapter_and_no_other() -> None:
    available = {kind for kind, spec in ENGINE_KINDS.items() if spec.capabilities is not None}
    assert available == set(ADAPTERS)


def test_an_adapter_has_every_method_of_the_seam() -> None:
    members = [
        name
        for klass in EngineAdapter.__mro__
        if klass.__name__ in {"EngineAdapter", "EngineRound"}
        for name, value in vars(klass).items()
        if callable(value) and not name.startswith("_")
    ]
    assert {"manifest", "held_version", "readiness", "pause", "begin", "verify", "commit", "abort"} <= set(members)
    for path in ADAPTERS.values():
        adapter = resolve(path)(SETTINGS)
        missing = [name for name in members if not callable(getattr(adapter, name, None))]
        assert not missing, f"{type(adapter).__name__} lacks {missing}"


def test_an_engine_kind_without_an_adapter_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    planned = EngineKind("planned", None, unavailable="planned for later")  # type: ignore[arg-type]
    monkeypatch.setitem(engines.ENGINE_KINDS, "planned", planned)  # type: ignore[misc, arg-type]
    with pytest.raises(AdapterUnavailableError, match=r"inference\.adapter 'planned' has no weightsync adapter"):
        make_adapter("planned", SETTINGS)
    with pytest.raises(AdapterUnavailableError, match="'nonesuch' is not a known engine kind"):
        make_adapter("nonesuch", SETTINGS)


def test_an_engine_pod_whose_adapter_is_refused_stays_unready_saying_why() -> None:
    said: list[tuple[bool, str, str]] = []
    why = refusal("sglang", Request("p2p", "staged", True))
    assert why is not None
    agent = EngineAgent("g", "http://127.0.0.1:9", why, advertise=True,
                        set_ready=lambda *a: said.append(a))  # fmt: skip
    state = agent.check()
    assert not state.ready and said == [(False, "AdapterLacksCapability", why.message)]
    assert "sglang" in why.message


# --- Sync modes --------------------------------------------------------------------------------------


def test_the_mode_registry_covers_exactly_the_api_modes() -> None:
    assert set(MODES) == set(get_args(SyncModeName))
    for name in MODES:
        assert make_mode(name).name == name
    assert P2PMode.catch_up and not BroadcastMode.catch_up
    with pytest.raises(LookupError, match="'ring' is not one of p2p, broadcast"):
        make_mode("ring")


class RecordingPeers:
    """A fake of what the coordinator offers a mode: records who was asked for what."""

    def __init__(self) -> None:
        self.own_sources = SourceAgent("g", [0], make_transport=lambda: None, replica_root=lambda r: Path("/x"))  # type: ignore[arg-type,return-value]
        self.host = "127.0.0.1"
        self.call_timeout = 1.0
        self.asked: list[tuple[int, RoundScope]] = []
        self.told: list[tuple[int, int]] = []

    def source(self, plan: Plan, rank: int, scope: RoundScope) -> SourceControl:
        self.asked.append((rank, scope))

        class Quiet:
            source = rank

            def prepare(self, version: int, deadline: float) -> SourceReport:
                return SourceReport(source=rank, ok=True)

            def publish(self, version: int, deadline: float) -> SourceReport:
                return SourceReport(source=rank, ok=True)

        return Quiet()

    def tell_committed(self, plan: Plan, rank: int, version: int) -> None:
        self.told.append((rank, version))

    def engines(self, plan: Plan, which: Collection[int]) -> dict[int, EngineAdapter]:
        return {}


TEMPLATE = {"spec": {"containers": [{"name": "main", "image": "x"}]}}


def _plan(mode: str) -> Plan:
    spec = WeightSyncGroupSpec.model_validate({
        "trainer": {"replicas": 3, "template": TEMPLATE},
        "inference": {"engines": 3, "ranksPerEngine": 2, "ranksPerPod": 2, "adapter": "reference",
                      "template": TEMPLATE},
        "transfer": {"mode": mode},
    })  # fmt: skip
    return plan_for(spec, group="g")


class PlacedEngine:
    """An engine adapter as far as p2p's round pins it: the manifest it publishes now."""

    def __init__(self, engine: int) -> None:
        self.engine = engine
        self.asked: list[int] = []

    def manifest(self, rank: int) -> SimpleNamespace:
        self.asked.append(rank)
        return SimpleNamespace(placement=f"at-{self.engine}-{rank}")


def test_p2p_asks_only_the_sources_whose_targets_the_round_covers_and_pins_where_those_live() -> None:
    plan, peers = _plan("p2p"), RecordingPeers()
    engines = {e: PlacedEngine(e) for e in range(plan.layout.engines)}
    everyone = P2PMode().round_sources(peers, plan, engines, RoundScope.of(plan.hash))  # type: ignore[arg-type]
    assert set(everyone) == {a.source for a in plan.sources}
    peers.asked.clear()
    joiner = 2
    scope = RoundScope.of(plan.hash, [joiner], catch_up=True)
    some = P2PMode().round_sources(peers, plan, {joiner: engines[joiner]}, scope)  # type: ignore[dict-item]
    assert set(some) == {a.source for a in plan.sources if any(t[0] == joiner for t in a.targets)}
    pinned = {(joiner, r): f"at-{joiner}-{r}" for r in range(plan.layout.ranks_per_engine)}
    want = RoundScope.of(plan.hash, [joiner], catch_up=True, placements=pinned)
    assert all(asked == want for _, asked in peers.asked)
    assert sorted(engines[joiner].asked) == [0, 0, 1, 1] and engines[0].asked == [0, 1]  # once per round
    P2PMode().committed(peers, plan, 7)
    assert sorted(peers.told) == [(a.source, 7) for a in plan.sources]


def test_broadcast_rounds_cover_every_engine_and_never_catch_up() -> None:
    plan, peers = _plan("broadcast"), RecordingPeers()
    with pytest.raises(SourceConfigError, match="joining engines get the next version"):
        BroadcastMode().round_sources(peers, plan, {}, RoundScope.of(plan.hash, [1], catch_up=True))
    view = BroadcastMode().round_plan(plan)
    assert [a.source for a in view.sources if a.targets] == [0]


def test_round_scope_is_one_value() -> None:
    scope = RoundScope.of("h", [2, 1])
    assert scope == RoundScope("h", frozenset({1, 2}), False)
    assert scope.covers(1) and not scope.covers(0) and RoundScope.of("h").covers(99)


# --- No branch on a mode or an adapter outside the seams ---------------------------------------------


def _branches(tree: ast.AST, attribute: str, owner: str) -> list[int]:
    """Lines comparing ``<...>.<owner>.<attribute>`` with something (``plan.transfer.mode == "p2p"``)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if (
                    isinstance(side, ast.Attribute)
                    and side.attr == attribute
                    and isinstance(side.value, ast.Attribute)
                    and side.value.attr == owner
                ):
                    lines.append(node.lineno)
    return lines


@pytest.mark.parametrize(("attribute", "owner", "allowed"), [
    ("mode", "transfer", {"modes"}),  # the registries compare names; the modes are the implementations
    ("adapter", "layout", {"targets"}),
])  # fmt: skip
def test_nothing_outside_the_seams_branches_on_the_mode_or_the_adapter(
    attribute: str, owner: str, allowed: set[str]
) -> None:
    offenders: Mapping[str, list[int]] = {
        str(path.relative_to(AGENT)): lines
        for path in AGENT.rglob("*.py")
        if path.relative_to(AGENT).parts[0] not in allowed
        and (lines := _branches(ast.parse(path.read_text()), attribute, owner))
    }
    assert not offenders, f"branches on {owner}.{attribute} outside {sorted(allowed)}: {offenders}"


def test_the_refusal_names_adapter_and_capability() -> None:
    assert refusal("reference", Request("broadcast", "staged", True)) is None
    assert refusal("sglang", Request("p2p", "live", True)) is None
    assert refusal("sglang", Request("broadcast", "live", True)) is None
    assert refusal("sglang", Request("broadcast", "staged", True)) == Refusal(
        "AdapterLacksCapability",
        "inference.adapter 'sglang' cannot do transfer.targetStaging 'staged' in transfer.mode 'broadcast' "
        "(it supports live)",
    )


class CountingDirectory:
    def __init__(self) -> None:
        self.agent_lookups = 0

    def engine_url(self, engine: int) -> str:
        return f"http://engine-{engine}"

    def trainer_url(self, pod: int) -> str:
        return f"http://trainer-{pod}"

    def engine_agent_url(self, engine: int) -> str:
        self.agent_lookups += 1
        return f"http://engine-agent-{engine}"


@pytest.mark.parametrize(("adapter", "lookups"), [("reference", 0), ("sglang", 1)])
def test_only_kinds_whose_agent_assembles_manifests_look_that_agent_up(adapter: str, lookups: int) -> None:
    plan = plan_for(WeightSyncGroupSpec.model_validate({
        "trainer": {"replicas": 1, "template": TEMPLATE},
        "inference": {"engines": 1, "adapter": adapter, "template": TEMPLATE},
    }), group="g")  # fmt: skip
    directory = CountingDirectory()
    settings = settings_for(plan, 0, directory, call_timeout=1.0)
    assert directory.agent_lookups == lookups
    assert settings.agent_url == ("http://engine-agent-0" if lookups else None)
    assert settings_for(plan, 0, directory, call_timeout=1.0, engine_side=True).agent_url is None
    assert directory.agent_lookups == lookups  # the engine's own pod never looks itself up


# --- Broadcast reception: how each kind takes a round, declared by its adapter -----------------------


def test_every_broadcast_capable_adapter_says_how_it_takes_rounds() -> None:
    capable = {kind for kind in ADAPTERS if "broadcast" in (ENGINE_KINDS[kind].capabilities.modes)}  # type: ignore[index,union-attr]
    assert capable == {"reference", "sglang", "vllm"}
    broadcasting = {kind: resolve(MODE_ADAPTERS.get((kind, "broadcast", "live"), ADAPTERS[kind])) for kind in capable}
    for adapter in broadcasting.values():
        assert adapter.broadcast.receivers in ("engine", "rank")
    assert broadcasting["reference"].broadcast == BroadcastReception("engine", "weightsync-buckets")
    # Stock SGLang: every TP rank joins through /init_weights_update_group and receives full HF tensors.
    assert broadcasting["sglang"].broadcast == BroadcastReception("rank", "announced-tensors")
    # Stock vLLM: every TP rank joins its nccl backend from an NCCL unique id and receives full HF tensors.
    assert broadcasting["vllm"].broadcast == BroadcastReception("rank", "announced-tensors", "nccl-unique-id")


def test_vllm_takes_each_mode_and_staging_through_its_own_adapter() -> None:
    variants = (
        ("p2p", "staged", VllmAdapter),
        ("p2p", "live", VllmLiveAdapter),
        ("broadcast", "live", VllmNcclAdapter),
    )
    for mode, staging, kind in variants:
        made = make_adapter("vllm", replace(SETTINGS, mode=mode, staging=staging))  # type: ignore[arg-type]
        assert type(made) is kind, (mode, staging)
    assert VllmAdapter.placement == "buffer" and VllmLiveAdapter.placement == "parameters"
    assert make_adapter("sglang", replace(SETTINGS, mode="broadcast")).kind == "sglang"


def test_sglang_joins_only_as_one_consecutive_group_rank_per_tp_rank() -> None:
    adapter = make_adapter("sglang", SETTINGS)  # ranks=2; nothing listens at its URL: refused before any call
    per_engine = [{"group_rank": 1, "ranks": [0, 1]}]
    with pytest.raises(HttpCallError, match="one group rank per TP rank"):
        adapter.join_broadcast("tcp://127.0.0.1:9", 2, per_engine, "gloo", 1.0, "g")
    with pytest.raises(HttpCallError, match="tcp://HOST:PORT"):
        adapter.join_broadcast("file:///tmp/x", 3, [], "gloo", 1.0, "g")


def test_broadcast_checksums_follow_the_scheme_each_manifest_names() -> None:
    full = {"w": torch.arange(24, dtype=torch.float32).reshape(6, 4)}
    part = ShardPart(source="w", full_shape=(6, 4), dim=0, start=3, length=3)
    entry = TensorEntry(name="w", dtype="float32", shape=(3, 4), address=4096, nbytes=48, parts=(part,))
    region = (Region(address=4096, nbytes=48),)
    sglang = Manifest(engine=0, rank=1, session_id="s", tensors=(entry,), regions=region, checksum="tensor-sha256-8")
    reference = sglang.model_copy(update={"checksum": "bucket-xxh3"})
    cut = full["w"][3:].contiguous().numpy().tobytes()
    assert target_checksums(sglang, full, 1 << 20) == [hashlib.sha256(cut).digest()[:8].hex()]
    assert target_checksums(reference, full, 1 << 20) == [xxhash.xxh3_64(cut).hexdigest()]


class HeldVersionAdapter:
    """Just what an engine pod's readiness asks of its adapter: it answers, and the version it holds."""

    def __init__(self, held: str) -> None:
        self.held = held

    def readiness(self) -> Readiness:
        return Readiness(True, "EngineServing", "answers")

    def held_version(self, timeout: float | None = None) -> str:
        return self.held


def test_an_engine_behind_the_committed_version_is_not_ready_until_caught_up() -> None:
    said: list[tuple[bool, str, str]] = []
    adapter = HeldVersionAdapter("default")  # restarted on its initial weights
    committed: list[int | None] = [7]
    agent = EngineAgent(
        "g", "http://e", adapter, advertise=True,  # type: ignore[arg-type]
        set_ready=lambda *a: said.append(a), committed=lambda: committed[0], committed_every=0,
    )  # fmt: skip
    assert not agent.check().ready and said[-1][1] == "CatchingUp" and "committed 7" in said[-1][2]
    adapter.held = "6"
    assert not agent.check().ready
    adapter.held = "7"  # the catch-up landed
    assert agent.check().ready and said[-1][:2] == (True, "EngineServing")
    committed[0] = 8  # a round the engine missed (it must not happen, but if it does, it says so)
    adapter.held = "7"
    assert not agent.check().ready


def test_readiness_is_not_held_back_when_nothing_is_known() -> None:
    def unreachable() -> int | None:
        raise LookupError("coordinator not up")

    fresh = EngineAgent("g", "http://e", HeldVersionAdapter("default"), advertise=True,  # type: ignore[arg-type]
                        committed=lambda: None, committed_every=0)  # fmt: skip
    assert fresh.check().ready  # a group that never committed: the initial weights are the version
    lost = EngineAgent("g", "http://e", HeldVersionAdapter("default"), advertise=True,  # type: ignore[arg-type]
                       committed=unreachable, committed_every=0)  # fmt: skip
    assert lost.check().ready


def test_the_last_known_committed_version_holds_while_the_coordinator_is_away() -> None:
    answers: list[object] = [5]

    def committed() -> int | None:
        answer = answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[return-value]

    adapter = HeldVersionAdapter("5")
    agent = EngineAgent("g", "http://e", adapter, advertise=True, committed=committed,  # type: ignore[arg-type]
                        committed_every=0)  # fmt: skip
    assert agent.check().ready
    answers[0] = LookupError("trainer pod 0 restarting")
    adapter.held = "default"  # this engine restarted meanwhile
    assert not agent.check().ready  # still known: 5 was committed
