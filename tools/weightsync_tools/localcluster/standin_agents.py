"""Stand-in agents for the scale benchmark: every pod's agent API calls, from a few worker processes, and nothing else.

These are **stand-ins**: no Mooncake, no engines, no rounds. What they keep of a real agent is exactly its traffic to
the API server, made by the agent's own code so that it cannot drift from it:

* the plan watch (:class:`~weightsync_agent.plan_loader.ConfigMapPlanWatch`, the real agent's),
* its reports on its own pod (:class:`~weightsync_agent.sidecar.report.PodReporter`, the real agent's): the
  advertised URLs as annotations (trainer pods and each engine's first pod, as ``AgentRuntime.start`` and
  ``EngineAgent.check`` send them) and the ``weightsync.io/agent-ready`` condition once the plan is read,

each with that pod's own credential: a ServiceAccount token bound to the pod (a TokenRequest with
``boundObjectRef``, what the kubelet projects into the agent container), so RBAC and the chart's admission policy
see what they see from real agents. :class:`Kubelet` plays the node's part: it watches the group's pods and starts
a stand-in when a pod runs (minting its token), and stops it when the pod goes.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import queue
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from weightsync.api import names
from weightsync_agent.kube import BoundedCoreApi
from weightsync_agent.plan_loader import ConfigMapPlanWatch, events
from weightsync_agent.sidecar.report import PodReporter
from weightsync_tools.localcluster.cluster import ClusterState
from weightsync_tools.localcluster.pki import Pki

log = logging.getLogger("weightsync.bench.standin")

#: A stand-in's threads (plan watch, reporter) need little stack; 1,000 pods would otherwise reserve 16 GiB.
THREAD_STACK_BYTES = 512 * 1024
#: The workers' GIL switch interval (Python's default: 5 ms). When a plan change reaches a worker's ~128 watch
#: threads at once, every waiting thread wakes each interval to ask for the lock: at 5 ms that hand-off alone
#: kept the 8 workers at ~2 cores for ~9 s of a scale-out (18 CPU-s for 1,024 plan reads of ~1.5 ms each), cost
#: a real agent, alone in its process on its own node, never pays.
SWITCH_INTERVAL_SECONDS = 0.05
#: The stand-ins' tick: how often one thread looks whether a pod's plan arrived (the real agent ticks every 2 s,
#: but reports readiness as soon as its first tick after the start; its start reads the plan synchronously).
TICK_SECONDS = 0.2


def api_client(state: ClusterState, token: str) -> Any:
    """A CoreV1Api for the local cluster with a bearer token, every call bounded as the agent's are."""
    from kubernetes import client

    config = client.Configuration()
    config.host = state.server
    config.ssl_ca_cert = str(Pki(Path(state.directory) / "pki").ca_cert)
    config.api_key = {"authorization": f"Bearer {token}"}
    config.connection_pool_maxsize = 4
    return BoundedCoreApi(client.CoreV1Api(client.ApiClient(config)))


@dataclass
class StandIn:
    """One pod's stand-in agent."""

    pod: str
    role: str
    watch: ConfigMapPlanWatch
    reporter: PodReporter
    ready_reason: str
    reported_ready: bool = False

    def tick(self) -> None:
        if self.reported_ready:
            return
        try:
            plan = self.watch()
        except Exception:
            return
        self.reporter.set_ready(True, self.ready_reason, f"stand-in agent; plan revision {plan.revision}")
        self.reported_ready = True

    def close(self) -> None:
        """Stop at once (the pod is gone or the bench ends): a thousand closes must not take minutes."""
        self.watch.close(wait=False)
        self.reporter.close(flush_seconds=0.0)


