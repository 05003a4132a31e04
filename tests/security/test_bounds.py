"""Every bound of the HTTP surface, each with the abusive input that found it, against real processes.

A loopback group (two ``weightsync agent`` processes, one reference engine process of two TP ranks, Mooncake over
TCP) with a short round budget. Each test sends what issue 11's review sent (or worse) and checks the answer is a
4xx in the one error shape, quickly, with no traceback, and that the group still syncs afterwards:

* request fields: versions past 2^53, negative ranks, ``timeoutSeconds`` of 10^300 or a day, NaN and Infinity,
  strings of megabytes, lists of a hundred thousand items, unknown fields, bodies nested a million deep, bodies
  over the cap (413 before parsing), invalid UTF-8;
* a source call asking for a day holds its rank no longer than the plan's round budget;
* every rank publishing 2^53 - 1 is refused at once (it would lock the group out), and the next version lands;
* ``bucket_bytes=1`` (a checksum answer 20 times the rank) is refused, and no allowed bucket size amplifies;
* 5,000 requests to distinct paths add no metric series;
* long polls (more than the loop's default executor has threads) do not delay a publish;
* a long ``/generate`` runs off the engine's event loop: health, status and pause answer while it runs, and the
  pause stops it at its next token;
* a peer answering 100 MB, or trickling its answer forever, is cut off by ``JsonHttpClient`` within the call's
  timeout.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_agent.client import WeightSyncClient
from weightsync_agent.client.trainer import RoundOutcome
from weightsync_agent.http.bounds import MAX_BODY_BYTES, MAX_BUCKETS, MAX_VERSION, MIN_BUCKET_BYTES
from weightsync_agent.http.client import HttpCallError, JsonHttpClient, PeerUnreachableError
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.reference_engine.model import full_state
from weightsync_testing.trainer_ranks import publish_all

TEMPLATE = {"spec": {"containers": [{"name": "main"}]}}
ROUND_BUDGET = 6  # seconds: a source call asking for a day must answer within this (plus slack)


def spec() -> WeightSyncGroupSpec:
    return WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": 2, "template": TEMPLATE},
            "inference": {"engines": 1, "ranksPerEngine": 2, "ranksPerPod": 2, "adapter": "reference",
                          "template": TEMPLATE},
            "transfer": {"protocol": "tcp", "bucketSizeMiB": 1, "timeoutSeconds": ROUND_BUDGET},
        }
    )  # fmt: skip


def send(
    url: str,
    method: str = "POST",
    *,
    token: str | None = None,
    body: Any = None,
    raw: bytes | None = None,
    timeout: float = 30,
) -> tuple[int, Any, float]:
    """(status, decoded answer, seconds): never raises for an HTTP status."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            status, payload = answer.status, answer.read()
    except urllib.error.HTTPError as error:
        status, payload = error.code, error.read()
    seconds = time.monotonic() - start
    try:
        return status, json.loads(payload), seconds
    except ValueError:
        return status, payload.decode(errors="replace"), seconds


def assert_refused(answer: tuple[int, Any, float], what: str, *, status: int = 400, words: str = "") -> None:
    code, body, seconds = answer
    assert code == status, f"{what}: HTTP {code} {str(body)[:300]}"
    assert isinstance(body, dict) and set(body) >= {"error"} and body["error"]["message"], f"{what}: {body!r}"
    message = body["error"]["message"]
    assert "Traceback" not in message and len(message) < 2000, f"{what}: {message[:300]}"
    assert words in message, f"{what}: {message!r} lacks {words!r}"
    assert seconds < 5, f"{what}: took {seconds:.1f} s"


@pytest.fixture(scope="module")
def group() -> Iterator[LoopbackGroup]:
    with LoopbackGroup(spec(), group="bounds").start() as running:
        yield running


@pytest.fixture(scope="module")
def clients(group: LoopbackGroup) -> Iterator[list[WeightSyncClient]]:
    with group.clients() as made:
        yield made


def publish_and_check(group: LoopbackGroup, clients: list[WeightSyncClient], version: int) -> float:
    """Publish ``version`` from both ranks; every outcome succeeds and the engine serves it. Returns seconds."""
    full = {name: t + 0.001 * version for name, t in full_state(seed=9).items()}
    start = time.monotonic()
    outcomes = publish_all(clients, full, version, timeout=60)
    seconds = time.monotonic() - start
    for outcome in outcomes:
        assert getattr(outcome, "ok", False), outcome
    assert group.engines[0].client().weight_version() == str(version)
    return seconds


