"""Pure pieces of the agent runtime: the wire format, the directory, coordinator refusals, HTTP errors."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync.plan import Plan, plan_for
from weightsync_agent.config import AgentConfig
from weightsync_agent.directory import DirectoryError, FileDirectory, StaticDirectory
from weightsync_agent.http.client import HttpCallError
from weightsync_agent.http.server import BackgroundServer
from weightsync_agent.layout.manifest import Manifest
from weightsync_agent.rounds import coordinator as coordinator_module
from weightsync_agent.rounds.coordinator import HISTORY, Coordinator
from weightsync_agent.rounds.driver import RoundResult
from weightsync_agent.rounds.wire import (
    WireError,
    placements_from_json,
    placements_to_json,
    round_result_from_json,
    round_result_to_json,
    source_report_from_json,
    source_report_to_json,
)
from weightsync_agent.sidecar.routes import build_app
from weightsync_agent.sidecar.runtime import AgentRuntime
from weightsync_agent.source.agent import SourceAgent
from weightsync_agent.source.control import RoundScope
from weightsync_agent.source.report import SourceReport

TEMPLATE = {"spec": {"containers": [{"name": "main"}]}}


def spec(adapter: str = "reference", staging: str = "live") -> WeightSyncGroupSpec:
    return WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": 2, "template": TEMPLATE},
            "inference": {
                "engines": 2,
                "ranksPerEngine": 2,
                "ranksPerPod": 2,
                "adapter": adapter,
                "template": TEMPLATE,
            },
            "transfer": {"targetStaging": staging},
        }
    )


targets = st.tuples(st.integers(0, 64), st.integers(0, 16))
checksums = st.lists(st.text(alphabet="0123456789abcdef", min_size=16, max_size=16), max_size=5)


@given(
    source=st.integers(0, 1000),
    ok=st.booleans(),
    sums=st.dictionaries(targets, checksums, max_size=4),
    nbytes=st.integers(0, 1 << 40),
    failed=st.none() | targets,
    bucket=st.none() | st.integers(0, 1000),
    error=st.none() | st.text(max_size=40),
)
def test_source_reports_survive_the_wire(
    source: int,
    ok: bool,
    sums: dict[tuple[int, int], list[str]],
    nbytes: int,
    failed: tuple[int, int] | None,
    bucket: int | None,
    error: str | None,
) -> None:
    report = SourceReport(source, ok, {t: tuple(v) for t, v in sums.items()}, nbytes, 1.5, error, failed, bucket)
    back = source_report_from_json(json.loads(json.dumps(source_report_to_json(report))))
    assert back == report


def test_round_results_survive_the_wire() -> None:
    result = RoundResult(3, "Failed", "2026-11-26T06:00:00Z", 1.25, 1024, 0.5, 2, "engine 1 rank 0 hung", True)
    assert round_result_from_json(json.loads(json.dumps(round_result_to_json(result)))) == result


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "must be an object"),
        ({"ok": True}, "source"),
        ({"source": 0, "ok": True, "checksums": {"0-1": ["ab"]}}, "'<engine>/<rank>'"),
        ({"source": 0, "ok": True, "checksums": {"0/1": "ab"}}, "list of bucket checksums"),
    ],
)
def test_malformed_source_reports_are_refused(data: object, message: str) -> None:
    with pytest.raises(WireError, match=message):
        source_report_from_json(data)


def test_a_round_result_with_an_unknown_outcome_is_refused() -> None:
    data = round_result_to_json(RoundResult(1, "Succeeded", "t", 1.0, 1, 1.0, 1))
    data["result"] = "Maybe"
    with pytest.raises(WireError, match="'Maybe'"):
        round_result_from_json(data)


def test_the_directory_file_is_reread_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "directory.json"
    path.write_text(json.dumps(StaticDirectory({0: "http://a"}, {0: "http://t0"}).to_json()))
    directory = FileDirectory(path)
    assert directory.engine_url(0) == "http://a"
    with pytest.raises(DirectoryError, match="engine 1"):
        directory.engine_url(1)
    path.write_text(json.dumps(StaticDirectory({0: "http://a", 1: "http://bb"}, {0: "http://t0"}).to_json()))
    os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    assert directory.engine_url(1) == "http://bb"


def _coordinator(adapter: str, staging: str = "live") -> Coordinator:
    local = SourceAgent("g", [0], make_transport=lambda: None, replica_root=lambda r: Path("/nonexistent"))  # type: ignore[arg-type,return-value]
    local.plan = plan_for(spec(adapter, staging), group="g")
    return Coordinator("g", local, StaticDirectory({}, {}))


def test_the_coordinator_refuses_what_the_adapter_cannot_do() -> None:
    result = _coordinator("sglang", staging="staged").run_round(1)
    assert result.result == "Failed" and result.attempts == 0
    assert "inference.adapter 'sglang' cannot do transfer.targetStaging 'staged'" in (result.reason or "")


def test_the_coordinator_refuses_versions_that_are_not_newer() -> None:
    coordinator = _coordinator("reference")
    coordinator.committed = 4
    result = coordinator.run_round(4)
    assert result.result == "Failed" and "not newer than committed 4" in (result.reason or "")
    assert coordinator.wait(4, 0.0) == result  # the trainer ranks waiting for v4 hear about it
    # A rank that heard the refusal and asks again hears it again, at once: no round of v4 will run.
    started = time.monotonic()
    assert coordinator.wait(4, 5.0, seen=result.round_id) == result
    assert time.monotonic() - started < 1.0


def test_a_rank_hears_a_round_that_failed_before_it_asked_unless_a_retry_of_it_comes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0's round of v1 can fail before rank 1 even staged v1 (a refusal waits for no rank): rank 1 asking
    afterwards gets that result once no retry of v1 came within the grace, not a timeout; when every rank retries,
    rank 0's new round is the answer, and a rank that heard a result waits for the next round of its version."""
    monkeypatch.setattr(coordinator_module, "RETRY_GRACE_SECONDS", 0.3)
    coordinator = _coordinator("sglang", staging="staged")  # refused at once: the adapter cannot stage
    first = coordinator.run_round(1)
    assert first.result == "Failed" and first.round_id
    assert coordinator.wait(1, 0.0) is None  # within the grace: a retry may be on its way
    started = time.monotonic()
    assert coordinator.wait(1, 10.0) == first  # none came: the failure is the answer
    assert 0.2 < time.monotonic() - started < 5.0
    assert coordinator.wait(1, 0.2, seen=first.round_id) is None  # a retry does not take the old answer
    with ThreadPoolExecutor(2) as pool:
        fresh_ask = pool.submit(coordinator.wait, 1, 30.0)  # a rank asking just before rank 0 retries
        retried = pool.submit(coordinator.wait, 1, 30.0, seen=first.round_id)
        time.sleep(0.05)
        second = coordinator.run_round(1)
        assert fresh_ask.result(timeout=30) == second == retried.result(timeout=30)
        assert second.round_id != first.round_id