def start_standin(state: ClusterState, pod: dict[str, Any], token: str) -> StandIn:
    meta = pod["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    labels = meta.get("labels") or {}
    role = labels.get(names.LABEL_ROLE, "")
    group = labels.get(names.LABEL_GROUP, "")
    api = api_client(state, token)
    # A stand-in holds no group token (it only loads the API server as agents do): it takes the plan unsealed.
    watch = ConfigMapPlanWatch(api, namespace, names.plan_config_map(group), keys=None)
    reporter = PodReporter(api, namespace, name)
    # What the real agent advertises at its start (a fake address: nothing answers there).
    first_of_engine = role == "engine" and name.endswith("-0")
    if role == "trainer" or first_of_engine:
        reporter.annotate({names.ANNOTATION_AGENT_URL: f"http://{name}.standin.invalid:8500"})
    if first_of_engine:
        reporter.annotate({names.ANNOTATION_ENGINE_URL: f"http://{name}.standin.invalid:30000"})
    return StandIn(name, role, watch, reporter, "SourcesBuilt" if role == "trainer" else "EngineServing")


class Kubelet:
    """Starts a stand-in agent for every running pod of the group in ``namespace`` (see the module's doc).

    The stand-ins live in ``processes`` worker processes (a pod's by its name's hash), not in this one: a real
    agent is a process on its own node, and a thousand agents' watch threads in one interpreter spent their time
    handing its lock around (a plan change cost ~70 CPU-seconds there, and the scale-out measured that, not the
    operator). This process keeps the node's part: the pod watch and the tokens."""

    def __init__(
        self, state: ClusterState, admin_api: Any, namespace: str, *, workers: int = 16, processes: int = 8
    ) -> None:
        self.state = state
        self.admin = admin_api
        self.namespace = namespace
        self._uids: dict[str, str] = {}
        self._ready: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="standin-start")
        self._threads: list[threading.Thread] = []
        self._context = multiprocessing.get_context("spawn")  # never fork a process with threads
        self._outbox: Any = self._context.Queue()
        self._inboxes: list[Any] = [self._context.Queue() for _ in range(max(1, processes))]
        self._workers: list[Any] = []
        self.token_seconds: list[float] = []
        self.errors: list[str] = []

    def start(self) -> None:
        for inbox in self._inboxes:
            worker = self._context.Process(
                target=_worker_main, args=(asdict(self.state), inbox, self._outbox), daemon=True
            )
            worker.start()
            self._workers.append(worker)
        threading.stack_size(THREAD_STACK_BYTES)
        for target, name in ((self._watch_pods, "standin-kubelet"), (self._collect, "standin-collect")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for inbox in self._inboxes:
            inbox.put(("exit", None, None))
        for worker in self._workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
        self._workers = []

    def ready(self) -> int:
        with self._lock:
            return len(self._ready)

    def _inbox(self, name: str) -> Any:
        return self._inboxes[zlib.crc32(name.encode()) % len(self._inboxes)]

    def _collect(self) -> None:
        """The workers' news: a stand-in reported ready, or failed to start."""
        while not self._stop.is_set():
            try:
                kind, name, detail = self._outbox.get(timeout=0.5)
            except queue.Empty:
                continue
            with self._lock:
                if kind == "ready" and name in self._uids:
                    self._ready.add(name)
                elif kind == "error":
                    self.errors.append(f"{name}: {detail}")

    # --- The node's part ---------------------------------------------------------------------------

    def _watch_pods(self) -> None:
        """List, then watch, the namespace's group pods as raw JSON (the client's models cost ~1 ms a pod to build,
        which on a 2-core machine would be the bench's own noise)."""
        version: str | None = None
        selector = names.LABEL_GROUP
        while not self._stop.is_set():
            try:
                if version is None:
                    response = self.admin.list_namespaced_pod(self.namespace, label_selector=selector,
                                                              _preload_content=False)  # fmt: skip
                    listed = json.loads(response.data)
                    version = listed["metadata"]["resourceVersion"]
                    for pod in listed["items"]:
                        self._seen(pod, "ADDED")
                response = self.admin.list_namespaced_pod(
                    self.namespace, label_selector=selector, watch=True, resource_version=version,
                    timeout_seconds=60, _preload_content=False, _request_timeout=(3, 75),
                )  # fmt: skip
                try:
                    for event in events(response, 16 << 20):
                        if self._stop.is_set():
                            return
                        if event.get("type") == "ERROR":
                            raise RuntimeError(f"pod watch: {event.get('object')}")
                        pod = event["object"]
                        version = pod["metadata"]["resourceVersion"]
                        if event.get("type") != "BOOKMARK":
                            self._seen(pod, str(event["type"]))
                finally:
                    response.release_conn()
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.info("pod watch: %s; listing again", exc)
                version = None
                self._stop.wait(0.5)

    def _seen(self, pod: dict[str, Any], kind: str) -> None:
        meta = pod["metadata"]
        name, uid = meta["name"], meta["uid"]
        gone = kind == "DELETED" or meta.get("deletionTimestamp")
        with self._lock:
            known = self._uids.get(name)
            if gone:
                if known == uid:
                    del self._uids[name]
                    self._ready.discard(name)
                    self._inbox(name).put(("stop", name, None))
                return
            running = (pod.get("status") or {}).get("phase") == "Running"
            if not running or known == uid:
                return
            self._uids[name] = uid
        self._pool.submit(self._launch, pod)

    def _launch(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        try:
            started = time.monotonic()
            token = self._token(pod)
            self.token_seconds.append(time.monotonic() - started)
        except Exception as exc:
            self.errors.append(f"{meta['name']}: {_first_line(exc)}")
            return
        with self._lock:
            if self._uids.get(meta["name"]) != meta["uid"]:
                return  # the pod went while its token was minted
        self._inbox(meta["name"]).put(("start", _pod_summary(pod), token))

    def _token(self, pod: dict[str, Any]) -> str:
        """A token bound to the pod, as the kubelet requests it for the projected volume."""
        meta = pod["metadata"]
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": 7200,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]},
            },
        }
        answer = self.admin.create_namespaced_service_account_token(
            pod["spec"]["serviceAccountName"], meta["namespace"], body
        )
        return str(answer.status.token)


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _pod_summary(pod: dict[str, Any]) -> dict[str, Any]:
    """What a worker needs of a pod to start its stand-in (the whole pod would be pickled for nothing)."""
    meta = pod["metadata"]
    return {"metadata": {"name": meta["name"], "namespace": meta["namespace"], "labels": meta.get("labels") or {}}}