DEEP = b"[" * 200_000
OVER = b'{"version": 1, "pad": "' + b"x" * (MAX_BODY_BYTES + 10) + b'"}'
HUGE_STRING = "v" * 100_000
TOO_MANY = list(range(100_000))
NO_UTF8 = b'{"version": "\xff\xfe"}'


def agent_abuse() -> list[tuple[str, str, Any, int, str]]:
    """(method, route, body, expected status, words in the message) for trainer rank 0's agent."""
    publish = "/v1/publish"
    source = "/v1/sources/1/publish"
    ok_source = {"version": 3, "timeoutSeconds": 1}
    return [
        ("POST", publish, {"version": 2**53, "rank": 0}, 400, "version"),
        ("POST", publish, {"version": 10**300, "rank": 0}, 400, "version"),
        ("POST", publish, {"version": -1, "rank": 0}, 400, "version"),
        ("POST", publish, {"version": 1.5, "rank": 0}, 400, "version"),
        ("POST", publish, {"version": "7", "rank": 0}, 400, "version"),
        ("POST", publish, {"version": True, "rank": 0}, 400, "version"),
        ("POST", publish, {"version": 2, "rank": -1}, 400, "rank"),
        ("POST", publish, {"version": 2, "rank": 2**40}, 400, "rank"),
        ("POST", publish, {"version": 2, "rank": 0, "timeoutSeconds": 1e300}, 400, "timeoutSeconds"),
        ("POST", publish, {"version": 2, "rank": 0, "timeoutSeconds": 86401}, 400, "timeoutSeconds"),
        ("POST", publish, {"version": 2, "rank": 0, "timeoutSeconds": -1}, 400, "timeoutSeconds"),
        ("POST", publish, {"version": 2, "rank": 0, "timeoutSeconds": float("inf")}, 400, "timeoutSeconds"),
        ("POST", publish, {"version": 2, "rank": 0, "timeoutSeconds": float("nan")}, 400, "timeoutSeconds"),
        ("POST", publish, {"version": 2, "rank": 0, "sneaky": 1}, 400, "sneaky"),
        ("POST", publish, [2, 0], 400, "object"),
        ("POST", publish, DEEP, 400, "nested too deeply"),
        ("POST", publish, OVER, 413, "exceeded"),
        ("POST", publish, NO_UTF8, 400, "not JSON"),
        ("POST", publish, b"\xff\xfe{", 400, "not JSON"),
        ("POST", source, {**ok_source, "engines": TOO_MANY}, 400, "engines"),
        ("POST", source, {**ok_source, "engines": [-1]}, 400, "engines"),
        ("POST", source, {**ok_source, "planHash": HUGE_STRING}, 400, "planHash"),
        ("POST", source, {**ok_source, "placements": {"0/0": HUGE_STRING}}, 400, "placements"),
        ("POST", source, {**ok_source, "placements": {"../../x": "p"}}, 400, "placements"),
        ("POST", source, {**ok_source, "timeoutSeconds": 1e300}, 400, "timeoutSeconds"),
        ("POST", source, {"version": 3}, 400, "timeoutSeconds"),
        ("POST", "/v1/sources/99999999999999999999/publish", ok_source, 400, "rank"),
        ("POST", "/v1/sources/1/committed", {"version": 2**60}, 400, "version"),
        ("GET", "/v1/rounds/abc", None, 400, "version"),
        ("GET", f"/v1/rounds/{2**60}", None, 400, "version"),
        ("GET", "/v1/rounds/1?wait=1e308", None, 400, "wait"),
        ("GET", "/v1/rounds/1?wait=nan", None, 400, "wait"),
        ("GET", "/v1/rounds/1?wait=-5", None, 400, "wait"),
        ("GET", "/v1/rounds/1?seen=" + "f" * 5000, None, 400, "seen"),
        ("GET", "/v1/engine/manifest?rank=-1", None, 400, "rank"),
        ("GET", "/v1/engine/manifest?rank=" + "9" * 5000, None, 400, "rank"),
        ("DELETE", publish, None, 405, "Not Allowed"),
        ("GET", "/v1/" + "x" * 4000, None, 404, "Not Found"),
    ]


