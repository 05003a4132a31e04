"""Where an agent (or an in-process trainer) reads the group's plan: a file, or the plan ConfigMap.

:func:`load_plan` reads it once (the agent's start, an in-process trainer). The agent's background loop then
asks a :class:`PlanSource` for the newest plan on every tick, and that must cost the API server nothing per
tick: a 1,024-pod group whose agents each read the ConfigMap every 2 s sends 512 requests/s while idle. So

* :class:`ConfigMapPlanWatch` keeps one watch open on the one plan ConfigMap (field selector
  ``metadata.name=<cm>``, the only form the agents' Role allows, since it names the ConfigMap by resourceNames),
  from the resourceVersion it last saw; the server ends a watch after ``timeout_seconds`` (a few minutes, jittered
  so 1,000 agents do not reconnect together) and it reconnects from there; a ``410 Gone`` (the version was
  compacted away) makes it read the ConfigMap afresh; failures back off up to :data:`WATCH_BACKOFF_MAX_SECONDS`.
  Idle cost: one request per ``timeout_seconds`` per agent.
* :class:`FilePlanSource` (local runs, ``WEIGHTSYNC_PLAN_FILE``) re-reads the file only when its stat changes.

A plan larger than :data:`MAX_PLAN_BYTES` (the API server's own limit on a ConfigMap, so only a file or a broken
server can bring one) or one that does not parse is refused with one log line and the last good plan kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final, Protocol

from weightsync.api import names
from weightsync.plan import Plan, PlanError
from weightsync.plan.seal import sealed_by
from weightsync_agent.config import AgentConfig
from weightsync_agent.kube import CONNECT_SECONDS, api_exception, kube_core_api, throttled_wait, transport_errors

log = logging.getLogger("weightsync.agent.plan")

#: The largest plan document taken: a ConfigMap holds at most 1 MiB, so a plan never legitimately exceeds it.
MAX_PLAN_BYTES: Final = 1 << 20
#: The largest single watch event read (the ConfigMap as JSON, its plan escaped inside): past it the stream is cut.
MAX_EVENT_BYTES: Final = 4 * MAX_PLAN_BYTES
#: How long the API server keeps one watch open (jittered up to 25% more, so agents spread their reconnects).
WATCH_SECONDS: Final = 240
#: How much longer than ``timeout_seconds`` a read may wait before the watch counts as hung.
WATCH_READ_SLACK_SECONDS: Final = 15.0
WATCH_BACKOFF_FIRST_SECONDS: Final = 0.5
WATCH_BACKOFF_MAX_SECONDS: Final = 30.0


def parse_plan(text: str, where: str, max_bytes: int = MAX_PLAN_BYTES) -> Plan:
    """A plan document, refused (PlanError) when over ``max_bytes``, invalid or tampered with."""
    size = len(text.encode())
    if size > max_bytes:
        raise PlanError(f"{where}: the plan is {size} bytes, more than the {max_bytes} taken")
    return Plan.from_json(text)


class Candidates(Protocol):
    """The tokens a credential accepts now (``weightsync_agent.http.credential.TokenSet``)."""

    def candidates(self) -> tuple[str, ...]: ...


class PlanKeys(Protocol):
    """What a plan's seal is checked with: the group's credential (``weightsync_agent.http.credential.Credential``),
    its accepted tokens and a re-read of its files."""

    def tokens(self) -> Candidates: ...

    def refresh(self) -> bool: ...


def load_plan(config: AgentConfig, plan_file: Path | None, keys: PlanKeys | None) -> Plan:
    path = plan_file or (Path(config.plan_file) if config.plan_file else None)
    if path is not None:
        return parse_plan(path.read_text(), str(path))
    if not config.plan_config_map:
        raise PlanError(f"no plan: set {names.ENV_PLAN_CONFIG_MAP} or {names.ENV_PLAN_FILE}")
    return read_config_map_plan(kube_core_api(), config.namespace, config.plan_config_map, keys)[0]


def read_config_map_plan(api: Any, namespace: str, name: str, keys: PlanKeys | None) -> tuple[Plan, str]:
    """The plan in ConfigMap ``name`` and the **list's** resourceVersion, where a watch goes on from.

    Listed by name (the agents' Role allows it with the field selector), not read: an unchanged ConfigMap keeps its
    own old resourceVersion, which after an API server restart lies before the watch cache; a watch from it is gone
    again at once, and read-then-watch spun (every agent of a group, until the plan changed)."""
    api_error = api_exception()

    try:
        found = api.list_namespaced_config_map(namespace, field_selector=f"metadata.name={name}")
    except api_error as exc:
        raise PlanError(f"cannot read ConfigMap {name}: {exc.status} {exc.reason}") from exc
    except transport_errors() as exc:
        raise PlanError(f"cannot read ConfigMap {name}: no answer from the API server ({exc})") from exc
    if not found.items:
        raise PlanError(f"cannot read ConfigMap {name}: it does not exist")
    return plan_of(found.items[0].data, name, keys), str(found.metadata.resource_version)


def plan_of(data: dict[str, str] | None, name: str, keys: PlanKeys | None, max_bytes: int = MAX_PLAN_BYTES) -> Plan:
    """The plan in a ConfigMap's ``data``. ``keys``: the group's credential; the plan must then carry a seal made
    with one of its tokens (``weightsync.plan.seal``: the operator's, not a plan whoever may edit the ConfigMap
    wrote). None only where nothing holds the token (the scale bench's stand-ins, tests of the watch itself)."""
    text = (data or {}).get(names.PLAN_KEY)
    if not text:
        raise PlanError(f"ConfigMap {name} has no {names.PLAN_KEY}")
    if keys is not None and not _sealed(keys, text, (data or {}).get(names.PLAN_SEAL_KEY)):
        raise PlanError(f"ConfigMap {name}: the plan is not sealed with the group's token (not the operator's)")
    return parse_plan(text, f"ConfigMap {name}", max_bytes)


def _sealed(keys: PlanKeys, text: str, given: str | None) -> bool:
    """Sealed with a token the agent accepts; on a miss the credential files are read again once (a rotation the
    operator resealed with before this agent's volume showed it)."""
    if sealed_by(keys.tokens().candidates(), text, given):
        return True
    return keys.refresh() and sealed_by(keys.tokens().candidates(), text, given)


class PlanSource(Protocol):
    def __call__(self) -> Plan:
        """The newest good plan; PlanError when there is none yet."""
        ...

    def close(self) -> None: ...


class FilePlanSource:
    """A plan file, re-read when its size or mtime changes (a stat per call, no read)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._plan: Plan | None = None

    def __call__(self) -> Plan:
        stat = self.path.stat()
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp != self._stamp or self._plan is None:
            self._stamp = stamp
            self._plan = parse_plan(self.path.read_text(), str(self.path))
        return self._plan

    def close(self) -> None:
        pass


class WatchGoneError(Exception):
    """The API server no longer has the resourceVersion the watch asked from (410): read the object afresh."""


class ConfigMapPlanWatch:
    """The plan ConfigMap, kept current by a watch in a background thread (see the module's doc).

    ``api``: a CoreV1Api (bounded, :class:`~weightsync_agent.kube.BoundedCoreApi`). ``initial``: a plan and the
    resourceVersion it was read at, when the caller read it already (the agent's start)."""

    def __init__(
        self,
        api: Any,
        namespace: str,
        name: str,
        *,
        initial: tuple[Plan, str] | None = None,
        watch_seconds: int = WATCH_SECONDS,
        backoff_first: float = WATCH_BACKOFF_FIRST_SECONDS,
        backoff_max: float = WATCH_BACKOFF_MAX_SECONDS,
        max_plan_bytes: int = MAX_PLAN_BYTES,
        on_reconnect: Callable[[], None] | None = None,
        keys: PlanKeys | None,
    ) -> None:
        """``on_reconnect``: called when the API server answers again after the watch failed (the agent's reporter
        then re-sends its condition: something may have rewritten the pod meanwhile). ``keys``: see
        :func:`plan_of` (required, so that leaving the check out is a decision in the caller)."""
        self.keys = keys
        self.on_reconnect = on_reconnect
        self._failed = False
        self.api = api
        self.max_plan_bytes = max_plan_bytes
        self.namespace = namespace
        self.name = name
        self.watch_seconds = watch_seconds
        self.backoff_first = backoff_first
        self.backoff_max = backoff_max
        self._lock = threading.Lock()
        self._plan: Plan | None = initial[0] if initial else None
        self._version: str | None = initial[1] if initial else None
        self._stop = threading.Event()
        self._response: Any = None
        #: Requests this watch made (reads and watch connections), since start: what it costs the API server.
        self.requests = 0
        #: Plans taken (the first read included) and plans refused.
        self.delivered = 0 if initial is None else 1
        self.refused = 0
        self._thread = threading.Thread(target=self._run, name=f"weightsync-plan-watch-{name}", daemon=True)
        self._thread.start()

    def __call__(self) -> Plan:
        with self._lock:
            if self._plan is None:
                raise PlanError(f"ConfigMap {self.name} not read yet")
            return self._plan

    def wait(self, timeout: float) -> bool:
        """Wait until a plan was read (tests, the stand-in agents); whether one was."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._plan is not None:
                    return True
            self._stop.wait(0.05)
        return False

    def close(self, wait: bool = True) -> None:
        """Stop the watch; ``wait``: until its thread ended (at most 5 s)."""
        self._stop.set()
        response = self._response
        if response is not None:
            interrupt(response)
        if wait:
            self._thread.join(timeout=5)

    # --- The thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        delay = self.backoff_first
        while not self._stop.is_set():
            try:
                if self._version is None:
                    self._relist()
                self._watch_once()
                delay = self.backoff_first
            except WatchGoneError:
                log.info("plan watch: resourceVersion %s is gone; reading ConfigMap %s afresh", self._version,
                         self.name)  # fmt: skip
                self._version = None
            except PlanError as exc:
                self._failed = True
                log.warning("plan watch: %s; retrying in %.1f s", exc, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, self.backoff_max)
            except Exception as exc:  # the API server's refusals, no answer, a cut stream: back off and reconnect
                if self._stop.is_set():
                    return
                self._failed = True
                throttled = throttled_wait(exc)
                wait = delay if throttled is None else throttled
                log.warning("plan watch of ConfigMap %s failed (%s); reconnecting in %.1f s", self.name,
                            describe(exc), wait)  # fmt: skip
                self._stop.wait(wait)
                if throttled is None:
                    delay = min(delay * 2, self.backoff_max)

    def _relist(self) -> None:
        self.requests += 1
        plan, version = read_config_map_plan(self.api, self.namespace, self.name, self.keys)
        self._take(plan)
        self._version = version

    def _watch_once(self) -> None:
        api_error = api_exception()

        seconds = int(self.watch_seconds * (1 + random.random() / 4))
        self.requests += 1
        try:
            response = self.api.list_namespaced_config_map(
                self.namespace,
                field_selector=f"metadata.name={self.name}",
                watch=True,
                allow_watch_bookmarks=True,
                resource_version=self._version,
                timeout_seconds=seconds,
                _preload_content=False,
                _request_timeout=(CONNECT_SECONDS, seconds + WATCH_READ_SLACK_SECONDS),
            )
        except api_error as exc:
            if exc.status == 410:
                raise WatchGoneError from exc
            raise
        self._response = response
        if self._failed:
            self._failed = False
            if self.on_reconnect is not None:
                self.on_reconnect()
        try:
            for event in events(response, MAX_EVENT_BYTES):
                if self._stop.is_set():
                    return
                self._handle(event)
        finally:
            self._response = None
            response.release_conn()

    def _handle(self, event: dict[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise WatchGoneError
            raise PlanError(f"the watch of ConfigMap {self.name} answered {obj.get('code')}: {obj.get('message')}")
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED"):
            try:
                self._take(plan_of(obj.get("data"), self.name, self.keys, self.max_plan_bytes))
            except PlanError as exc:
                self.refused += 1
                log.error("plan watch: refused the new plan, keeping revision %s: %s", self._revision(), exc)
        elif kind == "DELETED":
            log.warning("plan ConfigMap %s was deleted; keeping plan revision %s", self.name, self._revision())
        if version:
            self._version = str(version)

    def _take(self, plan: Plan) -> None:
        with self._lock:
            self._plan = plan
        self.delivered += 1

    def _revision(self) -> str:
        with self._lock:
            return "none" if self._plan is None else str(self._plan.revision)


def interrupt(response: Any) -> None:
    """Wake a thread blocked reading ``response`` by shutting its socket down. Not ``response.close()``: that
    waits for the reader's buffer lock, i.e. until the watch sends something or ends (minutes)."""
    connection = getattr(response, "connection", None) or getattr(response, "_connection", None)
    sock = getattr(connection, "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):
            sock.shutdown(socket.SHUT_RDWR)


def events(response: Any, limit: int) -> Iterator[dict[str, Any]]:
    """The JSON lines of a watch response, each at most ``limit`` bytes (longer: PlanError, the stream is cut)."""
    buffer = b""
    for chunk in response.stream(64 * 1024, decode_content=True):
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if len(line) > limit:
                raise PlanError(f"a watch event of more than {limit} bytes")
            if line.strip():
                yield json.loads(line)
        if len(buffer) > limit:
            raise PlanError(f"a watch event of more than {limit} bytes")
    if buffer.strip():
        yield json.loads(buffer)


def describe(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    return f"{status} {getattr(exc, 'reason', '')}".strip() if status else f"{type(exc).__name__}: {exc}"


def plan_source(
    config: AgentConfig, plan_file: Path | None, keys: PlanKeys, on_reconnect: Callable[[], None] | None = None
) -> PlanSource:
    """What the agent reads its plan from: the file (stat-based) or a watch of the ConfigMap, read once now
    (PlanError, OSError: there is no usable plan to start with)."""
    path = plan_file or (Path(config.plan_file) if config.plan_file else None)
    if path is not None:
        source = FilePlanSource(path)
        source()
        return source
    if not config.plan_config_map:
        raise PlanError(f"no plan: set {names.ENV_PLAN_CONFIG_MAP} or {names.ENV_PLAN_FILE}")
    api = kube_core_api()
    initial = read_config_map_plan(api, config.namespace, config.plan_config_map, keys)
    return ConfigMapPlanWatch(api, config.namespace, config.plan_config_map, initial=initial,
                              on_reconnect=on_reconnect, keys=keys)  # fmt: skip