def test_the_coordinator_keeps_the_last_rounds_only_and_wakes_its_listeners() -> None:
    coordinator = _coordinator("reference")
    coordinator.committed = 10_000
    woken: list[int] = []
    coordinator.on_finish.append(lambda: woken.append(1))
    for version in range(1, 3 * HISTORY + 1):
        coordinator.run_round(version)  # refused (not newer): recorded like any round
    assert len(coordinator.finished) == HISTORY and len(woken) == 3 * HISTORY
    assert list(coordinator.finished) == list(range(2 * HISTORY + 1, 3 * HISTORY + 1))  # the newest, in order
    assert coordinator.wait(1, 0.0) is None and coordinator.wait(3 * HISTORY, 0.0) is not None


def transportless_runtime(config: AgentConfig, plan: Plan, tmp_path: Path) -> AgentRuntime:
    """A trainer pod's runtime with no transport and no peers: enough for its HTTP routes and settings."""
    return AgentRuntime(
        config,
        lambda: plan,
        StaticDirectory({}, {}),
        make_transport=lambda p: None,  # type: ignore[arg-type,return-value]
        replica_root=lambda rank: tmp_path / f"r{rank}",
    )


def test_the_agents_http_calls_take_the_plans_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from weightsync.api import v1alpha1
    from weightsync.api.timeouts import Timeouts

    monkeypatch.setattr(v1alpha1.TransferSpec, "timeouts", property(lambda self: Timeouts(300, 300, 7.5, 300)))
    plan = plan_for(spec(), group="g")
    config = AgentConfig(group="g", role="trainer", pod_index=0, ranks=(0,), plan_file="-", group_token="t")
    runtime = transportless_runtime(config, plan, tmp_path)
    assert runtime.call_timeout == 7.5
    assert runtime.coordinator is not None and runtime.coordinator.call_timeout == 7.5


