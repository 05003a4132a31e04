"""The request models' bounds (sidecar/requests.py) and the one-line refusal they give (http/bounds.py)."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from weightsync_agent.http.bounds import (
    MAX_REQUEST_SECONDS,
    MAX_VERSION,
    BadRequestError,
    parse_body,
    short,
)
from weightsync_agent.http.server import BackgroundServer, bounded_app, error_middleware
from weightsync_agent.sidecar.requests import (
    PublishRequest,
    RankQuery,
    RoundQuery,
    SourceCallRequest,
    VerifyRequest,
)


@given(st.integers(min_value=0, max_value=MAX_VERSION), st.integers(min_value=0, max_value=16383))
def test_every_version_and_rank_in_bounds_parses(version: int, rank: int) -> None:
    asked = parse_body(PublishRequest, {"version": version, "rank": rank, "timeoutSeconds": 1})
    assert (asked.version, asked.rank, asked.timeout_seconds) == (version, rank, 1.0)


@given(
    st.one_of(
        st.integers(max_value=-1),
        st.integers(min_value=MAX_VERSION + 1),
        st.floats(),
        st.text(max_size=5),
        st.booleans(),
        st.none(),
    )
)
def test_every_version_out_of_bounds_is_a_bad_request_naming_it(version: object) -> None:
    with pytest.raises(BadRequestError, match=r"^version: "):
        parse_body(PublishRequest, {"version": version, "rank": 0})


@pytest.mark.parametrize("seconds", [-1, MAX_REQUEST_SECONDS + 1, 1e300, math.inf, math.nan])
def test_timeouts_are_capped(seconds: float) -> None:
    with pytest.raises(BadRequestError, match="timeoutSeconds"):
        parse_body(SourceCallRequest, {"version": 1, "timeoutSeconds": seconds})


def test_a_long_poll_over_the_poll_cap_is_cut_to_it_and_queries_parse_from_text() -> None:
    asked = parse_body(RoundQuery, {"version": "12", "wait": "3600", "seen": "9f3a"})
    assert (asked.version, asked.poll_seconds, asked.seen) == (12, 60.0, "9f3a")
    with pytest.raises(BadRequestError, match="seen"):
        parse_body(RoundQuery, {"version": "12", "seen": "a&b=c"})
    assert parse_body(RoundQuery, {"version": "12", "round": "r-1"}).round_id == "r-1"
    with pytest.raises(BadRequestError, match="round"):
        parse_body(RoundQuery, {"version": "12", "round": "x" * 1000})
    assert parse_body(RankQuery, {"rank": "3"}).rank == 3


def test_a_verify_takes_bucket_digests_only() -> None:
    """``POST /v1/engine/verify`` (vLLM engines): 16 hex digits per bucket, a round id; nothing else."""
    ok = {"rank": 0, "version": 3, "checksums": ["0123456789abcdef"] * 3, "roundId": "r-1"}
    assert parse_body(VerifyRequest, ok).checksums == ["0123456789abcdef"] * 3
    for field, bad in [
        ("checksums", ["0123456789ABCDEF"]),  # xxh3 hexdigest is lower case
        ("checksums", ["0123"]),
        ("checksums", ["../../etc/passwd"]),
        ("roundId", ""),
        ("rank", -1),
    ]:
        with pytest.raises(BadRequestError, match=field):
            parse_body(VerifyRequest, {**ok, field: bad})
    with pytest.raises(BadRequestError, match=r"^path: "):
        parse_body(VerifyRequest, {**ok, "path": "/etc/passwd"})


def test_the_refusal_is_one_short_line_whatever_the_input() -> None:
    with pytest.raises(BadRequestError) as refused:
        parse_body(SourceCallRequest, {"version": 1, "timeoutSeconds": 1, "planHash": "h" * 10**6, "x": 1})
    message = str(refused.value)
    assert "\n" not in message and len(message) < 500
    assert "planHash" in message and "x: Extra inputs are not permitted" in message
    assert len(short("a" * 1000)) == 80 and short("a" * 1000).endswith("...")


def test_a_handler_bug_is_a_500_in_the_one_error_shape_without_the_traceback() -> None:
    async def broken(_: web.Request) -> web.Response:
        raise RuntimeError("secret internals /etc/passwd")

    app = bounded_app([error_middleware])
    app.router.add_get("/broken", broken)
    with BackgroundServer(app) as server:
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(server.url + "/broken", timeout=5)
        assert failed.value.code == 500
        body = json.loads(failed.value.read())
        assert body == {"error": {"message": "internal error (RuntimeError); see the server's log"}}
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(server.url + "/nothing", timeout=5)
        assert missing.value.code == 404 and json.loads(missing.value.read())["error"]["message"]


def test_an_agent_listens_on_its_pod_ip_and_on_the_pods_loopback_for_its_own_trainer() -> None:
    """The trainer container beside the agent finds it at 127.0.0.1 (``WeightSyncClient.from_env``), peers at the pod's
    IP; found by running pods in network namespaces, where the agent answered on the pod IP only. 127.0.0.2 stands for
    the pod's IP here (any 127/8 address is this machine's)."""

    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="hi")

    def app() -> web.Application:  # one per server: an application is bound to its server's loop
        made = web.Application()
        made.router.add_get("/", hello)
        return made

    with BackgroundServer(app(), "127.0.0.2", 0, also_loopback=True) as server:
        for host in ("127.0.0.2", "127.0.0.1"):
            with urllib.request.urlopen(f"http://{host}:{server.port}/", timeout=5) as answer:
                assert answer.read() == b"hi", host
    with BackgroundServer(app(), "127.0.0.2", 0) as server, pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/", timeout=5)
