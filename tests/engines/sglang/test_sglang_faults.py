"""Faults and joins against the STOCK SGLang server, through real agents (TP=1, CPU, Mooncake TCP).

- A foreign writer keeps scribbling into one of SGLang's live parameters during a round: SGLang's own
  ``/weights_checker`` disagrees with the trainer's hash, the round fails naming the parameter, the engine
  is never relabelled, and once the writer stops the next round repairs it.
- A weight-update session left open (as after a crashed coordinator) does not wedge later rounds.
- A joining SGLang engine is caught up from the replicas to the committed version without a new publish.
- SGLang killed mid-round (SIGKILL, at verification) fails the round; restarted on its ports (new addresses, new
  Mooncake session) it is never written at the old ones and is caught up to the committed version.
- SGLang hung mid-round (SIGSTOP, at verification) fails the round within its budget; after SIGCONT the next
  round lands.
"""

from __future__ import annotations

import hashlib
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
from sglang_helpers import ROUND_PROMPTS, assert_generates_like_hf, engine_generate
from test_sglang_rounds import spec

from weightsync_agent.client.trainer import WeightSyncClient
from weightsync_agent.rounds.remote import AgentClient
from weightsync_agent.targets.engine_client import EngineClient, TransferEngineInfo
from weightsync_testing.agent_metrics import metric
from weightsync_testing.engine_harness import SglangEngines
from weightsync_testing.foreign_write import ForeignWriter
from weightsync_testing.http_gate import GatedEngines, publish_with_fault
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.sglang_models import trained_state
from weightsync_testing.trainer_ranks import publish_all

TARGET = "model.norm.weight"
#: ``timeoutSeconds`` of the kill and hang tests: the round budget and the per-peer stall (writes to a killed
#: or stopped SGLang fail only once they have stalled that long).
FAULT_TIMEOUT = 10
#: How long a trainer rank waits for a faulted round's result (the default, the round budget from its own call, is
#: shorter than a failing round: budget, then the other sources settle).
WAIT = 60.0


class GatedSglangEngines(GatedEngines, SglangEngines):
    """SGLang engines reached through a :class:`Gate` each (the same gate across restarts)."""