def test_the_agent_api_answers_bad_requests_with_the_field(tmp_path: Path) -> None:
    plan = plan_for(spec(), group="g")
    (tmp_path / "plan.json").write_text(plan.to_json())
    config = AgentConfig(
        group="g", role="trainer", pod_index=1, ranks=(1,), plan_file=str(tmp_path / "plan.json"), group_token="t0k"
    )
    runtime = transportless_runtime(config, plan, tmp_path)
    with BackgroundServer(build_app(runtime)) as server:

        def post(route: str, body: object) -> tuple[int, dict[str, object]]:
            headers = {"Content-Type": "application/json", "Authorization": "Bearer t0k"}
            request = urllib.request.Request(server.url + route, json.dumps(body).encode(), headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=5) as answer:
                    return answer.status, json.loads(answer.read())
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read())

        assert post("/v1/publish", {"version": "7", "rank": 1}) == (
            400,
            {"error": {"message": 'version: Input should be a valid integer (got "7")'}},
        )
        status, body = post("/v1/sources/1/publish", {"version": 1, "timeoutSeconds": -1})
        assert status == 400 and "timeoutSeconds" in str(body["error"])
        status, body = post("/v1/sources/1/publish", {"version": 1, "timeoutSeconds": 1, "engines": "all"})
        assert status == 400 and "engines: Input should be a valid list" in str(body["error"])
        # Not built yet (no engine answered): a failed report naming the reason, not an exception.
        status, body = post("/v1/sources/1/publish", {"version": 1, "timeoutSeconds": 0.1})
        assert status == 200 and body["ok"] is False and "not built yet" in str(body["error"])
        status, body = post("/v1/sources/3/committed", {"version": 1})
        assert status == 400 and "runs trainer ranks [1], not 3" in str(body["error"])
        with pytest.raises(urllib.error.HTTPError) as refused:
            get = urllib.request.Request(server.url + "/v1/rounds/1?wait=0", headers={"Authorization": "Bearer t0k"})
            urllib.request.urlopen(get, timeout=5)
        assert refused.value.code == 404 and b"not the coordinator" in refused.value.read()


def test_in_process_coordination_refuses_broadcast_plans_with_the_way_out() -> None:
    from weightsync_agent.client import ClientError, WeightSyncClient

    broadcast = spec().model_copy(update={"transfer": spec().transfer.model_copy(update={"mode": "broadcast"})})
    plan = plan_for(broadcast, group="g")
    with pytest.raises(ClientError, match="use the sidecar"):
        WeightSyncClient.coordinating(None, plan, 0, {}, {})  # type: ignore[arg-type]


# --- Stale manifests (an engine restarted): a source never writes at addresses its engine no longer publishes ---


def _manifest(*, session: str = "127.0.0.1:7000", base: int = 1 << 20) -> Manifest:
    part = {"source": "w", "fullShape": [4, 4], "dim": 0, "start": 0, "length": 4}
    tensor = {"name": "w", "dtype": "float32", "shape": [4, 4], "address": base, "nbytes": 64, "parts": [part]}
    return Manifest.model_validate({"engine": 0, "rank": 1, "sessionId": session, "tensors": [tensor],
                                    "regions": [{"address": base, "nbytes": 64}]})  # fmt: skip


def test_a_placement_names_the_session_and_addresses_and_not_the_layout() -> None:
    here = _manifest()
    assert _manifest().placement == here.placement
    assert _manifest(session="127.0.0.1:7001").placement != here.placement
    moved = _manifest(base=2 << 20)
    assert moved.placement != here.placement and moved.layout_fingerprint == here.layout_fingerprint


@given(st.none() | st.dictionaries(targets, st.text(alphabet="0123456789abcdef", min_size=16, max_size=16)))
def test_placements_survive_the_wire(placements: dict[tuple[int, int], str] | None) -> None:
    assert placements_from_json(json.loads(json.dumps(placements_to_json(placements)))) == placements


def test_malformed_placements_are_refused() -> None:
    with pytest.raises(WireError, match="placements"):
        placements_from_json({"0/1": 7})
    with pytest.raises(WireError, match="target key"):
        placements_from_json({"zero": "abc"})


class _Source:
    """What SourceAgent.publish reads of a Source before writing; writing itself must not happen here."""

    source = 0
    targets = ((0, 1),)

    def __init__(self, manifest: Manifest) -> None:
        self.manifests = {(0, 1): manifest}

    def publish(self, *args: object, **kwargs: object) -> object:
        raise AssertionError("a stale manifest was written")


