"""PodReporter and PodDirectory when the API server fails (the logic; tests/e2e/test_faults.py runs the real
API server hung and down). The API here is a recording fake whose answers the test scripts."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from weightsync.api import names
from weightsync.plan import Layout
from weightsync_agent.directory import DirectoryError, PodDirectory, pod_ips, points_at_pod
from weightsync_agent.kube import MAX_RETRY_AFTER_SECONDS, throttled_wait
from weightsync_agent.sidecar.report import PodReporter


class RawAnswer:
    """What the client returns with ``_preload_content=False``: the reporter must read it and give the connection
    back."""

    def __init__(self) -> None:
        self.read_ = False
        self.released = False

    def read(self) -> bytes:
        self.read_ = True
        return b"{}"

    def release_conn(self) -> None:
        self.released = True


class FakeCoreApi:
    """Records patches; raises whatever ``failures`` holds, one per call, then answers."""

    def __init__(self) -> None:
        self.failures: list[BaseException] = []
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.block = threading.Event()
        self.block.set()
        self.annotations: dict[str, str] = {}
        self.pod_ip: str | None = None  # the pod's status.podIP
        self.answers: list[RawAnswer] = []

    def _call(self, kind: str, body: dict[str, Any], preload: bool) -> RawAnswer:
        self.block.wait()
        if self.failures:
            raise self.failures.pop(0)
        assert not preload, "the reporter must not have the client decode the pod it gets back"
        self.calls.append((kind, body))
        answer = RawAnswer()
        self.answers.append(answer)
        return answer

    def patch_namespaced_pod_status(
        self, pod: str, namespace: str, body: dict[str, Any], _preload_content: bool = True
    ) -> RawAnswer:
        return self._call("status", body, _preload_content)

    def patch_namespaced_pod(
        self, pod: str, namespace: str, body: dict[str, Any], _preload_content: bool = True
    ) -> RawAnswer:
        return self._call("pod", body, _preload_content)

    def read_namespaced_pod(self, pod: str, namespace: str) -> Any:
        self.block.wait()
        if self.failures:
            raise self.failures.pop(0)
        self.calls.append(("read", {"pod": pod}))
        return SimpleNamespace(
            metadata=SimpleNamespace(annotations=dict(self.annotations)),
            status=SimpleNamespace(pod_ip=self.pod_ip, pod_ips=None),
        )


def hung() -> BaseException:
    return urllib3.exceptions.ReadTimeoutError(None, "/api", "read timed out")  # type: ignore[arg-type]


def reporter(api: FakeCoreApi, **kwargs: float) -> PodReporter:
    return PodReporter(api, "ns", "pod", retry_first=0.01, retry_max=0.05, **kwargs)


def test_reports_return_at_once_while_the_api_server_hangs_and_land_after() -> None:
    api = FakeCoreApi()
    api.block.clear()  # every call hangs
    report = reporter(api)
    started = time.monotonic()
    report.annotate({names.ANNOTATION_WEIGHT_VERSION: 1})
    report.annotate({names.ANNOTATION_WEIGHT_VERSION: 2, names.ANNOTATION_LAST_ROUND: {"version": 2}})
    report.set_ready(True, "SourcesBuilt")
    assert time.monotonic() - started < 0.1
    assert not report.flush(0.1)
    api.block.set()
    assert report.flush(5)
    annotations: dict[str, Any] = {}
    for kind, body in api.calls:
        if kind == "pod":
            annotations.update(body["metadata"]["annotations"])
    assert annotations[names.ANNOTATION_WEIGHT_VERSION] == "2"
    assert annotations[names.ANNOTATION_LAST_ROUND] == '{"version":2}'
    assert api.answers and all(a.read_ and a.released for a in api.answers)  # every connection went back
    report.close()


def test_failed_reports_are_retried_and_newer_values_win() -> None:
    api = FakeCoreApi()
    api.failures = [hung(), ApiException(status=503, reason="unavailable"), hung()]
    report = reporter(api)
    report.annotate({names.ANNOTATION_WEIGHT_VERSION: 3})
    report.annotate({names.ANNOTATION_WEIGHT_VERSION: 4})
    assert report.flush(5)
    assert report.failures == 3
    assert api.calls == [("pod", {"metadata": {"annotations": {names.ANNOTATION_WEIGHT_VERSION: "4"}}})]
    report.close()


def test_refusals_are_retried_slowly_and_land_once_accepted() -> None:
    """Right after an API server restart an admission policy may refuse with a 422 for a few seconds."""
    api = FakeCoreApi()
    api.failures = [ApiException(status=422, reason="Unprocessable Entity")] * 3
    report = reporter(api)
    report.annotate({names.ANNOTATION_WEIGHT_VERSION: 5})
    assert report.flush(5)
    assert api.calls == [("pod", {"metadata": {"annotations": {names.ANNOTATION_WEIGHT_VERSION: "5"}}})]


def throttled(retry_after: str | None) -> ApiException:
    exc = ApiException(status=429, reason="Too Many Requests")
    exc.headers = {"Retry-After": retry_after} if retry_after is not None else {}
    return exc


def test_throttling_is_waited_out_as_the_api_server_says_not_with_a_growing_backoff() -> None:
    """Priority and fairness sheds a burst of agents with 429 + Retry-After: 1; a doubling backoff took some of
    them to 8-30 s waits. Four 429s asking for 0.1 s land within ~1 s, where the backoff (1, 2, 4, 8 s) would
    take 15 s."""
    api = FakeCoreApi()
    api.failures = [throttled("0.1")] * 4
    report = PodReporter(api, "ns", "pod", retry_first=1.0, retry_max=10.0)
    started = time.monotonic()
    report.set_ready(True, "SourcesBuilt")
    assert report.flush(5)
    assert time.monotonic() - started < 1.5
    assert report.failures == 4 and [kind for kind, _ in api.calls] == ["status"]
    report.close()


def test_throttled_wait_reads_retry_after_bounded_and_jittered() -> None:
    for _ in range(50):
        assert 1.0 <= (throttled_wait(throttled("1")) or 0) <= 2.0
        assert 1.0 <= (throttled_wait(throttled(None)) or 0) <= 2.0  # no hint: a second
        assert 1.0 <= (throttled_wait(throttled("soon")) or 0) <= 2.0  # unreadable: a second
        assert MAX_RETRY_AFTER_SECONDS <= (throttled_wait(throttled("3600")) or 0) <= 2 * MAX_RETRY_AFTER_SECONDS
        assert 0.1 <= (throttled_wait(throttled("0")) or 0) <= 0.2
    assert throttled_wait(ApiException(status=503, reason="Unavailable")) is None
    assert throttled_wait(hung()) is None


def test_a_report_for_a_pod_that_is_gone_is_dropped() -> None:
    api = FakeCoreApi()
    api.failures = [ApiException(status=404, reason="Not Found")]
    report = reporter(api)
    report.annotate({names.ANNOTATION_WEIGHT_VERSION: 5})
    assert report.flush(5)
    assert api.calls == []
    report.close()


def test_the_condition_is_sent_again_with_its_transition_time_kept() -> None:
    api = FakeCoreApi()
    report = reporter(api, resync=0.05)
    report.set_ready(True, "SourcesBuilt")
    time.sleep(0.3)
    report.close()
    sent = [body["status"]["conditions"][0] for kind, body in api.calls if kind == "status"]
    assert len(sent) >= 3
    assert all(c == sent[0] for c in sent)


LAYOUT = Layout(trainer_pods=1, trainer_ranks_per_pod=1, engines=1, ranks_per_engine=1, engine_ranks_per_pod=1)


def test_the_directory_serves_the_last_answer_while_the_api_server_fails() -> None:
    api = FakeCoreApi()
    api.annotations = {names.ANNOTATION_ENGINE_URL: "http://10.0.0.5:30000"}
    api.pod_ip = "10.0.0.5"
    directory = PodDirectory(api, "ns", "g", LAYOUT, hold_seconds=0.2)
    assert directory.engine_url(0) == "http://10.0.0.5:30000"
    api.failures = [hung()]
    assert directory.engine_url(0) == "http://10.0.0.5:30000"
    reads = len(api.calls)
    assert directory.engine_url(0) == "http://10.0.0.5:30000"
    assert len(api.calls) == reads  # held: no call (no timeout paid) during the outage
    time.sleep(0.25)
    api.annotations = {names.ANNOTATION_ENGINE_URL: "http://10.0.0.6:30000"}
    api.pod_ip = "10.0.0.6"  # the pod was recreated elsewhere
    assert directory.engine_url(0) == "http://10.0.0.6:30000"  # fresh after the hold


def test_the_directory_believes_only_urls_naming_the_pods_own_address() -> None:
    """Issue 26: callers send the group's credential to whatever URL a pod advertises, so one naming another address
    (an annotation anyone who may patch the pod can write) is ignored for the pod's DNS name."""
    api = FakeCoreApi()
    api.pod_ip = "10.0.0.5"
    dns = "http://g-engine-0-0.g.ns.svc:30000"
    for url, believed in [
        ("http://10.0.0.5:30000", True),
        ("http://10.0.0.66:30000", False),  # another pod, or a server of the annotation's writer
        ("http://attacker.example:30000", False),
        ("http://127.0.0.1:30000", False),  # loopback: the caller's own pod, not the advertiser's
        ("not a url", False),
    ]:
        api.annotations = {names.ANNOTATION_ENGINE_URL: url}
        assert PodDirectory(api, "ns", "g", LAYOUT).engine_url(0) == (url if believed else dns), url
    api.annotations = {names.ANNOTATION_AGENT_URL: "http://10.0.0.66:9470"}
    assert PodDirectory(api, "ns", "g", LAYOUT).trainer_url(0) == "http://g-trainer-0.g.ns.svc:9470"
    assert PodDirectory(api, "ns", "g", LAYOUT).engine_agent_url(0) == "http://g-engine-0-0.g.ns.svc:9470"
    api.annotations = {names.ANNOTATION_ENGINE_URL: "http://127.0.0.1:30000"}  # the local cluster allows loopback
    assert PodDirectory(api, "ns", "g", LAYOUT, loopback=True).engine_url(0) == "http://127.0.0.1:30000"
    api.pod_ip = None  # no IP yet: nothing advertised is believed
    api.annotations = {names.ANNOTATION_ENGINE_URL: "http://10.0.0.5:30000"}
    assert PodDirectory(api, "ns", "g", LAYOUT).engine_url(0) == dns