def test_every_agent_request_field_is_bounded(group: LoopbackGroup, clients: list[WeightSyncClient]) -> None:
    base = group.agents[0].url
    for method, route, body, status, words in agent_abuse():
        raw = body if isinstance(body, bytes) else None
        answer = send(base + route, method, token=group.token, body=None if raw else body, raw=raw)
        assert_refused(answer, f"{method} {route} {str(body)[:60]}", status=status, words=words)
    # The trainer's own token gets the same answers on its routes, and nothing above changed anything.
    state = send(base + "/v1/state", "GET", token=group.token)[1]
    assert state["committed"] is None or state["committed"] < 2**53
    publish_and_check(group, clients, 1)


def test_a_huge_version_cannot_lock_the_group_out(group: LoopbackGroup, clients: list[WeightSyncClient]) -> None:
    """Issue 26: every trainer rank publishing 2^53 - 1 committed it, and versions only move forward, so the trainer's
    own next version was refused for good. Now a version more than ``maxVersionStep`` past the committed one is
    refused before anything is touched, the committed version kept, and the next version lands."""
    committed = send(group.agents[0].url + "/v1/state", "GET", token=group.token)[1]["committed"]
    held = group.engines[0].client().weight_version()
    start = time.monotonic()
    outcomes = publish_all(clients, full_state(seed=9), MAX_VERSION, timeout=30)
    for outcome in outcomes:
        assert isinstance(outcome, RoundOutcome) and not outcome.round.started, outcome
        assert "maxVersionStep" in outcome.round.reason, outcome.round.reason
    assert time.monotonic() - start < 2, "every rank hears the refusal at once"
    assert send(group.agents[0].url + "/v1/state", "GET", token=group.token)[1]["committed"] == committed
    assert group.engines[0].client().weight_version() == held
    publish_and_check(group, clients, int(committed or 0) + 1)


def test_a_source_call_asking_for_a_day_holds_its_rank_no_longer_than_a_round(group: LoopbackGroup) -> None:
    # Version 10^6 is never staged: the source waits for it until its deadline, which is cut to the round budget.
    url = group.agents[1].url + "/v1/sources/1/prepare"
    body = {"version": 10**6, "timeoutSeconds": 86400}
    status, answer, seconds = send(url, token=group.token, body=body, timeout=ROUND_BUDGET + 30)
    assert status == 200 and answer["ok"] is False, answer
    assert seconds < ROUND_BUDGET + 5, f"the source held its rank {seconds:.1f} s"


def test_engine_request_fields_are_bounded(group: LoopbackGroup) -> None:
    base = group.engines[0].url
    members = [{"group_rank": 1, "ranks": [0, 1]}]
    join = {"init_method": "tcp://127.0.0.1:1", "world_size": 2, "members": members, "timeout_seconds": 1}
    verify = {"rank": 0, "version": "5", "bucket_bytes": 1 << 20, "checksums": []}
    abuse: list[tuple[str, str, Any, int, str]] = [
        ("POST", "/pause_generation", {"mode": HUGE_STRING}, 400, "Invalid mode"),
        ("POST", "/weightsync/begin", {"version": HUGE_STRING}, 400, "at most 128"),
        ("POST", "/weightsync/begin", {"version": 2**60}, 400, "version"),
        ("POST", "/weightsync/begin", {"version": -3}, 400, "version"),
        ("POST", "/update_weight_version", {"new_version": HUGE_STRING}, 400, "at most 128"),
        ("POST", "/weightsync/commit", {"version": ""}, 400, "version"),
        ("POST", "/weightsync/verify", {**verify, "bucket_bytes": 1}, 400, "bucket_bytes"),
        ("POST", "/weightsync/verify", {**verify, "rank": 2**62}, 400, "rank"),
        ("POST", "/weightsync/verify", {**verify, "checksums": [HUGE_STRING]}, 400, "checksums"),
        ("POST", "/weightsync/verify", {**verify, "checksums": ["0"] * (MAX_BUCKETS + 1)}, 413, "exceeded"),
        ("POST", "/weightsync/broadcast", {**join, "members": members * 1000}, 400, "members"),
        ("POST", "/weightsync/broadcast", {**join, "world_size": 2**40}, 400, "world_size"),
        ("POST", "/weightsync/broadcast", {**join, "timeout_seconds": 1e300}, 400, "timeout_seconds"),
        ("POST", "/weightsync/broadcast", {**join, "init_method": HUGE_STRING}, 400, "init_method"),
        ("POST", "/weightsync/broadcast", {**join, "members": [{"group_rank": 1, "ranks": TOO_MANY}]}, 400, "ranks"),
        ("POST", "/weightsync/broadcast/receive", {"version": HUGE_STRING}, 400, "version"),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 10**9}}, 400, "max_new_tokens"),
        ("POST", "/generate", {"input_ids": TOO_MANY}, 400, "input_ids"),
        ("POST", "/generate", {"input_ids": [10**30]}, 400, "input_ids"),
        ("POST", "/weightsync/forward", {"tokens": [1, 2**70]}, 400, "tokens"),
        ("POST", "/weightsync/begin", DEEP, 400, "nested too deeply"),
        ("POST", "/weightsync/begin", OVER, 413, "exceeded"),
        ("POST", "/weightsync/begin", b"\xff{", 400, "JSON"),
        ("GET", "/weightsync/checksums?rank=0&bucket_bytes=1", None, 400, "bucket_bytes"),
        ("GET", f"/weightsync/checksums?rank=0&bucket_bytes={MIN_BUCKET_BYTES - 1}", None, 400, "bucket_bytes"),
        ("GET", "/weightsync/checksums?rank=" + "9" * 5000 + "&bucket_bytes=4096", None, 400, "rank"),
        ("DELETE", "/weightsync/commit", None, 405, "Not Allowed"),
    ]
    for method, route, body, status, words in abuse:
        raw = body if isinstance(body, bytes) else None
        answer = send(base + route, method, token=group.token, body=None if raw else body, raw=raw)
        assert_refused(answer, f"{method} {route} {str(body)[:60]}", status=status, words=words)
    after = group.engines[0].client().status()
    assert after["round"] is None and not after["paused"] and after["broadcast"] is None


