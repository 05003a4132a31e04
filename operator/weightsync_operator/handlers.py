"""kopf handlers, kept thin: they decide *when* a group is reconciled; :mod:`apply` decides *what*.

Triggers, all funnelled through one per-group lock (a reconcile never overlaps itself, and a burst of
pod events collapses into one follow-up reconcile, run no sooner than ``status_interval`` after the previous
reconcile of that group: 1,024 pod events cause about one reconcile, and one status write, per second):

- create / update / resume of a WeightSyncGroup;
- any event of a pod labelled ``weightsync.io/group`` (readiness, annotations, failure, deletion: a
  deleted pod is recreated), from the operator's own pod watch (:mod:`~weightsync_operator.podwatch`: kopf's
  per-event deep copies cost too much CPU at 1,000 pods);
- a periodic resync of every known group (``WEIGHTSYNC_RESYNC_SECONDS``, default 30 s).

Every pod event updates :class:`~weightsync_operator.podindex.PodIndex`, which the reconciler reads instead of
LISTing the group's pods (one LIST per group after a start warms it; see that module).

No finalizer is ever added: there are no deletion handlers, and the resync is an operator-level task
rather than a kopf timer (kopf puts a finalizer on objects with timers or daemons). Deleting a group
is left to the garbage collector through the owner references, and is never blocked by the operator,
even while it is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import kopf

from weightsync.api import names
from weightsync.api.v1alpha1 import GROUP, PLURAL, VERSION
from weightsync_operator import kube, metrics
from weightsync_operator.apply import Reconciler, Result
from weightsync_operator.config import OperatorConfig
from weightsync_operator.podindex import PodIndex
from weightsync_operator.podwatch import PodWatch

logger = logging.getLogger(__name__)

#: Prefix of everything kopf itself stores on objects (progress, last-handled configuration).
KOPF_PREFIX = "weightsync.io"
#: Never added (no handler needs one); set so that nothing of kopf's defaults lands on our objects.
FINALIZER = f"{KOPF_PREFIX}/finalizer"
#: Delay before kopf retries a create/update/resume whose reconcile hit an API error.
RETRY_DELAY = 10.0

Key = tuple[str, str]  # (namespace, name)


def configure(settings: kopf.OperatorSettings) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=KOPF_PREFIX, key="last-handled-configuration"
    )
    # Only warnings and errors of handlers become Kubernetes Events; the operator posts its own.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "weightsync-operator"
    settings.posting.event_name_prefix = "weightsync-"
    # Reconnect watches that go quiet (a known kopf failure mode is a silently dead stream).
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.error_backoffs = [1, 2, 5, 10, 20, 30]
    settings.queueing.error_delays = [1, 2, 5, 10, 20, 30, 60]
    settings.execution.max_workers = 8


class Operator:
    """The operator's in-process state for one run (reset on every startup)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.config = OperatorConfig()
        self.api: kube.KubeApi | None = None
        self.reconciler: Reconciler | None = None
        self.index: Mapping[Key, Any] | None = None
        self.pods = PodIndex(relist_seconds=self.config.pod_relist_seconds)
        self.locks: dict[Key, asyncio.Lock] = {}
        self.pending: set[Key] = set()
        #: When each group's last reconcile ended (monotonic): event-driven reconciles wait ``status_interval``.
        self.last_done: dict[Key, float] = {}
        #: The task draining a group's pending reconciles, started by pod events (which must not wait for it).
        self.drainers: dict[Key, asyncio.Task[None]] = {}
        self.resync_task: asyncio.Task[None] | None = None
        self.pod_watch: PodWatch | None = None
        self.last_resync = time.monotonic()

    def start(
        self,
        config: OperatorConfig,
        index: Mapping[Key, Any] | None,
        settings: kopf.OperatorSettings,
        namespaces: tuple[str, ...] = (),
    ) -> None:
        self._reset()  # a fresh state per run (kopf may run again in the same process, as in tests)
        self.config = config
        self.index = index
        self.pods = PodIndex(relist_seconds=config.pod_relist_seconds)
        self.api = kube.KubeApi(
            lambda: kube.login(settings=settings), max_connections=max(32, config.create_concurrency)
        )
        self.reconciler = Reconciler(
            self.api,
            options=config.build_options,
            pods=self.pods,
            create_concurrency=config.create_concurrency,
            status_interval=config.status_interval,
        )
        self.resync_task = asyncio.create_task(self._resync_forever(), name="weightsync-resync")
        self.pod_watch = PodWatch(self.api, namespaces, self.pod_changed)

    def pod_changed(self, event_type: str | None, pod: Mapping[str, Any]) -> None:
        """One pod event (or LIST item): into the index, and a reconcile of its group asked for."""
        key = self.pods.observe(event_type, pod)
        if key is not None and self.body_of(key) is not None:
            self.request(key)

    async def stop(self) -> None:
        if self.pod_watch is not None:
            await self.pod_watch.stop()
        for task in self.drainers.values():
            task.cancel()
        if self.resync_task is not None:
            self.resync_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.resync_task
        if self.api is not None:
            await self.api.close()

    def body_of(self, key: Key) -> Mapping[str, Any] | None:
        store = (self.index or {}).get(key)
        return next(iter(store), None) if store is not None else None

    async def reconcile_now(self, key: Key, body: Mapping[str, Any]) -> Result:
        """Reconcile with this (fresh) body; what pod events requested meanwhile is left to a drainer task, so
        kopf's handler returns (and the next change of the group is handled) without waiting for the pods."""
        assert self.reconciler is not None, "the operator has not started"
        lock = self.locks.setdefault(key, asyncio.Lock())
        async with lock:
            self.pending.discard(key)
            try:
                result = await self.reconciler.reconcile(body)
            finally:
                self.last_done[key] = time.monotonic()
        if key in self.pending:
            self._drain_later(key)
        return result

    async def poke(self, key: Key) -> None:
        """Ask for a reconcile of ``key`` from its latest indexed body; coalesces with a running one.

        Requests gather while the group's last reconcile is less than ``status_interval`` old: that bounds
        reconciles (and status writes) per group to one per interval, and the trailing one always runs, so the final
        state is always written. The wait holds no lock: a change of the group itself (:meth:`reconcile_now`) never
        waits for it."""
        self.pending.add(key)
        lock = self.locks.setdefault(key, asyncio.Lock())
        while key in self.pending and self.reconciler is not None:
            wait = self.last_done.get(key, 0.0) + self.config.status_interval - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
                continue  # someone may have reconciled meanwhile: look again
            if lock.locked():
                return  # the holder hands ``pending`` to a drainer task when it lets go
            async with lock:
                self.pending.discard(key)
                body = self.body_of(key)
                if body is not None:
                    try:
                        await self.reconciler.reconcile(body)
                    finally:
                        self.last_done[key] = time.monotonic()

    def request(self, key: Key) -> None:
        """Like :meth:`poke`, without waiting: a pod event's handler returns at once, so kopf hands over the
        next event (and the index stays current) while the reconcile runs."""
        self.pending.add(key)
        self._drain_later(key)

    def _drain_later(self, key: Key) -> None:
        task = self.drainers.get(key)
        if task is None or task.done():
            self.drainers[key] = asyncio.create_task(self.poke(key), name=f"weightsync-reconcile-{key[0]}/{key[1]}")

    async def _resync_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.resync_seconds)
            for key in list(self.index or {}):
                try:
                    await self.poke(key)
                except Exception:  # never let one group stop the resync of the others
                    logger.exception("periodic reconcile of %s/%s failed", *key)
            self.last_resync = time.monotonic()

    def forget(self, key: Key, uid: str | None) -> None:
        self.locks.pop(key, None)
        self.pending.discard(key)
        self.last_done.pop(key, None)
        drainer = self.drainers.pop(key, None)
        if drainer is not None:
            drainer.cancel()
        self.pods.forget(key)
        if self.reconciler is not None and uid:
            self.reconciler.forget(uid)
        metrics.forget(f"{key[0]}/{key[1]}")