def test_an_advertised_url_may_name_any_of_the_pods_ips() -> None:
    dual = SimpleNamespace(status=SimpleNamespace(pod_ip="10.0.0.5", pod_ips=[SimpleNamespace(ip="fd00::5")]))
    assert pod_ips(dual) == {"10.0.0.5", "fd00::5"}
    assert points_at_pod("http://[fd00:0::5]:9470", pod_ips(dual))  # the same address, written otherwise
    assert not points_at_pod("http://[fd00::6]:9470", pod_ips(dual))
    assert points_at_pod("http://[::1]:9470", set(), loopback=True) and not points_at_pod("http://[::1]:9470", set())


def test_the_directory_says_why_when_it_never_had_an_answer() -> None:
    api = FakeCoreApi()
    api.failures = [hung()]
    with pytest.raises(DirectoryError, match="did not answer"):
        PodDirectory(api, "ns", "g", LAYOUT).engine_url(0)
    api.failures = [ApiException(status=404, reason="Not Found")]
    with pytest.raises(DirectoryError, match="does not exist"):
        PodDirectory(api, "ns", "g", LAYOUT).engine_url(0)


def test_a_refused_resync_backs_off_instead_of_spinning() -> None:
    api = FakeCoreApi()
    report = reporter(api, resync=0.05)
    report.set_ready(True, "SourcesBuilt")
    assert report.flush(5)
    api.failures = [ApiException(status=422, reason="Unprocessable Entity")] * 100
    time.sleep(0.5)
    assert 100 - len(api.failures) < 20  # backoff up to 0.3 s here, not a tight loop
    report.close(flush_seconds=0)


def test_an_unchanged_condition_is_resent_slowly_unless_the_api_server_was_away() -> None:
    """Idle, the condition is re-sent only every ``resync`` (600 s by default: idle API load per pod); after the API
    server was away (the plan watch reconnected: ``resync_soon``) it is re-sent at once, kwok may have rewritten it."""
    api = FakeCoreApi()
    report = reporter(api, resync=600.0)
    try:
        report.set_ready(True, "SourcesBuilt")
        assert report.flush(2)
        time.sleep(0.3)
        assert [kind for kind, _ in api.calls] == ["status"]
        report.resync_soon()
        deadline = time.monotonic() + 2
        while len(api.calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [kind for kind, _ in api.calls] == ["status", "status"]
        assert api.calls[1][1] == api.calls[0][1], "the same condition, its transition time kept"
    finally:
        report.close()