def test_no_checksum_answer_amplifies(group: LoopbackGroup) -> None:
    """The smallest allowed bucket gives an answer well under the bytes it describes (bucket_bytes=1 gave 20x)."""
    base = group.engines[0].url
    rank_bytes = sum(p.numel() * p.element_size() for p in full_state(seed=0).values()) // 2  # about, per rank
    status, body, _ = send(f"{base}/weightsync/checksums?rank=0&bucket_bytes={MIN_BUCKET_BYTES}", "GET",
                           token=group.token)  # fmt: skip
    assert status == 200, body
    size = len(json.dumps(body))
    assert size < rank_bytes / 2, f"a {size} B answer for a rank of about {rank_bytes} B"


def metric_series(base: str) -> set[str]:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {line.split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_distinct_paths_add_no_metric_series(group: LoopbackGroup) -> None:
    base = group.agents[0].url
    before = metric_series(base)
    parsed = urllib.parse.urlsplit(base)
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=10)
    try:
        for i in range(5000):  # half with the credential (404), half without (401): neither may become a label
            headers = {"Authorization": f"Bearer {group.token}"} if i % 2 else {}
            connection.request("GET", f"/v1/probe-{i}/x?{i}", headers=headers)
            answer = connection.getresponse()
            answer.read()
            assert answer.status in (401, 404)
    finally:
        connection.close()
    # Ranks this agent does not run, named in the path: refused before they can become a rank label.
    for rank in range(2, 202):
        body = {"version": 1, "timeoutSeconds": 0}
        status, answer, _ = send(f"{base}/v1/sources/{rank}/publish", token=group.token, body=body)
        assert status == 400 and "not " + str(rank) in answer["error"]["message"], answer
    after = metric_series(base)
    assert len(after - before) <= 2, sorted(after - before)[:10]  # a counter's _created line may appear, no more
    assert not any("probe-" in series or 'rank="17"' in series for series in after)


