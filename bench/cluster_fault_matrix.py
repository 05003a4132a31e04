"""The fault matrix's Kubernetes faults (issue 26), on the local cluster: pods deleted and evicted, the API server
restarted and hung, each at every phase of a round, with the same invariants as ``bench/fault_matrix.py`` and the
group's status as the real operator folds it (a benchmark, not a test; docs/faults.md).

The cluster is the end-to-end tier's (``LocalCluster``: kube-apiserver, etcd, kwok, controller-manager, scheduler
built from Go modules; the chart installed with helm; the operator as a process with its ServiceAccount's token).
One group from ``examples/tcp-group.yaml`` (2 trainer pods -> 2 reference engines x TP 2, live p2p rounds,
``timeoutSeconds`` from ``--timeout``): every pod's agent runs as a local process bound to its pod, and each engine
pod's engine behind a :class:`~weightsync_testing.http_gate.Gate`, which places the fault at a phase as the loopback
matrix does. Faults:

- ``engine-pod-delete``: engine 1's pod deleted (its containers stopped, as a kubelet stops them); after the round the
  operator's new pod gets an agent and an engine (initial weights), caught up by the next round or a catch-up;
- ``engine-pod-evict``: the same through the Eviction API (``pods/eviction``, what a node drain does);
- ``trainer-pod-delete``: trainer pod 1 (a source) deleted; its new pod's agent rebuilds the replica;
- ``apiserver-restart``: the API server stopped at the phase and started again at once (its ports refuse meanwhile);
- ``apiserver-hang``: the API server SIGSTOPped (accepts, never answers) from the phase to the round's end.

Per cell as in the loopback matrix: the faulted round, the fault removed (the pod recreated and its processes
started: its engine answering, or its agent's replica built; the API server back), one status period, the group
observed (engines directly; the coordinator's committed version; ``status.conditions[Ready]`` from the API server),
the next version published (3 times at most), observed again.

    python bench/cluster_fault_matrix.py [--faults engine-pod-delete,apiserver-hang] [--phases verify] [--json]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml
from fault_matrix import (
    BUCKET_MIB,
    PLACES,
    RECOVERY_ROUNDS,
    TP,
    Once,
    Outcome,
    cell_arguments,
    chosen_cells,
    finish,
    held_label,
    progress,
    state,
)

from weightsync.api import names
from weightsync_agent.rounds.remote import AgentClient
from weightsync_testing.engine_harness import ReferenceEngines, StartedEngine
from weightsync_testing.fault_matrix import PHASES, CellRun, EngineView, Snapshot, judge
from weightsync_testing.http_gate import Gate, GatedEngines
from weightsync_testing.trainer_ranks import publish_all
from weightsync_tools.localcluster import binaries as binaries_mod
from weightsync_tools.localcluster.cluster import ClusterState, LocalCluster
from weightsync_tools.localcluster.session import (
    Agents,
    Kube,
    OperatorProcess,
    PodCredentials,
    group_pods,
    install_chart,
    secret_reader,
    token_kubeconfig,
    wait_for,
)

REPO = Path(__file__).resolve().parents[1]
NS = "faults"
GROUP = "matrix"
SYSTEM_NS = "weightsync-system"
ENGINE = 1
SOURCE = 1
TRAINERS = [names.trainer_pod(GROUP, i) for i in range(2)]
ENGINES = [names.engine_pod(GROUP, e, 0) for e in range(2)]
#: One status period on a cluster: the agents' tick (1 s here), their pod patch, the operator's reconcile of it.
STATUS_PERIOD = 6.0
#: How long a recreated trainer pod's agent may take to build its replica again.
READY_AGAIN = 90.0

FAULTS: dict[str, tuple[str, ...]] = {
    "engine-pod-delete": PHASES,
    "engine-pod-evict": PHASES,
    "trainer-pod-delete": PHASES,
    "apiserver-restart": PHASES,
    "apiserver-hang": PHASES,
}


class RecordingGatedEngines(GatedEngines, ReferenceEngines):
    """Gated reference engines that remember what each engine index last started as (its gate's URL)."""

    def __init__(self) -> None:
        super().__init__()
        self.started: dict[int, StartedEngine] = {}

    def start(self, engine: int, spec: Any, seed: int, **options: Any) -> StartedEngine:
        started = super().start(engine, spec, seed, **options)
        self.started[engine] = started
        return started


class ClusterMatrix:
    def __init__(self, local: LocalCluster, cluster: ClusterState, admin: Kube, agents: Agents,
                 harness: RecordingGatedEngines, budget: float) -> None:  # fmt: skip
        self.local, self.cluster, self.admin, self.agents, self.harness = local, cluster, admin, agents, harness
        self.budget = budget
        self.labels: list[str] = ["default"]
        self.token = secret_reader(admin)(NS, names.group_secret(GROUP), names.SECRET_TOKEN_KEY)

    @property
    def gate(self) -> Gate:
        return self.harness.gates[ENGINE]

    # --- Faults --------------------------------------------------------------------------------------

    def pod(self, name: str) -> dict[str, Any]:
        return group_pods(self.admin, NS, GROUP)[name]

    def delete(self, name: str, *, evict: bool) -> str:
        """Stop ``name``'s containers and remove the pod (deleted, or evicted); returns the old pod's uid."""
        uid = str(self.pod(name)["metadata"]["uid"])
        self.agents.stop(name)  # a kubelet stops the containers of a pod being deleted
        if evict:
            eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": NS}}
            self.admin.kubectl("create", "--raw", f"/api/v1/namespaces/{NS}/pods/{name}/eviction", "-f", "-",
                               input=json.dumps(eviction))  # fmt: skip
        else:
            self.admin.kubectl("-n", NS, "delete", "pod", name, "--wait=false")
        return uid

    def recreated(self, name: str, old_uid: str) -> None:
        """The operator's new pod ``name`` gets its processes (as a kubelet starts its containers)."""

        def new_pod() -> dict[str, Any] | None:
            pod = group_pods(self.admin, NS, GROUP).get(name)
            fresh = pod is not None and pod["metadata"]["uid"] != old_uid and pod.get("status", {}).get("podIP")
            return pod if fresh else None

        self.agents.start(wait_for(f"{name} recreated", new_pod, timeout=90))
        if name in ENGINES:  # its engine up (initial weights): what the status says of it is then the agents' to tell
            engine = ENGINES.index(name)
            wait_for(f"{name}'s engine", lambda: self.view(engine).answers, timeout=60)
        else:  # its agent built the replica again
            self.agents.client(name, timeout=READY_AGAIN).close()

    def ready(self) -> bool:
        status = self.admin.json("-n", NS, "get", "wsg", GROUP).get("status") or {}
        return status.get("phase") == "Ready"

    @contextmanager
    def placed(self, fault: str, phase: str, notes: list[str]) -> Iterator[None]:
        when, route = PLACES[phase]
        arm = self.gate.before if when == "before" else self.gate.after
        removed: dict[str, Any] = {}
        background: list[threading.Thread] = []
        action: Callable[[], None]
        if fault in ("engine-pod-delete", "engine-pod-evict", "trainer-pod-delete"):
            name = ENGINES[ENGINE] if fault.startswith("engine-") else TRAINERS[SOURCE]

            def remove() -> None:
                # Before the held call goes on: the round meets the pod gone (its engine's call answers 502).
                began = time.monotonic()
                removed[name] = self.delete(name, evict=fault == "engine-pod-evict")
                notes.append(f"{name} stopped and deleted in {time.monotonic() - began:.1f} s")

            action = remove
        elif fault == "apiserver-restart":

            def restart() -> None:
                def go() -> None:
                    self.local.stop_component(self.cluster, "kube-apiserver")
                    self.local.start_component(self.cluster, "kube-apiserver")

                thread = threading.Thread(target=go)
                thread.start()
                background.append(thread)

            action = restart
        elif fault == "apiserver-hang":
            action = lambda: self.local.freeze(self.cluster, "kube-apiserver")  # noqa: E731
        else:
            raise ValueError(fault)
        hook = Once(action)
        arm(route, hook)
        try:
            yield
        finally:
            self.gate.before(route, None)
            self.gate.after(route, None)
            if hook.fired and not hook.done.wait(120):  # a round that gave up meanwhile must not outrun the fault
                notes.append("the fault's action did not finish in 120 s")
            if fault == "apiserver-hang" and hook.fired:
                self.local.thaw(self.cluster, "kube-apiserver")
            for thread in background:
                thread.join(120)
            if "kube-apiserver" in self.local.dead(self.cluster):  # a restart failed half-way: the next cell needs it
                notes.append("the API server had to be started again")
                self.local.start_component(self.cluster, "kube-apiserver")
            for name, uid in removed.items():
                self.recreated(name, uid)
            if not hook.fired:
                notes.append("the fault never fired: the round did not reach its route")

    # --- Rounds and observations ---------------------------------------------------------------------

    def publish(self, version: int) -> Outcome:
        label = str(version)
        if label not in self.labels:
            self.labels.append(label)
        wait = 3 * self.budget + 60
        clients = [self.agents.client(pod, timeout=READY_AGAIN) for pod in TRAINERS]
        started = time.monotonic()
        try:
            outcome = publish_all(clients, state(label, 0), version, timeout=wait + 30, publish_timeout=wait)[0]
        finally:
            for client in clients:
                client.close()
        return Outcome.heard(outcome, started)

    def view(self, engine: int) -> EngineView:
        started = self.harness.started.get(engine)
        try:
            assert started is not None
            client = started.client(timeout=10)
            status = client.status()
            sums = [tuple(client.checksums(rank, BUCKET_MIB << 20)) for rank in range(TP)]
        except Exception:  # a stopped engine: it answers nothing
            return EngineView(engine, answers=False)
        held = held_label(self.labels, engine, sums)
        return EngineView(engine, True, str(status["weight_version"]), bool(status["paused"]), held)

    def committed(self) -> int | None:
        url = f"http://127.0.0.1:{self.agents.envs[TRAINERS[0]][names.ENV_AGENT_PORT]}"
        value = AgentClient(url, timeout=10, token=self.token).state()["committed"]
        return None if value is None else int(value)

    def snapshot(self) -> Snapshot:
        engines = tuple(self.view(e) for e in range(len(ENGINES)))
        status = self.admin.json("-n", NS, "get", "wsg", GROUP).get("status") or {}
        ready = next((c for c in status.get("conditions", []) if c.get("type") == "Ready"), {})
        return Snapshot(engines, self.committed(), str(ready.get("status", "Unknown")), str(ready.get("reason", "")))

    def cell(self, fault: str, phase: str) -> CellRun:
        version = (self.committed() or 0) + 1
        notes: list[str] = []
        with self.placed(fault, phase, notes):
            faulted = self.publish(version)
        time.sleep(STATUS_PERIOD)
        after = self.snapshot()
        rounds, recovery = 1, self.publish(version + 1)
        while recovery.result != "Succeeded" and rounds < RECOVERY_ROUNDS:
            notes.append(f"recovery round {rounds}: {recovery.reason}")
            time.sleep(STATUS_PERIOD)
            rounds, recovery = rounds + 1, self.publish(version + 1)
        time.sleep(STATUS_PERIOD)
        recovered = self.snapshot()
        peer = {"engine-pod-delete": f"engine {ENGINE}", "engine-pod-evict": f"engine {ENGINE}",
                "trainer-pod-delete": f"source {SOURCE}"}.get(fault, f"engine {ENGINE}")  # fmt: skip
        run = CellRun(fault, phase, peer, version, self.budget, faulted.result, faulted.reason, faulted.seconds,
                      faulted.committed, faulted.engines_paused, after, recovered, recovery.result, rounds,
                      "; ".join(notes))  # fmt: skip
        return replace(run, verdicts=judge(run))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    cell_arguments(parser, FAULTS)
    parser.add_argument("--workdir", type=Path, help="the cluster's and agents' files (default: a temporary folder)")
    args = parser.parse_args(argv)
    cells = chosen_cells(parser, args, FAULTS)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ws-cluster-matrix-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    runs: list[CellRun] = []
    local = LocalCluster(workdir / "cluster", binaries_mod.ensure())
    harness = RecordingGatedEngines()
    operator: OperatorProcess | None = None
    agents: Agents | None = None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the cluster and every process stop
    try:
        cluster = local.up(nodes=4)
        local.supervise(cluster)
        admin = Kube(cluster.kubeconfig, local.binaries)
        install_chart(admin, release="weightsync", namespace=SYSTEM_NS)
        deployment = admin.json("-n", SYSTEM_NS, "get", "deployment", "-l", "app.kubernetes.io/instance=weightsync")
        account = deployment["items"][0]["spec"]["template"]["spec"]["serviceAccountName"]
        kubeconfig = token_kubeconfig(cluster, admin, SYSTEM_NS, account, workdir / "operator.kubeconfig")
        operator = OperatorProcess(kubeconfig, workdir / "operator.log")
        operator.start()
        admin.kubectl("create", "namespace", NS)
        group = yaml.safe_load((REPO / "examples" / "tcp-group.yaml").read_text())
        group["metadata"].update(name=GROUP, namespace=NS)
        group["spec"]["transfer"].update(timeoutSeconds=args.timeout, bucketSizeMiB=BUCKET_MIB)
        admin.kubectl("apply", "-f", "-", input=yaml.safe_dump(group))
        wait_for("the group's pods", lambda: set(group_pods(admin, NS, GROUP)) == {*TRAINERS, *ENGINES}, timeout=90)
        wait_for("the agents' ServiceAccount", lambda: admin.kubectl(
            "-n", NS, "get", "sa", names.agent_service_account(GROUP), check=False).returncode == 0)  # fmt: skip
        from weightsync.api.v1alpha1 import WeightSyncGroupSpec

        spec = WeightSyncGroupSpec.model_validate(group["spec"])
        agents = Agents(PodCredentials(cluster, admin, workdir / "kubeconfigs"), workdir, secrets=secret_reader(admin),
                        engines=(harness, spec))  # fmt: skip
        for pod in group_pods(admin, NS, GROUP).values():
            agents.start(pod)
        matrix = ClusterMatrix(local, cluster, admin, agents, harness, float(args.timeout))
        wait_for("the group Ready", matrix.ready, timeout=READY_AGAIN)
        first = matrix.publish(1)
        if first.result != "Succeeded":
            raise RuntimeError(f"the first round did not land: {first.reason}")
        for index, (fault, phase) in enumerate(cells, 1):
            runs.append(matrix.cell(fault, phase))
            progress(index, len(cells), started, runs[-1])
    finally:
        if agents is not None:
            agents.stop_all()
        harness.close_gates()
        if operator is not None:
            operator.stop()
        local.down()
    return finish(runs, args, started)


if __name__ == "__main__":
    sys.exit(main())
