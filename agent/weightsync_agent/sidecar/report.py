"""Reporting through the agent's own pod: the readiness-gate condition and annotations.

Agents never write the group's status (the operator is its only writer); they touch only their own
pod, which their Role allows and nothing more.

Reporting is never on a round's path. A round's result must not wait for the API server (hung, restarting, or
throttling): :class:`PodReporter` keeps the *latest* value of each annotation and of the condition, and one
background thread patches them, retrying with backoff until the API server takes them. So a round finishes in
its budget during an outage, and its result reaches the pod (and from there the group's status) when the API
server is back; a later value of the same key replaces an earlier one that was never sent.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time
from typing import Any, Final

from weightsync.api import names
from weightsync_agent.kube import api_exception, throttled_wait, transport_errors

log = logging.getLogger("weightsync.agent")

#: First and largest pause between attempts while the API server refuses or does not answer.
RETRY_FIRST_SECONDS: Final = 0.5
RETRY_MAX_SECONDS: Final = 10.0
#: How often the last condition is sent again although nothing changed: whatever rewrote the pod's status
#: meanwhile (a node agent that re-lists pods after an API server restart, a human), the gate says what the
#: agent says within this time. Every change is sent at once; this is only the repair of someone else's write,
#: which is rare, so it is slow: at 30 s, a 1,024-pod group's idle agents sent 34 patches/s for nothing
#: (3.3 per 100 pods, over the 1/s per 100 pods the control plane is held to; docs/agent.md, "Idle API traffic").
RESYNC_SECONDS: Final = 600.0
#: After the API server was away (a patch failed, or the plan watch lost its connection:
#: :meth:`PodReporter.resync_soon`) the condition is sent at once and then every this many seconds for
#: :data:`RECOVERING_SECONDS`: that is when something else rewrites pods' status (kwok re-lists pods after an API
#: server restart, later than the agents reconnect), so the repair is as prompt as the old 30 s resync where it
#: matters, and costs nothing while idle.
RESYNC_RECOVERING_SECONDS: Final = 30.0
RECOVERING_SECONDS: Final = 300.0
#: 4xx answers that are plainly transient (a timeout, a conflict, throttling): retried like an unreachable API
#: server. Other refusals are retried too, with backoff up to REFUSED_SLOWDOWN times longer.
RETRIED_STATUSES: Final = frozenset({408, 409, 429})
REFUSED_SLOWDOWN: Final = 6

AnnotationValue = str | dict[str, Any] | int | None


def ready_condition(ready: bool, reason: str, message: str = "") -> dict[str, Any]:
    return {
        "type": names.CONDITION_AGENT_READY,
        "status": "True" if ready else "False",
        "reason": reason,
        "message": message,
        "lastTransitionTime": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def encode_annotations(values: dict[str, AnnotationValue]) -> dict[str, str | None]:
    """Annotation values as the API takes them: dicts as compact JSON, None removes the key."""
    return {
        key: (json.dumps(v, separators=(",", ":")) if isinstance(v, dict) else (None if v is None else str(v)))
        for key, v in values.items()
    }


def api_message(exc: Any, limit: int = 300) -> str:
    """The API server's own message in an error answer (a Status object), cut short."""
    try:
        message = str(json.loads(exc.body).get("message", ""))
    except (TypeError, ValueError, AttributeError):
        message = str(getattr(exc, "body", "") or "")
    return message[:limit]