def test_a_source_refuses_a_target_whose_engine_publishes_elsewhere_and_asks_for_fresh_manifests() -> None:
    agent = SourceAgent("g", [0], make_transport=lambda: None, replica_root=lambda r: Path("/nonexistent"))  # type: ignore[arg-type,return-value]
    held, now = _manifest(), _manifest(session="127.0.0.1:7001", base=3 << 20)
    agent.sources[0] = _Source(held)  # type: ignore[assignment]
    agent.plan = plan_for(spec(), group="g")
    report = agent.publish(0, 1, time.monotonic() + 5, RoundScope.of(None, placements={(0, 1): now.placement}))
    assert not report.ok and report.failed_target == (0, 1) and agent.stale
    assert report.error is not None
    assert "engine 0 rank 1 publishes its weights elsewhere" in report.error and "127.0.0.1:7000" in report.error
    agent.adopt(agent.plan, {(0, 1): now})  # the runtime's rebuild refetched the manifests
    assert not agent.stale


def test_rank_0s_publish_is_not_queued_behind_its_pods_waiting_ranks(tmp_path: Path) -> None:
    """40 ranks on rank 0's pod: 39 publishes wait for the round, more than the loop's default executor has threads
    (min(32, cores + 4)); rank 0's publish must still run at once (here the round is refused: nothing is built)."""
    ranks = 40
    many = spec().model_copy(
        update={"trainer": spec().trainer.model_copy(update={"replicas": 1, "ranks_per_pod": ranks})}
    )
    plan = plan_for(many, group="g")
    config = AgentConfig(
        group="g", role="trainer", pod_index=0, ranks=tuple(range(ranks)), plan_file="-", group_token="t0k"
    )
    runtime = transportless_runtime(config, plan, tmp_path)
    with BackgroundServer(build_app(runtime)) as server:

        def publish(rank: int) -> tuple[int, dict[str, object], float]:
            body = json.dumps({"version": 1, "rank": rank, "timeoutSeconds": 60}).encode()
            headers = {"Content-Type": "application/json", "Authorization": "Bearer t0k"}
            request = urllib.request.Request(server.url + "/v1/publish", body, headers, method="POST")
            start = time.monotonic()
            with urllib.request.urlopen(request, timeout=90) as answer:
                return answer.status, json.loads(answer.read()), time.monotonic() - start

        with ThreadPoolExecutor(ranks) as pool:
            waiting = [pool.submit(publish, rank) for rank in range(1, ranks)]
            time.sleep(1.0)  # every other rank waits for the round
            status, result, seconds = publish(0)
            assert status == 200 and result["result"] == "Failed" and "not built yet" in str(result["reason"])
            assert seconds < 5, f"rank 0's publish waited {seconds:.1f} s behind its pod's other ranks"
            for future in waiting:  # and they all hear its result
                assert future.result(timeout=30)[1]["version"] == 1


class HoldingEngine:
    """Just what recovery asks of an engine: the version it holds (None: it does not answer)."""

    def __init__(self, held: str | None) -> None:
        self.held = held

    def held_version(self, timeout: float | None = None) -> str | None:
        if self.held is None:
            raise HttpCallError("/model_info", None, "connection refused")
        return self.held


@pytest.mark.parametrize(
    ("held", "recalled", "committed"),
    [
        (["3", "default"], None, 3),  # the newest any engine holds; engine 1 restarted and is behind
        (["2", "3"], None, 3),
        (["default", "default"], None, None),  # a fresh group
        (["default", "default"], 5, 5),  # every engine restarted too: the pod's last report is a floor
        (["6", "4"], 5, 6),
    ],
)
def test_a_starting_coordinator_learns_the_committed_version(
    monkeypatch: pytest.MonkeyPatch, held: list[str], recalled: int | None, committed: int | None
) -> None:
    coordinator = _coordinator("reference")
    coordinator.recall = lambda: recalled
    monkeypatch.setattr(coordinator, "_adapter", lambda plan, engine: HoldingEngine(held[engine]))
    assert coordinator._recover(coordinator.own_sources.plan) is None
    assert coordinator.committed == committed and coordinator.recovered


def test_a_starting_coordinator_starts_no_round_until_every_engine_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    coordinator = _coordinator("reference")
    engines = [HoldingEngine("3"), HoldingEngine(None)]
    monkeypatch.setattr(coordinator, "_adapter", lambda plan, engine: engines[engine])
    result = coordinator.run_round(2)
    assert result.result == "Failed" and result.attempts == 0
    assert "has not learnt the committed version yet" in (result.reason or "") and "engine 1" in (result.reason or "")
    assert not coordinator.recovered and coordinator.committed is None
    engines[1].held = "default"  # it answers now
    result = coordinator.run_round(2)
    assert "version 2 is not newer than committed 3" in (result.reason or "") and coordinator.committed == 3
