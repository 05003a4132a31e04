"""The operator's own pod watch against a scripted API server (aiohttp): LIST, then WATCH from the list's version
with bookmarks, resume from the last version seen when the server ends a watch, LIST again on ``410 Gone``, back
off and go on after an error answer. The real API server runs it in tests/e2e (every group's readiness comes
through it) and test_handlers_kmock.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import kopf
import pytest
from aiohttp import web

from weightsync.api import names
from weightsync_operator import podwatch
from weightsync_operator.kube import KubeApi
from weightsync_operator.podwatch import PodWatch


def pod(name: str, version: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ml", "resourceVersion": version,
                         "labels": {names.LABEL_GROUP: "g"}}}  # fmt: skip


class ScriptedServer:
    """Answers the pod LISTs and WATCHes of namespace ``ml`` from a script, and records what was asked."""

    def __init__(self, lists: list[Any], watches: list[Any]) -> None:
        self.lists = lists  # each: (items, version) or an HTTP status to answer
        self.watches = watches  # each: a list of events (then the stream ends), or None: stay open
        self.asked: list[dict[str, str]] = []
        self.closing = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        params = dict(request.query)
        self.asked.append(params)
        if params.get("watch") != "true":
            answer = self.lists.pop(0)
            if isinstance(answer, int):
                return web.json_response({"reason": "Scripted", "message": "no"}, status=answer)
            items, version = answer
            return web.json_response({"kind": "PodList", "apiVersion": "v1", "items": items,
                                      "metadata": {"resourceVersion": version}})  # fmt: skip
        response = web.StreamResponse()
        await response.prepare(request)
        script = self.watches.pop(0) if self.watches else None
        if script is None:
            await self.closing.wait()
            script = []
        for event in script:
            await response.write(json.dumps(event).encode() + b"\n")
        await response.write_eof()
        return response


@pytest.fixture
async def served() -> AsyncIterator[tuple[ScriptedServer, str]]:
    server = ScriptedServer([], [])
    app = web.Application()
    app.router.add_get("/api/v1/namespaces/ml/pods", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield server, f"http://127.0.0.1:{port}"
    server.closing.set()
    await runner.cleanup()


async def eventually(check: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_list_then_watch_resume_from_the_last_version_and_list_again_when_it_is_gone(
    served: tuple[ScriptedServer, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, url = served
    monkeypatch.setattr(podwatch, "QUICK_END_SECONDS", 0.0)
    server.lists = [([pod("a", "8"), pod("b", "9")], "10"), ([pod("a", "30")], "31")]
    server.watches = [
        [
            {"type": "ADDED", "object": pod("c", "11")},
            {"type": "MODIFIED", "object": pod("a", "12")},
            {"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": "15"}}},
        ],
        [{"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}}],
        None,
    ]
    seen: list[tuple[str | None, str, str]] = []

    def on_pod(kind: str | None, obj: Mapping[str, Any]) -> None:
        seen.append((kind, obj["metadata"]["name"], obj["metadata"]["resourceVersion"]))

    api = KubeApi(lambda: kopf.ConnectionInfo(server=url))
    watch = PodWatch(api, ("ml",), on_pod)
    watch.start()
    try:
        await eventually(lambda: len(server.asked) == 5)
    finally:
        await watch.stop()
        await api.close()
    assert seen == [(None, "a", "8"), (None, "b", "9"), ("ADDED", "c", "11"), ("MODIFIED", "a", "12"),
                    (None, "a", "30")]  # fmt: skip
    lists = [a for a in server.asked if "watch" not in a]
    watches = [a for a in server.asked if "watch" in a]
    assert all(a["labelSelector"] == names.LABEL_GROUP for a in server.asked)
    assert len(lists) == 2  # the first, and the one after 410
    assert [w["resourceVersion"] for w in watches] == ["10", "15", "31"]  # the bookmark's version was kept
    assert all(w["allowWatchBookmarks"] == "true" and int(w["timeoutSeconds"]) > 0 for w in watches)


async def test_an_error_answer_backs_off_and_the_watch_goes_on(
    served: tuple[ScriptedServer, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, url = served
    monkeypatch.setattr(podwatch, "BACKOFFS", (0.05,))
    server.lists = [503, ([pod("a", "5")], "6")]
    server.watches = [None]
    seen: list[str] = []
    api = KubeApi(lambda: kopf.ConnectionInfo(server=url))
    watch = PodWatch(api, ("ml",), lambda kind, obj: seen.append(obj["metadata"]["name"]))
    watch.start()
    try:
        await eventually(lambda: seen == ["a"] and len(server.asked) == 3)
    finally:
        await watch.stop()
        await api.close()
    assert [a.get("watch") for a in server.asked] == [None, None, "true"]