def sglang_checksums(full: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """What SGLang's ``/weights_checker`` must answer at TP=1 for the trainer's HF tensors ``full``: sha256[:8] of
    every parameter, with q, k, v fused into ``qkv_proj`` and gate, up into ``gate_up_proj``."""
    fused: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        for parts, into in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
            if f".{parts[0]}." in name:
                fused[name.replace(parts[0], into)] = torch.cat([full[name.replace(parts[0], p)] for p in parts])
        if not any(f".{p}." in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            fused[name] = tensor
    return {name: hashlib.sha256(t.contiguous().numpy().tobytes()).digest()[:8].hex() for name, t in fused.items()}


def engine_checksums(engine: EngineClient) -> dict[str, str]:
    """SGLang's own checksums of its live weights (TP=1: one rank)."""
    _, answer = engine.request("POST", "/weights_checker", body={"action": "checksum"}, timeout=60)
    (rank,) = answer["ranks"]
    return {str(k): str(v) for k, v in rank["checksums"].items()}


def assert_holds(engine: EngineClient, full: Mapping[str, torch.Tensor], version: str) -> None:
    assert engine.weight_version() == version
    held, want = engine_checksums(engine), sglang_checksums(full)
    assert len(want) == 15 and {n: held.get(n) for n in want} == want


def publish_with_fault_at_verify(
    group: LoopbackGroup, clients: list[WeightSyncClient], full: Mapping[str, torch.Tensor], version: int,
    fault: signal.Signals,
) -> tuple[object, float]:  # fmt: skip
    """Round ``version`` with the engine faulted mid-round: SGLang is paused, its weight-update session open and the
    sources' writes done when the coordinator asks ``/weights_checker``; the gate holds that call, every SGLang
    process gets ``fault``, and the call goes on. Returns the round's outcome (every rank's is the same) and the
    seconds from the fault to the outcome."""
    harness = group.harness
    assert isinstance(harness, GatedSglangEngines)
    return publish_with_fault(clients, full, version, gate=harness.gates[0], route="/weights_checker",
                              fault=lambda: harness.signal(0, fault), wait=WAIT)  # fmt: skip


@pytest.fixture
def group(request: pytest.FixtureRequest, sglang_py: Path, tiny_llama: Path, tmp_path: Path) -> Iterator[LoopbackGroup]:
    """One TP=1 SGLang engine behind a :class:`Gate`; ``param``: ``{"trainers": 2, "timeout": 60}`` (trainer ranks,
    ``timeoutSeconds``)."""
    options = {"trainers": 2, "timeout": 60, **getattr(request, "param", {})}
    harness = GatedSglangEngines(tiny_llama, python=str(sglang_py), dtype="float32", log_dir=tmp_path / "sglang")
    try:
        with LoopbackGroup(spec(1, **options), group="sg-faults", engines=harness) as running:
            running.start(timeout=300)
            yield running
    finally:
        harness.close_gates()


@pytest.fixture(scope="module")
def faulted(sglang_py: Path, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackGroup]:
    """The kill and hang tests' group (``timeoutSeconds: 10``), shared: each test starts from the version the
    coordinator committed last and ends with a round that lands, so the next one finds a serving engine (one start
    of the group instead of two: ~45 s on the 2-core machine)."""
    harness = GatedSglangEngines(tiny_llama, python=str(sglang_py), dtype="float32",
                                 log_dir=tmp_path_factory.mktemp("sglang-faulted"))  # fmt: skip
    try:
        with LoopbackGroup(spec(1, trainers=2, timeout=FAULT_TIMEOUT), group="sg-faulted", engines=harness) as running:
            running.start(timeout=300)
            yield running
    finally:
        harness.close_gates()


def foreign_writer(engine: EngineClient, name: str) -> ForeignWriter:
    """A :class:`ForeignWriter` over one published SGLang parameter. Where to write is read with the group's
    credential (SGLang's admin key guards the route); Mooncake's data port itself takes no credential yet
    (docs/security.md)."""
    info = engine.transfer_engine_info(0)
    address, numel, size = (int(v) for v in info.weights_info[name])
    return ForeignWriter(info.session_id, address, numel * size)


class Load:
    """A client that keeps asking SGLang to generate, recording every answer's weight version or error."""

    def __init__(self, engine_url: str) -> None:
        from weightsync_agent.targets.engine_client import EngineClient

        self.engine = EngineClient(engine_url, timeout=300)
        self.versions: list[str] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                prompt = ROUND_PROMPTS[len(self.versions) % len(ROUND_PROMPTS)]
                self.versions.append(engine_generate(self.engine, prompt)[1])
            except Exception as exc:  # recorded: the test asserts there is none
                self.errors.append(repr(exc))

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(300)


@pytest.mark.parametrize("group", [{"trainers": 2, "scrub": 1}], indirect=True)
def test_a_foreign_write_between_rounds_is_found_by_a_scrub_and_repaired_without_a_new_version(
    group: LoopbackGroup, tiny_llama: Path
) -> None:
    """Stock SGLang's weights take Mooncake writes at any time: one lands between rounds. Within a scrub period
    SGLang's own ``/weights_checker`` shows it to the coordinator, which names the parameter and repairs the engine
    from the replicas by a catch-up of the committed version (no new version); SGLang holds the trainer's bytes
    again. Measured here too: what one scrub of this engine costs."""
    clients = [group.client(rank) for rank in range(2)]
    engine = group.engines[0].client(timeout=60)
    coordinator = group.agents[0].url
    try:
        one = trained_state(tiny_llama, 1)
        assert all(getattr(o, "ok", False) for o in publish_all(clients, one, 1))
        assert_holds(engine, one, "1")
        with foreign_writer(group.engines[0].client(timeout=10), TARGET) as writer:
            assert writer.write(), "the foreign write failed"  # one write, between rounds

        started = time.monotonic()
        end = started + 30
        while metric(coordinator, "weightsync_agent_rounds_total", kind="catch-up", result="Succeeded") < 1:
            assert time.monotonic() < end, "no scrub repaired the engine in 30 s: " + group.agents[0].log_text()[-2000:]
            time.sleep(0.1)
        repaired = time.monotonic() - started
        scrubs = metric(coordinator, "weightsync_agent_scrub_seconds_count")
        spent = metric(coordinator, "weightsync_agent_scrub_seconds_sum")
        checked = sum(t.numel() * t.element_size() for t in one.values())
        print(
            f"\nfound and repaired {repaired:.2f} s after the write (scrub period 1 s); a scrub of "
            f"{checked / 1e6:.1f} MB took {spent / scrubs * 1e3:.0f} ms on average over {scrubs:.0f}"
        )  # docs
        # The write landed (a scrub saw it; the scrubs before it saw none), and the repair undid it.
        assert metric(coordinator, "weightsync_agent_scrubs_total", result="drift") == 1
        assert_holds(engine, one, "1")  # the same version, the trainer's bytes again
        two = trained_state(tiny_llama, 2)
        assert all(getattr(o, "ok", False) for o in publish_all(clients, two, 2))  # and rounds go on
        assert_holds(engine, two, "2")
    finally:
        for client in clients:
            client.close()


def test_a_foreign_write_fails_verification_naming_the_parameter_and_the_next_round_repairs(
    group: LoopbackGroup, sglang_py: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    """Under a steady /generate load, a foreign write lands between a round's writes and its verification: the round
    fails naming the parameter, no request errors or is lost across pauses, and every answer carries a committed
    version, never the label of a partly written engine; the next round repairs."""
    clients = [group.client(rank) for rank in range(2)]
    harness = group.harness
    assert isinstance(harness, GatedSglangEngines)
    gate = harness.gates[0]
    engine = group.engines[0].client(timeout=60)
    try:
        with Load(group.engines[0].url) as load:
            first = publish_all(clients, trained_state(tiny_llama, 1), 1)
            assert all(getattr(o, "ok", False) for o in first), [getattr(o, "summary", o.__str__)() for o in first]
            with foreign_writer(group.engines[0].client(timeout=10), TARGET) as writer:
                # After the round's own writes, before SGLang is asked for its checksums: not a race the round
                # may win on a busy machine (it did, on CI, with a writer looping in a thread).
                gate.before("/weights_checker", writer.write)
                try:
                    outcomes = publish_all(clients, trained_state(tiny_llama, 2), 2)
                finally:
                    gate.before("/weights_checker", None)
                assert writer.writes > 0
            held_after_failure = engine.weight_version()
            repaired = publish_all(clients, trained_state(tiny_llama, 3), 3)
            time.sleep(1.0)  # a few answers after the repair
        assert not load.errors, load.errors[:3]
        assert load.versions and set(load.versions) <= {"default", "1", "3"}, sorted(set(load.versions))
        assert "3" in load.versions
        assert all(getattr(o, "ok", False) for o in repaired), "the next round repairs"
        failed = outcomes[0]
        assert not getattr(failed, "ok", True), failed
        said = failed.summary()  # type: ignore[attr-defined]
        assert "failed verification of version 2" in said and TARGET in said, said
        assert held_after_failure == "1"  # never relabelled to a version it does not hold

        full = trained_state(tiny_llama, 3)
        assert engine.weight_version() == "3"
        assert_generates_like_hf(engine, sglang_py, tiny_llama, full, 3, tmp_path)
    finally:
        for client in clients:
            client.close()


# One trainer rank: the joiner's target goes to a source whose replica already holds the committed version
# (a rank that held none has nothing to catch up from; its joiner gets the next version).
@pytest.mark.parametrize("group", [{"trainers": 1}], indirect=True)
def test_a_session_left_open_does_not_wedge_rounds_and_a_joiner_catches_up(
    group: LoopbackGroup, sglang_py: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    clients = [group.client(rank) for rank in range(group.spec.trainer.replicas)]
    engine = group.engines[0].client(timeout=60)
    try:
        # A coordinator that died mid-round leaves SGLang's weight-update session open.
        engine.request("POST", "/begin_weight_update", body={}, timeout=30)
        full = trained_state(tiny_llama, 1)
        outcomes = publish_all(clients, full, 1)
        assert all(getattr(o, "ok", False) for o in outcomes), [str(o) for o in outcomes]
        assert engine.weight_version() == "1"

        # A second SGLang engine joins (the operator's replan, by hand): the coordinator brings it to
        # version 1 from the replicas; nobody publishes again.
        plan = group.scale_engines(2)
        group.wait_built(240, plan_hash=plan.hash)
        joiner = group.engines[1].client(timeout=60)
        deadline = time.monotonic() + 180
        while joiner.weight_version() != "1":
            assert time.monotonic() < deadline, f"joiner still at {joiner.weight_version()}"
            time.sleep(1)
        assert engine.weight_version() == "1"
        assert_generates_like_hf(joiner, sglang_py, tiny_llama, full, 1, tmp_path)
    finally:
        for client in clients:
            client.close()


def test_a_target_killed_mid_round_fails_it_and_once_restarted_it_is_caught_up(
    faulted: LoopbackGroup, tiny_llama: Path
) -> None:
    """SIGKILL mid-round (while the coordinator asks ``/weights_checker``): the round fails within its budget and
    nobody claims the version. The restarted SGLang (same ports, ``default`` version, new session and addresses)
    is never written at its predecessor's addresses (the sources refuse their stale manifests and refetch), and
    the next round lands, verified by SGLang's own checksums. Killed again between rounds, the restarted engine is
    caught up to the committed version without a publish."""
    group = faulted
    clients = [group.client(rank) for rank in range(2)]
    engine = group.engines[0].client(timeout=30)
    try:
        base = group.committed()
        v1 = trained_state(tiny_llama, base + 1)
        assert all(getattr(o, "ok", False) for o in publish_all(clients, v1, base + 1))
        before = engine.transfer_engine_info(0)

        outcome, took = publish_with_fault_at_verify(group, clients, trained_state(tiny_llama, base + 2), base + 2,
                                                     signal.SIGKILL)  # fmt: skip
        assert not getattr(outcome, "ok", True), outcome
        said = outcome.summary()  # type: ignore[attr-defined]
        assert f"round v{base + 2}: Failed" in said and ("engine 0" in said or "source 0" in said), said
        print(f"\nkilled at verification: {said} ({took:.1f} s after the kill)")
        budget = group.plan.transfer.timeouts.round_budget
        assert took < budget + 12, f"the round took {took:.1f} s after the kill (budget {budget} s): {said}"
        assert group.committed() == base + 1

        # Restarted on its ports: SGLang's checkpoint at new addresses behind a new session. The replicas hold v2
        # (staged for the failed round), not the committed v1, so no catch-up is possible: the next round repairs.
        restarted = restart_and_check_no_stale_write(group, before, seconds=5)
        v3 = trained_state(tiny_llama, base + 3)
        outcomes = publish_all(clients, v3, base + 3)
        assert all(getattr(o, "ok", False) for o in outcomes), [str(o) for o in outcomes]
        assert_holds(engine, v3, str(base + 3))

        # Killed between rounds: the replicas hold the committed v3, and the coordinator catches it up.
        restart_and_check_no_stale_write(group, restarted, until=str(base + 3))  # "default" until it holds v3
        assert_holds(engine, v3, str(base + 3))
    finally:
        for client in clients:
            client.close()


def restart_and_check_no_stale_write(
    group: LoopbackGroup, before: TransferEngineInfo, *, seconds: float = 0.0, until: str | None = None
) -> TransferEngineInfo:
    """Crash and restart engine 0 on its ports; watch its version for ``seconds`` (or ``until`` it reports that
    version), then check that no source wrote the dead process's session or addresses."""
    logs = {name: len(agent.log_text()) for name, agent in group.agents.items()}
    group.restart_engine(0)
    engine = group.engines[0].client(timeout=30)
    after = engine.transfer_engine_info(0)
    first = engine.weight_version()
    # Fresh, or already caught up: the coordinator's catch-up may land between the server answering and this look.
    assert first == "default" or (until is not None and first == until), first
    assert after.weights_info != before.weights_info, "the fresh engine should hold its weights elsewhere"
    seen: set[str | None] = set()
    deadline = time.monotonic() + (seconds or 120)
    while (version := engine.weight_version()) != until:
        seen.add(version)
        if time.monotonic() > deadline:
            assert until is None, f"the restarted engine is still at {version}"
            break
        time.sleep(0.2)
    assert seen <= {"default"}, seen  # never relabelled
    fresh = "".join(agent.log_text()[logs[name] :] for name, agent in group.agents.items())
    assert "publishes its weights elsewhere than this source's manifest" in fresh, fresh[-3000:]
    if before.session_id != after.session_id:  # a write there would have failed naming it: "… (<session>), bucket"
        assert f"({before.session_id}), bucket" not in fresh, fresh[-3000:]
    server = group.harness.servers[0]  # type: ignore[attr-defined]
    assert "not within any registered buffer" not in server.log_tail(2000)
    return after


def test_a_hung_target_fails_the_round_within_its_timeouts_and_after_sigcont_the_next_round_lands(
    faulted: LoopbackGroup, tiny_llama: Path
) -> None:
    """SIGSTOP mid-round (every SGLang process, while the coordinator asks ``/weights_checker``): the verify call
    and the retry's writes hang, the round fails within its budget (``timeoutSeconds: 10``: round budget and peer
    stall) instead of hanging, nobody claims the version, and once SGLang runs again (SIGCONT) the next round
    lands."""
    group = faulted
    clients = [group.client(rank) for rank in range(2)]
    engine = group.engines[0].client(timeout=30)
    coordinator = AgentClient(group.agents[0].url, timeout=10, token=group.token)
    harness = group.harness
    assert isinstance(harness, SglangEngines)
    try:
        base = group.committed()
        v1 = trained_state(tiny_llama, base + 1)
        assert all(getattr(o, "ok", False) for o in publish_all(clients, v1, base + 1))
        try:
            v2 = trained_state(tiny_llama, base + 2)
            outcome, took = publish_with_fault_at_verify(group, clients, v2, base + 2, signal.SIGSTOP)
            state = coordinator.state()
        finally:
            harness.signal(0, signal.SIGCONT)
        assert not getattr(outcome, "ok", True), outcome
        said = outcome.summary()  # type: ignore[attr-defined]
        assert f"round v{base + 2}: Failed" in said and ("engine 0" in said or "source 0" in said), said
        print(f"\nhung at verification: {said} ({took:.1f} s after the hang)")
        budget = group.plan.transfer.timeouts.round_budget
        assert took < budget + 12, f"the round took {took:.1f} s after the hang (budget {budget} s): {said}"
        assert state["committed"] == base + 1
        assert engine.weight_version() == str(base + 1)  # not relabelled

        v3 = trained_state(tiny_llama, base + 3)
        outcomes = publish_all(clients, v3, base + 3)
        assert all(getattr(o, "ok", False) for o in outcomes), [str(o) for o in outcomes]
        assert_holds(engine, v3, str(base + 3))
    finally:
        for client in clients:
            client.close()
