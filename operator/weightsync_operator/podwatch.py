"""The groups' pods, watched by the operator itself (not by kopf): every event goes to a callback.

Why not a kopf ``on.event`` handler: for every event of every watched resource kopf builds a diff base, a deep
copy of the whole object, even when only event handlers are registered. At 1,024 pods that copying and kopf's
cause detection were about 40 % of the operator's CPU while a group came up (py-spy, docs/scale.md), and the
operator shares the control plane's cores. Here an event costs one ``json.loads`` and the callback.

One watch per scope (the cluster, or each watched namespace), selected server-side by the ``weightsync.io/group``
label, in the informer's pattern: LIST (every item is delivered, as an event of type None), then WATCH from the
list's resourceVersion with bookmarks; the server ends a watch after ``WATCH_SECONDS`` and it resumes from the
last version seen; ``410 Gone`` (that version was compacted away) LISTs again; failures back off, a 401 logs in
again. :class:`~weightsync_operator.podindex.PodIndex` orders what the LISTs and watches deliver.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any, Final

from weightsync.api import names
from weightsync_operator import kube

logger = logging.getLogger(__name__)

#: How long the API server keeps one watch open; a read waits this much longer before the stream counts as dead.
WATCH_SECONDS: Final = 300
READ_SLACK_SECONDS: Final = 30.0
#: A pod is at most ~1.5 MB in etcd; an event larger than this is not a pod.
MAX_EVENT_BYTES: Final = 8 << 20
BACKOFFS: Final = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0)
QUICK_END_SECONDS: Final = 1.0

#: ``(event type, pod)``; the type is ``ADDED``/``MODIFIED``/``DELETED``, or None for an item of a LIST.
OnPod = Callable[[str | None, Mapping[str, Any]], None]


class ResourceVersionGoneError(Exception):
    """The watch's resourceVersion is too old (410): list again."""


class PodWatch:
    def __init__(self, api: kube.KubeApi, namespaces: tuple[str, ...], on_pod: OnPod) -> None:
        """``namespaces``: the watched namespaces, or empty for the whole cluster."""
        self.api = api
        self.scopes: list[str | None] = list(namespaces) if namespaces else [None]
        self.on_pod = on_pod
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._run(scope), name=f"weightsync-pod-watch-{scope or 'cluster'}")
            for scope in self.scopes
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _run(self, namespace: str | None) -> None:
        path = kube.KINDS["Pod"].collection(namespace)
        version: str | None = None
        failures = 0
        while True:
            try:
                if version is None:
                    version = await self._list(path)
                started = asyncio.get_running_loop().time()
                version = await self._watch(path, version)
                failures = 0
                if asyncio.get_running_loop().time() - started < QUICK_END_SECONDS:
                    await asyncio.sleep(QUICK_END_SECONDS)  # a server that ends watches at once is not spun on
            except ResourceVersionGoneError:
                logger.info("pod watch of %s: resourceVersion %s is gone; listing again", path, version)
                version = None
            except kube.ApiError as exc:
                delay = BACKOFFS[min(failures, len(BACKOFFS) - 1)]
                failures += 1
                if exc.status == 401:
                    await self.api.login_again()
                logger.warning("pod watch of %s failed (%s); again in %.0f s", path, exc, delay)
                await asyncio.sleep(delay)

    async def _list(self, path: str) -> str | None:
        items, version = await self.api.list_versioned(path, label_selector=names.LABEL_GROUP)
        for pod in items:
            self.on_pod(None, pod)
        return version

    async def _watch(self, path: str, version: str | None) -> str | None:
        """Deliver one watch's events; the version to resume from."""
        params = {
            "labelSelector": names.LABEL_GROUP,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_SECONDS),
            **({"resourceVersion": version} if version else {}),
        }
        stream = self.api.watch(
            path, params, read_timeout=WATCH_SECONDS + READ_SLACK_SECONDS, max_event_bytes=MAX_EVENT_BYTES
        )
        async for event in stream:
            kind, obj = event.get("type"), event.get("object")
            if not isinstance(obj, Mapping):
                continue
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise ResourceVersionGoneError
                raise kube.ApiError(int(obj.get("code") or 0), str(obj.get("reason") or "Error"),
                                    str(obj.get("message") or ""), method="WATCH", path=path)  # fmt: skip
            seen = (obj.get("metadata") or {}).get("resourceVersion")
            if seen:
                version = str(seen)
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                self.on_pod(str(kind), obj)
        return version


__all__ = ["PodWatch"]