def test_long_polls_do_not_starve_publish(group: LoopbackGroup, clients: list[WeightSyncClient]) -> None:
    version = int(send(group.agents[0].url + "/v1/state", "GET", token=group.token)[1]["committed"] or 0) + 1
    baseline = publish_and_check(group, clients, version)
    polls = 48  # more than the loop's default executor has threads (min(32, cores + 4))
    url = group.agents[0].url + f"/v1/rounds/{10**9}?wait=30"
    answers: list[tuple[int, Any, float]] = []
    lock = threading.Lock()

    def poll() -> None:
        answer = send(url, "GET", token=group.token, timeout=60)
        with lock:
            answers.append(answer)

    threads = [threading.Thread(target=poll, daemon=True) for _ in range(polls)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # every poll is parked
    seconds = publish_and_check(group, clients, version + 1)
    assert seconds < max(5.0, 3 * baseline), f"publish took {seconds:.1f} s behind {polls} long polls"
    with lock:
        assert len(answers) == 0, "a long poll answered before its wait"
    for thread in threads:
        thread.join(40)
    assert len(answers) == polls and all(a[0] == 200 and a[1] == {"pending": True} for a in answers)


def test_a_long_generation_runs_off_the_engine_loop_and_a_pause_stops_it(group: LoopbackGroup) -> None:
    base = group.engines[0].url
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 4000}}
    result: list[tuple[int, Any, float]] = []
    thread = threading.Thread(target=lambda: result.append(send(base + "/generate", body=body, timeout=600)))
    thread.start()
    try:
        time.sleep(0.5)  # the generation runs
        for _ in range(5):
            for route in ("/health", "/weightsync/status"):
                status, _, seconds = send(base + route, "GET", token=group.token)
                assert status == 200 and seconds < 0.5, f"{route} took {seconds:.2f} s during a generation"
        assert thread.is_alive(), "the generation ended too soon to show anything"
        status, answer, seconds = send(base + "/pause_generation", token=group.token, body={"mode": "abort"})
        assert status == 200 and seconds < 2, (status, answer, seconds)
        thread.join(30)
        assert result and result[0][0] == 503 and "paused" in result[0][1]["error"]["message"], result
    finally:
        send(base + "/continue_generation", token=group.token, body={})
        thread.join(600)
    status, answer, _ = send(base + "/generate", body={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and len(answer["output_ids"]) == 2


# --- Peers that answer too much or never finish: JsonHttpClient cuts them off ---------------------------------


class BadPeer:
    """A raw socket server that answers every request with ``headers`` and then ``body`` (an iterator of chunks,
    each sent after ``pause`` seconds)."""

    def __init__(self, headers: bytes, chunks: Iterator[bytes], pause: float = 0.0) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.headers, self.chunks, self.pause = headers, chunks, pause
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        connection, _ = self.server.accept()
        with connection:
            connection.recv(65536)
            try:
                connection.sendall(self.headers)
                for chunk in self.chunks:
                    time.sleep(self.pause)
                    connection.sendall(chunk)
            except OSError:  # the client hung up: what it should do
                return

    def close(self) -> None:
        self.server.close()


def endless(chunk: bytes, count: int | None = None) -> Iterator[bytes]:
    sent = 0
    while count is None or sent < count:
        sent += 1
        yield chunk


def test_a_peer_answering_100_mb_is_refused_after_the_cap() -> None:
    megabyte = b"x" * (1 << 20)
    # Declared: refused before reading. Undeclared (read to the end): refused once over the cap.
    for headers in (b"HTTP/1.1 200 OK\r\nContent-Length: 104857600\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\n"):
        peer = BadPeer(headers, endless(megabyte, 100))
        try:
            client = JsonHttpClient(f"http://127.0.0.1:{peer.port}", timeout=20, max_answer_bytes=8 << 20)
            start = time.monotonic()
            with pytest.raises(HttpCallError, match="over the cap"):
                client.request("GET", "/big")
            assert time.monotonic() - start < 20
        finally:
            peer.close()


def test_a_peer_that_never_ends_its_answer_is_cut_off_within_the_call_timeout() -> None:
    peer = BadPeer(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n", endless(b"x"), pause=0.2)
    try:
        client = JsonHttpClient(f"http://127.0.0.1:{peer.port}", timeout=2.0)
        start = time.monotonic()
        with pytest.raises(PeerUnreachableError, match="not complete within"):
            client.request("GET", "/trickle")
        assert time.monotonic() - start < 3.0
    finally:
        peer.close()


def test_a_chunked_answer_under_the_cap_still_reads_whole() -> None:
    """Stock engines (uvicorn) may answer chunked: reading in capped steps must still give the whole answer."""
    payload = json.dumps({"weight_version": "7", "pad": "y" * 300_000}).encode()
    pieces = [payload[i : i + 70_000] for i in range(0, len(payload), 70_000)]
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces] + [b"0\r\n\r\n"]
    peer = BadPeer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n",
                   iter(chunks), pause=0.05)  # fmt: skip
    try:
        status, body = JsonHttpClient(f"http://127.0.0.1:{peer.port}", timeout=10).request("GET", "/weight_version")
        assert status == 200 and body["weight_version"] == "7" and len(body["pad"]) == 300_000
    finally:
        peer.close()
