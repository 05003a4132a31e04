"""The group's credential against real processes: ``weightsync agent`` processes and reference engine processes.

A loopback group (two trainer agents, one reference engine of two TP ranks, Mooncake over TCP) started with a
group token, as the operator's Secret gives it. Checked:

* every route of the agents and of the reference engine, enumerated from their route tables (so a route added
  later is covered without touching this file), answers 401 in the one error shape without a token and with a
  wrong one, and does not answer 401 with the group's token; only the documented probes stay open;
* the pod-local trainer token opens ``/v1/publish`` and ``/v1/state`` of its own agent, and nothing else;
* the takeovers of issue 11, replayed by a process without the credential (pausing the engine, beginning v666,
  joining its broadcast group, committing, publishing and committing v10^15 through trainer rank 0's agent), all
  fail: the engine keeps serving the committed version, unpaused and clean, and the trainer's next publish lands.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_agent.client import WeightSyncClient
from weightsync_agent.config import trainer_token_file
from weightsync_agent.sidecar import routes as agent_routes
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.reference_engine import server as engine_server
from weightsync_testing.reference_engine.model import full_state
from weightsync_testing.trainer_ranks import publish_all

TEMPLATE = {"spec": {"containers": [{"name": "main"}]}}
TEN_TO_THE_15 = 10**15

#: The routes that stay open, and why (docs/security.md): probes, and on the engine what serving clients read.
AGENT_OPEN = {"/healthz", "/metrics"}
ENGINE_OPEN = {
    "/health",
    "/health_generate",
    "/model_info",
    "/get_model_info",
    "/weight_version",
    "/get_weight_version",
    "/server_info",
    "/get_server_info",
    "/generate",
}


def spec() -> WeightSyncGroupSpec:
    return WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": 2, "template": TEMPLATE},
            "inference": {
                "engines": 1,
                "ranksPerEngine": 2,
                "ranksPerPod": 2,
                "adapter": "reference",
                "template": TEMPLATE,
            },
            "transfer": {"protocol": "tcp", "bucketSizeMiB": 1, "timeoutSeconds": 20},
        }
    )


def route_table(app: Any) -> list[tuple[str, str]]:
    """(method, pattern) of every route an aiohttp app serves, HEAD (added for GETs) left out."""
    return sorted(
        {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD" and r.resource is not None}
    )


def agent_route_table() -> list[tuple[str, str]]:
    runtime = SimpleNamespace(token="x", trainer_token="y")
    return route_table(agent_routes.build_app(cast(Any, runtime)))


def engine_route_table() -> list[tuple[str, str]]:
    return route_table(engine_server.build_app(cast(Any, None), token="x"))


def concrete(pattern: str) -> str:
    """A request path for a route pattern: every ``{param}`` becomes 0."""
    return re.sub(r"\{[^}]+\}", "0", pattern)


def call(url: str, method: str, *, token: str | None = None, body: Any = None) -> tuple[int, Any]:
    data = None if method == "GET" else json.dumps([] if body is None else body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            status, raw = answer.status, answer.read()
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def assert_refused(status: int, body: Any, what: str) -> None:
    assert status == 401, f"{what}: HTTP {status} {body!r}"
    assert isinstance(body, dict) and set(body) == {"error"} and body["error"]["message"], f"{what}: {body!r}"
    assert "credential" in body["error"]["message"]


@pytest.fixture(scope="module")
def group() -> Iterator[LoopbackGroup]:
    with LoopbackGroup(spec(), group="sec").start() as running:
        yield running


@pytest.fixture(scope="module")
def clients(group: LoopbackGroup) -> Iterator[list[WeightSyncClient]]:
    with group.clients() as made:
        yield made


def test_the_route_tables_open_only_the_documented_probes() -> None:
    assert set(agent_routes.OPEN_ROUTES) == AGENT_OPEN
    assert set(engine_server.OPEN_ROUTES) == ENGINE_OPEN
    assert {p for _, p in agent_route_table()} >= AGENT_OPEN | {"/v1/publish", "/v1/engine/manifest"}
    assert {p for _, p in engine_route_table()} >= ENGINE_OPEN | {"/weightsync/commit", "/pause_generation"}


@pytest.mark.parametrize("who", ["agent", "engine"])
def test_every_guarded_route_refuses_without_the_credential_and_serves_with_it(group: LoopbackGroup, who: str) -> None:
    if who == "agent":
        bases, table, opened = [a.url for a in group.agents.values()], agent_route_table(), AGENT_OPEN
    else:
        bases, table, opened = [e.url for e in group.engines.values()], engine_route_table(), ENGINE_OPEN
    guarded = [(m, p) for m, p in table if p not in opened]
    assert len(guarded) >= (6 if who == "agent" else 15), guarded
    for base in bases:
        for method, pattern in guarded:
            url = base + concrete(pattern)
            for token in (None, "", "not-the-token", group.token + "x", group.token[:-1]):
                status, body = call(url, method, token=token)
                assert_refused(status, body, f"{method} {url} with token {token!r}")
            # A near miss in the scheme is no token either.
            request = urllib.request.Request(url, method="GET", headers={"Authorization": f"Basic {group.token}"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=10)
            assert refused.value.code == 401
            # With the group's credential the route itself answers (a bad body is its own 400, never a 401).
            status, body = call(url, method, token=group.token)
            assert status != 401, f"{method} {url} with the group's token: {status} {body!r}"
        # An unknown route asks for the credential before saying it does not exist.
        assert call(base + "/no/such/route", "GET")[0] == 401
        assert call(base + "/no/such/route", "GET", token=group.token)[0] == 404
        for pattern in opened:
            if ("GET", pattern) in table:
                status, _ = call(base + pattern, "GET")
                assert status == 200, f"open route {pattern}: {status}"


def test_the_trainer_token_opens_its_own_agents_publish_and_state_only(group: LoopbackGroup) -> None:
    tokens = {
        pod: trainer_token_file(agent.env["WEIGHTSYNC_REPLICA_PATH"]).read_text() for pod, agent in group.agents.items()
    }
    assert len(set(tokens.values())) == 2 and group.token not in tokens.values()
    for pod, agent in group.agents.items():
        folder = Path(agent.env["WEIGHTSYNC_REPLICA_PATH"])
        # Group-shared (trainer code may run as another user of the pod's group), never world-readable.
        assert trainer_token_file(folder).stat().st_mode & 0o777 == 0o640
        assert {path.stat().st_mode & 0o777 for path in folder.glob("*.replica")} == {0o660}
        own = tokens[pod]
        assert call(agent.url + "/v1/state", "GET", token=own)[0] == 200
        assert call(agent.url + "/v1/publish", "POST", token=own)[0] == 400  # authenticated: the body is wrong
        for method, pattern in agent_route_table():
            if pattern not in AGENT_OPEN | set(agent_routes.TRAINER_ROUTES):
                assert_refused(*call(agent.url + concrete(pattern), method, token=own), f"trainer token on {pattern}")
        other = tokens[1 - pod]
        assert_refused(*call(agent.url + "/v1/publish", "POST", token=other), "another pod's trainer token")
    for engine in group.engines.values():
        for token in tokens.values():
            assert_refused(*call(engine.url + "/pause_generation", "POST", token=token, body={}), "trainer token")


def engine_status(group: LoopbackGroup) -> dict[str, Any]:
    return group.engines[0].client().status()


def test_the_takeovers_of_issue_11_fail_and_the_engine_keeps_serving(
    group: LoopbackGroup, clients: list[WeightSyncClient]
) -> None:
    full = full_state(seed=5)
    for outcome in publish_all(clients, full, 1):
        assert getattr(outcome, "ok", False), outcome
    before = engine_status(group)
    assert before["weight_version"] == "1" and not before["paused"] and not before["live_dirty"]

    engine = group.engines[0].url
    rank0 = group.agents[0].url
    rank1 = group.agents[1].url
    for token in (None, "guess"):
        # The gloo hijack: pause, begin v666, join a broadcast group of the attacker's, receive, verify, commit.
        for route, body in [
            ("/pause_generation", {"mode": "abort"}),
            ("/weightsync/begin", {"version": "666", "verify": False}),
            ("/weightsync/broadcast", {"init_method": "tcp://127.0.0.1:1", "world_size": 2,
                                       "members": [{"group_rank": 1, "ranks": [0, 1]}], "timeout_seconds": 1}),
            ("/weightsync/broadcast/receive", {"version": "666"}),
            ("/weightsync/verify", {"rank": 0, "version": "666", "bucket_bytes": 1 << 20, "checksums": []}),
            ("/weightsync/commit", {"version": "666"}),
            ("/update_weight_version", {"new_version": "666"}),
            ("/weightsync/stage", {"enabled": True}),
            ("/weightsync/abort", {}),
        ]:  # fmt: skip
            assert_refused(*call(engine + route, "POST", token=token, body=body), f"engine {route}")
        # Weight-revealing reads: the addresses to write at, the bytes' checksums.
        for route in ("/remote_instance_transfer_engine_info?rank=0", "/weightsync/checksums?rank=0&bucket_bytes=1"):
            assert_refused(*call(engine + route, "GET", token=token), f"engine {route}")
        # The publish hijack through trainer rank 0's agent (and rank 1's), and the sources' own routes.
        for base in (rank0, rank1):
            for rank in (0, 1):
                for version in (2, TEN_TO_THE_15):
                    body = {"version": version, "rank": rank, "timeoutSeconds": 5}
                    assert_refused(*call(base + "/v1/publish", "POST", token=token, body=body), "publish")
                    body = {"version": version, "timeoutSeconds": 5, "engines": None}
                    assert_refused(*call(base + f"/v1/sources/{rank}/publish", "POST", token=token, body=body), "src")
                    body = {"version": version}
                    assert_refused(*call(base + f"/v1/sources/{rank}/committed", "POST", token=token, body=body), "c")

    after = engine_status(group)
    assert after["weight_version"] == "1" and not after["paused"] and not after["live_dirty"]
    assert after["round"] is None and after["broadcast"] is None
    assert group.engines[0].client().weight_version() == "1"
    generated = call(engine + "/generate", "POST", body={"input_ids": [3, 14, 15], "sampling_params": {}})
    assert generated[0] == 200, generated  # still serving
    # The trainer's own next version lands (v10^15 was never committed, so 2 is newer).
    full = {name: t + 0.01 for name, t in full.items()}
    for outcome in publish_all(clients, full, 2):
        assert getattr(outcome, "ok", False), outcome
    final = engine_status(group)
    assert final["weight_version"] == "2" and not final["paused"] and not final["live_dirty"]
    assert torch.is_tensor(next(iter(full.values())))