class PodReporter:
    """Patches one pod (the agent's own) through the Kubernetes API, from a background thread.

    ``set_ready`` and ``annotate`` return at once; :meth:`flush` waits until everything asked so far is on the
    pod (or a timeout), :meth:`close` flushes briefly and stops the thread.
    """

    def __init__(
        self,
        core_api: Any,
        namespace: str,
        pod: str,
        *,
        retry_first: float = RETRY_FIRST_SECONDS,
        retry_max: float = RETRY_MAX_SECONDS,
        resync: float = RESYNC_SECONDS,
    ) -> None:
        self.api = core_api
        self.namespace = namespace
        self.pod = pod
        self.retry_first = retry_first
        self.retry_max = retry_max
        self.resync = resync
        #: The condition last on the pod, re-sent every ``resync`` seconds (its transition time kept).
        self._delivered: dict[str, Any] | None = None
        self._delivered_at = 0.0
        #: Until when (monotonic) the API server counts as just back: resync every RESYNC_RECOVERING_SECONDS.
        self._recovering_until = 0.0
        self._changed = threading.Condition()
        self._annotations: dict[str, str | None] = {}
        self._condition: dict[str, Any] | None = None
        self._sending = False
        self._closed = False
        #: Patches the API server refused or did not answer, since start (for logs and tests).
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name=f"weightsync-report-{pod}", daemon=True)
        self._thread.start()

    # --- What callers ask ----------------------------------------------------------------------------

    def set_ready(self, ready: bool, reason: str, message: str = "") -> None:
        with self._changed:
            self._condition = ready_condition(ready, reason, message)
            self._changed.notify_all()

    def resync_soon(self) -> None:
        """The API server was away: send the condition again now, and often for a while (see RECOVERING_SECONDS)."""
        with self._changed:
            self._recovering_until = time.monotonic() + RECOVERING_SECONDS
            self._delivered_at = -float("inf")
            self._changed.notify_all()

    def _resync_period(self) -> float:
        return min(self.resync, RESYNC_RECOVERING_SECONDS) if time.monotonic() < self._recovering_until else self.resync

    def annotation(self, key: str) -> str | None:
        """One annotation of the agent's own pod, as the API server has it now (bounded: ``kube.BoundedCoreApi``;
        a hung API server must not hold the coordinator's start)."""
        found = self.api.read_namespaced_pod(self.pod, self.namespace)
        value = (found.metadata.annotations or {}).get(key)
        return None if value is None else str(value)

    def annotate(self, values: dict[str, AnnotationValue]) -> None:
        with self._changed:
            self._annotations.update(encode_annotations(values))
            self._changed.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every value asked so far is on the pod; False if the API server did not take them in time."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._busy():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def close(self, flush_seconds: float = 2.0) -> None:
        self.flush(flush_seconds)
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join(timeout=flush_seconds + 1)

    # --- The sender ------------------------------------------------------------------------------------

    def _busy(self) -> bool:
        return self._sending or bool(self._annotations) or self._condition is not None

    def _run(self) -> None:
        api_error = api_exception()

        delay = self.retry_first
        while True:
            with self._changed:
                while not self._closed and not self._annotations and self._condition is None:
                    if self._delivered is not None:
                        left = self._delivered_at + self._resync_period() - time.monotonic()
                        if left <= 0:
                            self._condition = self._delivered
                            break
                        self._changed.wait(left)
                    else:
                        self._changed.wait()
                if self._closed:
                    return
                annotations, self._annotations = self._annotations, {}
                condition, self._condition = self._condition, None
                self._sending = True
            try:
                self._send(annotations, condition)
            except api_error as exc:
                if exc.status == 404:
                    # The pod is gone (this agent is about to be stopped): nothing to report on.
                    log.error("pod %s is gone; report dropped: %s", self.pod,
                              {"annotations": annotations, "condition": condition})  # fmt: skip
                    with self._changed:
                        self._sending = False
                        self._changed.notify_all()
                    continue
                # Refusals are retried too, more slowly: some are transient although 4xx (right after an API server
                # restart, an admission policy whose params' CRD is not discovered yet answers 422).
                cause = f"{exc.status} {exc.reason}: {api_message(exc)}"
                throttled = throttled_wait(exc)
                if throttled is not None:  # shed by the API server: back after its hint, the backoff not grown
                    self._retry_later(annotations, condition, cause, throttled)
                    continue
                refused = exc.status is not None and exc.status < 500 and exc.status not in RETRIED_STATUSES
                delay = self._retry_later(annotations, condition, cause, delay, refused=refused)
                continue
            except transport_errors() as exc:
                delay = self._retry_later(annotations, condition, exc, delay)
                continue
            delay = self.retry_first
            with self._changed:
                if condition is not None:
                    self._delivered, self._delivered_at = condition, time.monotonic()
                self._sending = False
                self._changed.notify_all()

    def _retry_later(
        self,
        annotations: dict[str, str | None],
        condition: dict[str, Any] | None,
        cause: object,
        delay: float,
        *,
        refused: bool = False,
    ) -> float:
        """Put back what failed (under anything newer), wait ``delay`` (or until closed); the next delay."""
        self.failures += 1
        self._recovering_until = time.monotonic() + RECOVERING_SECONDS
        level = logging.ERROR if refused else logging.WARNING
        log.log(level, "reporting on pod %s failed (retrying in %.1f s): %s", self.pod, delay, cause)
        with self._changed:
            self._delivered_at = time.monotonic()
            self._annotations = {**annotations, **self._annotations}
            if self._condition is None:
                self._condition = condition
            self._sending = False
            self._changed.notify_all()
            self._changed.wait_for(lambda: self._closed, timeout=delay)
        return min(delay * 2, self.retry_max * (REFUSED_SLOWDOWN if refused else 1))

    def _send(self, annotations: dict[str, str | None], condition: dict[str, Any] | None) -> None:
        if condition is not None:
            # Pod status conditions merge by type under a strategic-merge patch, so this leaves the
            # kubelet's (or kwok's) own conditions alone.
            status = {"status": {"conditions": [condition]}}
            _discard(self.api.patch_namespaced_pod_status(self.pod, self.namespace, status, _preload_content=False))
        if annotations:
            meta = {"metadata": {"annotations": annotations}}
            _discard(self.api.patch_namespaced_pod(self.pod, self.namespace, meta, _preload_content=False))


def _discard(response: Any) -> None:
    """Read and drop a patch's answer (the whole pod, which the reporter never looks at): decoding it into the
    client's models cost more CPU than the request itself. An error status raised before this point."""
    try:
        response.read()
    finally:
        response.release_conn()
