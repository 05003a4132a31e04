"""The engine HTTP client against an SGLang-shaped fake: payloads, route fallbacks, errors, timeouts."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from weightsync_agent.http.client import HttpCallError, PeerUnreachableError
from weightsync_agent.http.server import BackgroundServer
from weightsync_agent.targets.engine_client import EngineClient

SGLANG_WEIGHTS_INFO = {"model.embed_tokens.weight": [139870000000000, 1024, 2]}


class FakeSGLang:
    """Newest SGLang shapes: /model_info carries the version, /get_weight_version answers 404."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.version = "default"

    def app(self) -> web.Application:
        async def record(request: web.Request) -> Any:
            body = await request.json() if request.can_read_body else None
            self.calls.append((request.method, request.path_qs, body))
            return body

        async def model_info(request: web.Request) -> web.Response:
            await record(request)
            return web.json_response({"model_path": "m", "is_generation": True, "weight_version": self.version})

        async def deprecated(request: web.Request) -> web.Response:
            await record(request)
            raise web.HTTPNotFound(text='{"detail": "deprecated, use /model_info"}', content_type="application/json")

        async def info(request: web.Request) -> web.Response:
            await record(request)
            rank = int(request.query["rank"])
            return web.json_response(
                {"rank": rank, "remote_instance_transfer_engine_info": ["10.0.0.5:15001", SGLANG_WEIGHTS_INFO]}
            )

        async def ok(request: web.Request) -> web.Response:
            await record(request)
            return web.json_response({"message": "ok", "status": "ok"})

        async def update(request: web.Request) -> web.Response:
            body = await record(request)
            self.version = body["new_version"]
            return web.json_response({"success": True, "message": "", "new_version": self.version})

        async def slow(request: web.Request) -> web.Response:
            await asyncio.sleep(2)
            return web.json_response({})

        async def unhealthy(request: web.Request) -> web.Response:
            return web.Response(status=503)

        app = web.Application()
        app.add_routes(
            [
                web.get("/model_info", model_info),
                web.get("/get_weight_version", deprecated),
                web.get("/weight_version", deprecated),
                web.get("/remote_instance_transfer_engine_info", info),
                web.post("/pause_generation", ok),
                web.post("/continue_generation", ok),
                web.post("/update_weight_version", update),
                web.get("/server_info", slow),
                web.get("/health", unhealthy),
            ]
        )
        return app


@pytest.fixture
def fake() -> Iterator[tuple[FakeSGLang, EngineClient]]:
    sglang = FakeSGLang()
    with BackgroundServer(sglang.app()) as server:
        yield sglang, EngineClient(server.url, timeout=5)


def test_sglang_payloads(fake: tuple[FakeSGLang, EngineClient]) -> None:
    sglang, client = fake
    client.pause_generation("in_place")
    client.update_weight_version(12)
    client.continue_generation()
    assert sglang.calls == [
        ("POST", "/pause_generation", {"mode": "in_place"}),
        ("POST", "/update_weight_version", {"new_version": "12", "abort_all_requests": False}),
        ("POST", "/continue_generation", {}),
    ]
    assert client.weight_version() == "12"


def test_transfer_info_and_non_manifest_weights_info(fake: tuple[FakeSGLang, EngineClient]) -> None:
    sglang, client = fake
    info = client.transfer_engine_info(3)
    assert (info.rank, info.session_id, info.weights_info) == (3, "10.0.0.5:15001", SGLANG_WEIGHTS_INFO)
    assert sglang.calls[-1][1] == "/remote_instance_transfer_engine_info?rank=3"
    with pytest.raises(HttpCallError, match="not a manifest"):
        info.manifest()


def test_capabilities_and_errors(fake: tuple[FakeSGLang, EngineClient]) -> None:
    _, client = fake
    assert not client.supports_weightsync()  # SGLang has no /weightsync/ routes
    assert client.health() is False  # 503
    with pytest.raises(HttpCallError) as err:
        client.commit("1")
    assert err.value.status == 404


def test_timeouts_bound_every_call(fake: tuple[FakeSGLang, EngineClient]) -> None:
    _, client = fake
    start = time.monotonic()
    with pytest.raises(PeerUnreachableError):
        client.server_info(timeout=0.3)
    assert time.monotonic() - start < 1.5


def test_unreachable_engine_fails_fast() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    client = EngineClient(f"http://127.0.0.1:{port}", timeout=2)
    start = time.monotonic()
    with pytest.raises(PeerUnreachableError):
        client.weight_version()
    assert time.monotonic() - start < 1.5
    with pytest.raises(ValueError):
        EngineClient("http://x", timeout=0)