OPERATOR = Operator()

#: The namespaces the operator watches (empty: the whole cluster); :func:`weightsync_operator.main.run` sets it.
WATCH_NAMESPACES: tuple[str, ...] = ()


def namespace_patterns(namespaces: tuple[str, ...]) -> list[str]:
    """The entries that are glob patterns (kopf would take them; the operator's pod watch and the chart's
    per-namespace Roles need names)."""
    return [n for n in namespaces if any(c in n for c in "*?[]!")]


def served_paths(namespaces: tuple[str, ...]) -> list[tuple[str, str | None]]:
    """What kopf and the pod watch are about to watch, as LIST paths: the groups and their pods, cluster-wide or
    per namespace."""
    scopes: list[str | None] = list(namespaces) if namespaces else [None]
    group_kind, pod_kind = kube.KINDS["WeightSyncGroup"], kube.KINDS["Pod"]
    paths: list[tuple[str, str | None]] = [(group_kind.collection(n), None) for n in scopes]
    paths += [(pod_kind.collection(n), names.LABEL_GROUP) for n in scopes]
    return paths


def plain(value: Any) -> Any:
    """A deep, plain-dict copy of a kopf body (its views are read-only and live)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **kwargs: Any) -> None:
    configure(settings)
    config = OperatorConfig.from_env()
    OPERATOR.start(config, kwargs.get("wsg_index"), settings, WATCH_NAMESPACES)
    assert OPERATOR.api is not None and OPERATOR.pod_watch is not None
    # kopf starts its watches only after the startup handlers: wait out a fresh CRD's cache fill here.
    if not await kube.wait_until_served(OPERATOR.api, served_paths(WATCH_NAMESPACES)):
        logger.warning("the API server kept answering 429 for 60 s; starting the watches anyway")
    OPERATOR.pod_watch.start()
    logger.info(
        "weightsync operator started: default agent image %s, resync every %ss",
        config.agent_image or "(none: groups must set spec.agent.image)",
        config.resync_seconds,
    )


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    await OPERATOR.stop()


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo:
    return kube.login(**kwargs)


@kopf.on.probe(id="resync_age_seconds")
def resync_age(**_: Any) -> float:
    return round(time.monotonic() - OPERATOR.last_resync, 1)


@kopf.index(GROUP, VERSION, PLURAL)
def wsg_index(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[Key, dict[str, Any]]:
    """Every group's latest body, by ``(namespace, name)``: what pod events and the resync reconcile."""
    return {(namespace or "", name): plain(body)}


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def reconcile_group(body: kopf.Body, namespace: str | None, name: str, **_: Any) -> None:
    result = await OPERATOR.reconcile_now((namespace or "", name), plain(body))
    if result.retry and result.problem is not None:
        # Transient (API) trouble: let kopf retry soon. Spec problems are not retried: they are in the
        # status, and the next update of the spec reconciles again.
        raise kopf.TemporaryError(result.problem.message, delay=RETRY_DELAY)


@kopf.on.event(GROUP, VERSION, PLURAL)
def group_event(event: kopf.RawEvent, namespace: str | None, name: str, uid: str, **_: Any) -> None:
    if event.get("type") == "DELETED":
        OPERATOR.forget((namespace or "", name), uid)
