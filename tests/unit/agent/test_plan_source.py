"""The plan sources' logic: the file re-read only when it changed; the ConfigMap watch's 410 handling and
reconnects. The API here is a scripted fake (the real API server: tests/e2e/test_plan_watch.py)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from weightsync.api import names
from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync.plan import Plan, PlanError, plan_for, replan
from weightsync.plan.seal import seal
from weightsync_agent.http.credential import Credential
from weightsync_agent.plan_loader import ConfigMapPlanWatch, FilePlanSource, events, plan_of

SLEEPER = {"spec": {"containers": [{"name": "main", "image": "busybox"}]}}


def spec(engines: int) -> WeightSyncGroupSpec:
    return WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": 1, "ranksPerPod": 1, "template": SLEEPER},
            "inference": {"engines": engines, "ranksPerEngine": 1, "ranksPerPod": 1, "adapter": "reference",
                          "template": SLEEPER},
        }
    )  # fmt: skip


FIRST = plan_for(spec(1), group="g")
SECOND = replan(FIRST, spec(2))


class Response:
    """A watch response: the scripted lines, then (``hold``) no more until closed, like a quiet watch."""

    def __init__(self, lines: list[dict[str, Any]], hold: bool) -> None:
        self.lines = lines
        self.hold = hold
        self.closed = threading.Event()

    def stream(self, amt: int, decode_content: bool = True) -> Any:
        for line in self.lines:
            yield (json.dumps(line) + "\n").encode()
        if self.hold:
            self.closed.wait(10)

    def close(self) -> None:
        self.closed.set()

    @property
    def connection(self) -> Any:
        return SimpleNamespace(sock=SimpleNamespace(shutdown=lambda how: self.closed.set()))

    def release_conn(self) -> None:
        pass


class FakeApi:
    def __init__(self, watches: list[BaseException | Response]) -> None:
        self.watches = watches
        self.reads = 0
        self.watch_versions: list[str | None] = []
        self.stored = FIRST

    def list_namespaced_config_map(self, namespace: str, **kwargs: Any) -> Any:
        assert kwargs["field_selector"] == "metadata.name=g-plan"
        if not kwargs.get("watch"):  # a list: the API server's current resourceVersion, newer than the item's own
            self.reads += 1
            item = SimpleNamespace(data={names.PLAN_KEY: self.stored.to_json()},
                                   metadata=SimpleNamespace(resource_version="5"))  # fmt: skip
            return SimpleNamespace(items=[item], metadata=SimpleNamespace(resource_version=str(10 + self.reads)))
        self.watch_versions.append(kwargs["resource_version"])
        step = self.watches.pop(0) if self.watches else Response([], hold=True)
        if isinstance(step, BaseException):
            raise step
        return step


def modified(plan: Plan, version: str) -> dict[str, Any]:
    return {"type": "MODIFIED", "object": {"metadata": {"resourceVersion": version},
                                           "data": {names.PLAN_KEY: plan.to_json()}}}  # fmt: skip


def until(check: Any, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_gone_version_is_read_afresh_and_the_watch_goes_on_from_there() -> None:
    gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old resource version"}}
    api = FakeApi([ApiException(status=410), Response([gone], hold=False), Response([modified(SECOND, "40")], True)])
    reconnected: list[bool] = []
    watch = ConfigMapPlanWatch(
        api, "ns", "g-plan", backoff_first=0.01, on_reconnect=lambda: reconnected.append(True), keys=None
    )
    try:
        until(lambda: watch.delivered >= 3)  # read, read again after each 410, and the watched change
        assert watch().hash == SECOND.hash
        assert api.reads == 3
        # Each watch from the list's version just read (not the ConfigMap's own "5"): never from one the server
        # called gone.
        assert api.watch_versions == ["11", "12", "13"]
        assert reconnected == [], "a 410 is not an outage"
    finally:
        watch.close()


def test_after_a_failure_the_watch_backs_off_reconnects_and_says_so() -> None:
    api = FakeApi([OSError("connection refused"), ApiException(status=503), Response([], hold=True)])
    reconnected: list[bool] = []
    watch = ConfigMapPlanWatch(
        api, "ns", "g-plan", backoff_first=0.01, on_reconnect=lambda: reconnected.append(True), keys=None
    )
    try:
        until(lambda: reconnected == [True])
        assert watch().hash == FIRST.hash and api.watch_versions == ["11", "11", "11"]
    finally:
        watch.close()


def test_a_throttled_watch_comes_back_after_the_servers_hint_and_its_backoff_does_not_grow() -> None:
    throttled = ApiException(status=429, reason="Too Many Requests")
    throttled.headers = {"Retry-After": "0.1"}
    api = FakeApi([throttled, throttled, throttled, Response([], hold=True)])
    started = time.monotonic()
    # A backoff of 1, 2, 4 s would take 7 s; the hints take 0.3-0.6 s.
    watch = ConfigMapPlanWatch(api, "ns", "g-plan", backoff_first=1.0, backoff_max=30.0, keys=None)
    try:
        until(lambda: len(api.watch_versions) == 4, timeout=3)
        assert time.monotonic() - started < 2.0
    finally:
        watch.close()


def test_an_unusable_plan_is_refused_and_the_last_good_one_kept() -> None:
    bad = {"type": "MODIFIED", "object": {"metadata": {"resourceVersion": "20"}, "data": {names.PLAN_KEY: "{"}}}
    api = FakeApi([Response([bad, modified(SECOND, "21")], hold=True)])
    watch = ConfigMapPlanWatch(api, "ns", "g-plan", keys=None)
    try:
        # Counters, not watch(): before its first read the watch has no plan to give (and says so).
        until(lambda: watch.delivered >= 2)  # the first read and the good change after the refused one
        assert watch().hash == SECOND.hash
        assert watch.refused == 1
    finally:
        watch.close()


def test_a_watch_event_over_the_bound_cuts_the_stream() -> None:
    huge = Response([{"type": "MODIFIED", "object": {"data": {"x": "y" * 5000}}}], hold=False)
    with pytest.raises(PlanError, match="more than 1000 bytes"):
        list(events(huge, 1000))


def test_the_plan_file_is_read_again_only_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(FIRST.to_json())
    source = FilePlanSource(path)
    first = source()
    assert source() is first  # a stat, no read
    path.write_text(SECOND.to_json())
    assert source().hash == SECOND.hash


def test_a_plan_is_taken_only_sealed_with_a_token_the_agent_accepts(tmp_path: Path) -> None:
    """The seal proves the operator wrote the plan: unsealed or sealed with another token, it is refused; during a
    rotation either token seals; a rotation the agent's files show only after the operator resealed is re-read."""
    text = FIRST.to_json()
    keys = Credential.fixed("new", previous="old")
    for token in ("new", "old"):
        sealed = {names.PLAN_KEY: text, names.PLAN_SEAL_KEY: seal(token, text)}
        assert plan_of(sealed, "g-plan", keys).hash == FIRST.hash
    for data in ({names.PLAN_KEY: text}, {names.PLAN_KEY: text, names.PLAN_SEAL_KEY: seal("other", text)},
                 {names.PLAN_KEY: SECOND.to_json(), names.PLAN_SEAL_KEY: seal("new", text)}):  # fmt: skip
        with pytest.raises(PlanError, match="not sealed with the group's token"):
            plan_of(data, "g-plan", keys)
    assert plan_of({names.PLAN_KEY: text}, "g-plan", None).hash == FIRST.hash  # no keys: the caller chose no check
    (tmp_path / names.SECRET_TOKEN_KEY).write_text("before")
    mounted = Credential.from_directory(tmp_path)
    (tmp_path / names.SECRET_TOKEN_KEY).write_text("rotated")  # the kubelet refreshed the volume
    assert plan_of({names.PLAN_KEY: text, names.PLAN_SEAL_KEY: seal("rotated", text)}, "g-plan", mounted)