def _worker_main(state: dict[str, Any], inbox: Any, outbox: Any) -> None:
    """One worker process: starts, ticks and stops the stand-ins of the pods the kubelet sends it."""
    threading.stack_size(THREAD_STACK_BYTES)
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    # A thousand stand-ins would each log a plan ConfigMap's deletion: only their errors are shown (a spawned
    # process does not inherit the bench's logging levels).
    logging.getLogger("weightsync.agent").setLevel(logging.ERROR)
    cluster = ClusterState(**{k: v for k, v in state.items() if k != "processes"})
    agents: dict[str, StandIn] = {}
    lock = threading.Lock()
    starting = ThreadPoolExecutor(8, thread_name_prefix="standin-start")
    stopping = ThreadPoolExecutor(8, thread_name_prefix="standin-stop")

    def launch(pod: dict[str, Any], token: str) -> None:
        name = pod["metadata"]["name"]
        try:
            agent = start_standin(cluster, pod, token)
        except Exception as exc:
            outbox.put(("error", name, _first_line(exc)))
            return
        with lock:
            old, agents[name] = agents.get(name), agent
        if old is not None:
            stopping.submit(old.close)

    # Messages: ("start", pod summary, token), ("stop", pod name, None), ("exit", None, None).
    while True:
        try:
            kind, subject, token = inbox.get(timeout=TICK_SECONDS)
        except queue.Empty:
            kind = None
        if kind == "exit":
            break
        if kind == "start":
            starting.submit(launch, subject, token)
        elif kind == "stop":
            with lock:
                agent = agents.pop(subject, None)
            if agent is not None:
                stopping.submit(agent.close)
        with lock:
            current = list(agents.values())
        for agent in current:
            if not agent.reported_ready:
                agent.tick()
                if agent.reported_ready:
                    outbox.put(("ready", agent.pod, None))
    starting.shutdown(wait=True, cancel_futures=True)
    with lock:
        current, agents = list(agents.values()), {}
    list(stopping.map(StandIn.close, current))
    stopping.shutdown(wait=True)
