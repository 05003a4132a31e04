"""Rotating the group's token under a running group (docs/security.md, "Rotating the token"), real processes.

A loopback group (two trainer agents, two reference engines, Mooncake over TCP) whose agents read the
credential from files, as from the Secret volume a kubelet refreshes; the engines hold their admin key from start,
as stock SGLang does. The rotation is replayed as a cluster would see it:

1. the Secret changes (``token`` new, ``previous`` the old one), but only one agent's kubelet refreshed so far;
2. every agent's files are refreshed; both engines still run with the old key (the agents fall back to it);
3. the engines are restarted one at a time with the new key, the agents never (the coordinator catches each up);
4. ``previous`` is dropped (``--finish``).

A round is published at every step and must land on both engines; no agent process restarts; after step 4 the
old token is refused by every agent and engine. A control shows the window is what makes it work: an engine
still on the old key after ``--finish`` can no longer be synced.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from weightsync.api.token import new_token
from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_agent.client import WeightSyncClient
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.reference_engine.model import full_state
from weightsync_testing.trainer_ranks import publish_all

TEMPLATE = {"spec": {"containers": [{"name": "main"}]}}
#: The agents' tick (LoopbackGroup): each re-reads its files at least this often.
TICK = 0.5


def call(url: str, method: str, *, token: str, body: Any = None) -> tuple[int, Any]:
    data = None if method == "GET" else json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Authorization": f"Bearer {token}"})
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def assert_refused(status: int, body: Any, what: str) -> None:
    assert status == 401 and "credential" in body["error"]["message"], f"{what}: HTTP {status} {body!r}"


def spec() -> WeightSyncGroupSpec:
    return WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": 2, "template": TEMPLATE},
            "inference": {
                "engines": 2,
                "ranksPerEngine": 1,
                "ranksPerPod": 1,
                "adapter": "reference",
                "template": TEMPLATE,
            },
            # The rounds that must fail here fail on a 401, not on the budget: room for a round that refetches a
            # restarted engine's manifests while the suite's other worker loads the machine (20 s was too short).
            "transfer": {"protocol": "tcp", "bucketSizeMiB": 1, "timeoutSeconds": 60},
        }
    )


@pytest.fixture(scope="module")
def group() -> Iterator[LoopbackGroup]:
    with LoopbackGroup(spec(), group="rot", mounted_credentials=True).start() as running:
        yield running


@pytest.fixture(scope="module")
def clients(group: LoopbackGroup) -> Iterator[list[WeightSyncClient]]:
    with group.clients() as made:
        yield made


def publish(clients: list[WeightSyncClient], version: int) -> dict[str, torch.Tensor]:
    full = {name: t + 0.01 * version for name, t in full_state(seed=3).items()}
    for outcome in publish_all(clients, full, version):
        assert getattr(outcome, "ok", False), f"v{version}: {outcome}"
    return full


def assert_engines_hold(group: LoopbackGroup, version: int) -> None:
    for engine, started in group.engines.items():
        status = started.client().status()  # with the key that engine runs with
        assert status["weight_version"] == str(version), (engine, status)
        assert not status["paused"] and not status["live_dirty"], (engine, status)


def wait_engine_caught_up(group: LoopbackGroup, engine: int, version: int | None, timeout: float = 60.0) -> None:
    """Until engine ``engine`` serves ``version`` unpaused (None: until it answers at all)."""
    deadline = time.monotonic() + timeout
    while True:
        status: dict[str, Any] = {}
        with contextlib.suppress(Exception):  # still starting
            status = group.engines[engine].client(timeout=5).status()
        if status and (version is None or status.get("weight_version") == str(version)) and not status.get("paused"):
            return
        assert time.monotonic() < deadline, (
            f"engine {engine} not caught up to v{version}: {status}\n{group.agents[0].log_text()[-5000:]}"
        )
        time.sleep(0.2)


def test_a_rotation_keeps_rounds_landing_without_restarting_agents(
    group: LoopbackGroup, clients: list[WeightSyncClient]
) -> None:
    pids = {name: agent.process.pid for name, agent in group.agents.items()}
    old = group.token
    publish(clients, 1)
    assert_engines_hold(group, 1)

    # 1. The Secret rotated; only trainer pod 0's kubelet (the coordinator's) refreshed its volume so far.
    new = new_token()
    group.write_credentials(new, old, agents=["agent-0"])
    time.sleep(2 * TICK)
    publish(clients, 2)  # the coordinator sends `new`, agent 1 knows only `old`: each falls back once
    assert_engines_hold(group, 2)

    # 2. Every agent refreshed; both engines still have the old key: paused, written, verified and committed
    # through the fallback to `previous`.
    group.write_credentials(new, old)
    time.sleep(2 * TICK)
    publish(clients, 3)
    assert_engines_hold(group, 3)
    for agent in group.agents.values():
        assert call(agent.url + "/v1/state", "GET", token=old)[0] == 200  # the window: both accepted
        assert call(agent.url + "/v1/state", "GET", token=new)[0] == 200
    logs = group.agents[0].log_text()
    assert "accepted the previous one" in logs, logs[-3000:]

    # 3. Rolling restart of the engine pods, one at a time, with the new key; the trainers keep running.
    for engine in sorted(group.engines):
        group.restart_engine(engine, token=new)
        wait_engine_caught_up(group, engine, 3)
        assert_refused(*call(group.engines[engine].url + "/pause_generation", "POST", token=old, body={}), "old key")
    publish(clients, 4)
    assert_engines_hold(group, 4)

    # 4. --finish: `previous` dropped. The old token is refused everywhere; rounds still land.
    group.write_credentials(new)
    time.sleep(2 * TICK)
    for agent in group.agents.values():
        assert_refused(*call(agent.url + "/v1/state", "GET", token=old), "old token after --finish")
        assert call(agent.url + "/v1/state", "GET", token=new)[0] == 200
    for started in group.engines.values():
        assert_refused(*call(started.url + "/weightsync/status", "GET", token=old), "old token on an engine")
    publish(clients, 5)
    assert_engines_hold(group, 5)
    # No agent restarted through all of it.
    assert {name: agent.process.pid for name, agent in group.agents.items()} == pids
    assert all(agent.process.poll() is None for agent in group.agents.values())


def test_finishing_before_an_engine_restarted_locks_it_out(
    group: LoopbackGroup, clients: list[WeightSyncClient]
) -> None:
    """The control: without the window (``--finish`` while engine 1 still runs with the old key), that engine can
    no longer be synced: the round fails and engine 1 keeps serving its last version. What ``rotate-token --finish``
    refuses to do while an engine pod predates the rotation."""
    old = group.token
    new = new_token()
    group.write_credentials(new, old)
    group.restart_engine(0, token=new)
    wait_engine_caught_up(group, 0, 5)
    group.write_credentials(new)  # finished too early: engine 1 still has `old`
    time.sleep(2 * TICK)
    outcomes = publish_all(clients, full_state(seed=9), 6, timeout=120)
    assert not any(getattr(outcome, "ok", False) for outcome in outcomes), outcomes
    assert group.engines[1].client().status()["weight_version"] == "5"
    # Restarting it with the new key repairs the group: the trainers staged v6 already, so it joins at the next
    # round (a catch-up serves only the committed version, which the replicas no longer hold).
    group.restart_engine(1, token=new)
    wait_engine_caught_up(group, 1, None)
    # Its sources learn its new addresses from the first round, which writes nothing (issue 11 item 5 is about
    # making that round succeed; not this file's subject): allowed to fail that way only, then rounds land.
    for outcome in publish_all(clients, full_state(seed=9), 7):
        assert getattr(outcome, "ok", False) or "nothing written, the manifests are refetched" in str(outcome)
    time.sleep(4 * TICK)  # the agents' next ticks refetch
    publish(clients, 8)
    assert_engines_hold(group, 8)
