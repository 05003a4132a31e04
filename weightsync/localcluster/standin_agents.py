"""Stand-in agents for the scale benchmark: every pod's agent API calls, from one process, and nothing else.

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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightsync.api import names
from weightsync.localcluster.cluster import ClusterState
from weightsync.localcluster.pki import Pki
from weightsync_agent.kube import BoundedCoreApi
from weightsync_agent.plan_loader import ConfigMapPlanWatch, events
from weightsync_agent.sidecar.report import PodReporter

log = logging.getLogger("weightsync.bench.standin")

#: A stand-in's threads (plan watch, reporter) need little stack; 1,000 pods would otherwise reserve 16 GiB.
THREAD_STACK_BYTES = 512 * 1024
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
    watch = ConfigMapPlanWatch(api, namespace, names.plan_config_map(group))
    reporter = PodReporter(api, namespace, name)
    # What the real agent advertises at its start (a fake address: nothing answers there).
    first_of_engine = role == "engine" and name.endswith("-0")
    if role == "trainer" or first_of_engine:
        reporter.annotate({names.ANNOTATION_AGENT_URL: f"http://{name}.standin.invalid:8500"})
    if first_of_engine:
        reporter.annotate({names.ANNOTATION_ENGINE_URL: f"http://{name}.standin.invalid:30000"})
    return StandIn(name, role, watch, reporter, "SourcesBuilt" if role == "trainer" else "EngineServing")


class Kubelet:
    """Starts a stand-in agent for every running pod of the group in ``namespace`` (see the module's doc)."""

    def __init__(self, state: ClusterState, admin_api: Any, namespace: str, *, workers: int = 16) -> None:
        self.state = state
        self.admin = admin_api
        self.namespace = namespace
        self.agents: dict[str, StandIn] = {}
        self._uids: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="standin-start")
        self._threads: list[threading.Thread] = []
        self.token_seconds: list[float] = []
        self.errors: list[str] = []

    def start(self) -> None:
        threading.stack_size(THREAD_STACK_BYTES)
        for target, name in ((self._watch_pods, "standin-kubelet"), (self._tick, "standin-tick")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            agents, self.agents = list(self.agents.values()), {}
        with ThreadPoolExecutor(32) as closing:
            list(closing.map(StandIn.close, agents))

    def ready(self) -> int:
        with self._lock:
            return sum(1 for a in self.agents.values() if a.reported_ready)

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
                    agent = self.agents.pop(name, None)
                    if agent is not None:
                        self._pool.submit(agent.close)
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
            agent = start_standin(self.state, pod, token)
        except Exception as exc:
            self.errors.append(f"{meta['name']}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
            return
        with self._lock:
            if self._uids.get(meta["name"]) == meta["uid"]:
                self.agents[meta["name"]] = agent
                return
        agent.close()  # the pod went while its agent started

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

    def _tick(self) -> None:
        while not self._stop.wait(TICK_SECONDS):
            with self._lock:
                agents = list(self.agents.values())
            for agent in agents:
                agent.tick()
