"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok (fake nodes, so pods schedule and go Running without a container runtime).

Everything listens on 127.0.0.1 only, on free ports chosen at start. Processes are started in their own
sessions, recorded by PID in ``state.json`` and stopped by PID (never by name).
"""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from weightsync.ports import free_port
from weightsync_tools.localcluster import pki as pki_mod
from weightsync_tools.localcluster.binaries import Binaries

if TYPE_CHECKING:
    from weightsync_tools.localcluster.realnode import NodeBinaries

#: Extended resources every fake node advertises, so RDMA/GPU groups schedule.
DEFAULT_NODE_RESOURCES = {
    "nvidia.com/gpu": "8",
    "rdma/hca_shared_devices_a": "64",
    "rdma/ib": "8",
    "rdma/rdma_shared_device_a": "64",
}


#: How long a node's lease may lapse before the node lifecycle controller calls it NotReady (see where it is passed).
NODE_MONITOR_GRACE = "1h"
#: How many pods kwok moves through a stage (Pending -> Running, deletion) at once, for all its nodes together. On a
#: real cluster every node's kubelet starts its own pods; kwok's default of 4 made pods go Running at ~28/s here,
#: which alone kept a 1,024-pod group from Ready for 36 s, and 64 still held kwok's status patches to ~80/s (each
#: waits for its round trip to a busy API server) until 36 s after apply (docs/scale.md).
KWOK_POD_PARALLELISM = 256
KWOK_CONFIGURATION = f"""---
apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
# kwok applies its defaults only without a configuration: the rest are its documented defaults (v0.8.0).
options:
  podPlayStageParallelism: {KWOK_POD_PARALLELISM}
  nodePlayStageParallelism: 4
  nodeLeaseParallelism: 4
  podsOnNodeSyncParallelism: 1
  enablePodsOnNodeSyncListPager: true
  enablePodsOnNodeSyncStreamWatch: false
  enableDebuggingHandlers: true
  enableProfilingHandler: true
  enableContentionProfiling: false
"""

#: The audit policy of ``up(audit=True)``: every request at Metadata level (who, what, when; no bodies), once per
#: request (a watch logs when it starts and when it ends, under one auditID): enough to count requests per user.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata"}],
}
#: The audit log, under the cluster's directory.
AUDIT_LOG = "logs/audit.log"

_READINESS_GATES = re.compile(r"^[ \t]*\{\{ range \.spec\.readinessGates \}\}.*?\{\{ end \}\}[ \t]*\n", re.S | re.M)


def without_readiness_gates(stages: str) -> str:
    """kwok's pod-ready stage marks every readiness gate True; on a real node only the gate's owner does.

    Our agents own ``weightsync.io/agent-ready``, so the fake nodes must leave it to them.
    """
    stripped, count = _READINESS_GATES.subn("", stages)
    if count != 1:
        raise ClusterError(f"expected one readinessGates block in kwok's pod-ready stage, found {count}")
    return stripped


class ClusterError(RuntimeError):
    pass


@dataclass
class Process:
    name: str
    pid: int
    binary: str
    log: str
    #: The arguments it was started with, so a fault test can start it again exactly so.
    args: list[str] = field(default_factory=list)


@dataclass
class ClusterState:
    directory: str
    apiserver_port: int
    etcd_port: int
    processes: list[Process] = field(default_factory=list)
    started_at: float = 0.0
    startup_seconds: float = 0.0
    #: The real node's binaries (build-node-binaries.sh's cache) when ``up(real_node=...)`` started one.
    real_node: str = ""

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    @property
    def kubeconfig(self) -> Path:
        return Path(self.directory) / "kubeconfig"

    def save(self) -> None:
        (Path(self.directory) / "state.json").write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, directory: Path) -> ClusterState:
        data = json.loads((directory / "state.json").read_text())
        data["processes"] = [Process(**p) for p in data["processes"]]
        return cls(**data)


def terminate(process: Process, grace: float = 10.0) -> None:
    """SIGTERM ``process`` (after a SIGCONT: a frozen one cannot act on it), SIGKILL after ``grace`` seconds."""
    if not _alive(process):
        return
    os.kill(process.pid, signal.SIGCONT)
    os.kill(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _alive(process) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(process):
        os.kill(process.pid, signal.SIGKILL)
        # Gone before this returns: a restart right after (start_component) must not find it still exiting.
        deadline = time.monotonic() + 5.0
        while _alive(process) and time.monotonic() < deadline:
            time.sleep(0.05)


def _alive(process: Process) -> bool:
    try:
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return False
    # A recycled PID running something else is not ours to signal.
    return Path(cmdline).name == Path(process.binary).name


def _wait(what: str, check: Callable[[], bool], timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.25)
    tail = ""
    if log and log.exists():
        tail = "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-25:])
    raise ClusterError(f"{what} not ready after {timeout:.0f} s{tail}")


class LocalCluster:
    """Start, stop and describe the local cluster kept in ``directory``."""

    def __init__(self, directory: Path, binaries: Binaries) -> None:
        self.directory = directory
        self.binaries = binaries
        self.logs = directory / "logs"
        #: Serializes starts (the supervisor's and a test's) and the state file they write.
        self._starting = threading.RLock()
        self._supervisor: threading.Thread | None = None
        self._supervising = threading.Event()
        self._stopped_on_purpose: set[str] = set()

    # --- Lifecycle -------------------------------------------------------------------------------

    def up(
        self,
        *,
        nodes: int = 4,
        node_resources: dict[str, str] | None = None,
        timeout: float = 120,
        audit: bool = False,
        controller_manager_args: Sequence[str] = (),
        real_node: NodeBinaries | None = None,
    ) -> ClusterState:
        """Start the cluster. ``audit``: the API server writes an audit log (:data:`AUDIT_POLICY`, at
        :data:`AUDIT_LOG`; the scale benchmark counts requests per user in it). ``controller_manager_args``: extra
        flags for kube-controller-manager (e.g. its API rate, which bounds garbage collection). ``real_node``: also
        start a real node (containerd and a kubelet, ``realnode.py``) with these binaries (off by default)."""
        if (self.directory / "state.json").exists() and self.running():
            raise ClusterError(f"a cluster is already running in {self.directory}; `weightsync cluster down` first")
        started = time.monotonic()
        self.logs.mkdir(parents=True, exist_ok=True)
        pki = pki_mod.generate(self.directory / "pki")
        state = ClusterState(
            str(self.directory), apiserver_port=free_port(), etcd_port=free_port(), started_at=time.time()
        )
        state.kubeconfig.write_text(pki_mod.kubeconfig(pki, state.server))
        try:
            self._start_etcd(state)
            self._start_apiserver(state, pki, timeout, audit=audit, kubelet_client=real_node is not None)
            self._start(
                state,
                "kube-controller-manager",
                self.binaries.kube_controller_manager,
                [
                    f"--kubeconfig={state.kubeconfig}",
                    "--leader-elect=false",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={free_port()}",
                    f"--service-account-private-key-file={pki.sa_key}",
                    f"--root-ca-file={pki.ca_cert}",
                    "--use-service-account-credentials=false",
                    "--cluster-cidr=10.244.0.0/16",
                    "--allocate-node-cidrs=false",
                    # The node lifecycle controller marks every pod of a node whose lease lapses Ready=False (a
                    # lease lapses here when the API server is stopped or frozen, or the 2 cores are saturated).
                    # A kubelet recomputes readiness on its next sync and undoes it; kwok never does, so the mark
                    # would stick forever. The controller stays (it lifts the not-ready taint new nodes carry),
                    # with a grace period no test outage comes near.
                    f"--node-monitor-grace-period={NODE_MONITOR_GRACE}",
                    *controller_manager_args,
                ],
            )
            self._start(
                state,
                "kube-scheduler",
                self.binaries.kube_scheduler,
                [
                    f"--kubeconfig={state.kubeconfig}",
                    "--leader-elect=false",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={free_port()}",
                ],
            )
            stages = self.directory / "kwok-stages.yaml"
            stages.write_text(without_readiness_gates(self.binaries.kwok_stages.read_text()) + KWOK_CONFIGURATION)
            self._start(
                state,
                "kwok",
                self.binaries.kwok,
                [
                    f"--kubeconfig={state.kubeconfig}",
                    f"--config={stages}",
                    "--manage-all-nodes=false",
                    "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                    "--node-lease-duration-seconds=40",
                    f"--server-address=127.0.0.1:{free_port()}",
                    "--cidr=10.0.0.1/16",
                ],
            )
            self.create_nodes(state, nodes, node_resources or DEFAULT_NODE_RESOURCES)
            _wait(
                "the default ServiceAccount",
                lambda: self._kubectl(state, "get", "serviceaccount", "default", check=False).returncode == 0,
                timeout,
            )
            if real_node is not None:
                from weightsync_tools.localcluster.realnode import RealNode

                state.real_node = str(real_node.directory)
                RealNode(self, real_node).start(state, timeout)
        except BaseException:
            self.down(state)
            raise
        state.startup_seconds = round(time.monotonic() - started, 2)
        state.save()
        return state

    def down(self, state: ClusterState | None = None) -> list[str]:
        """Stop every recorded process, newest first: SIGTERM, then SIGKILL after 10 s; etcd last, once the others
        are gone (the API server deletes its lease on the way out: with etcd stopped beside it, that waited 10 s for
        etcd and was killed)."""
        self._supervising.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=30)
        if state is None:
            if not (self.directory / "state.json").exists():
                return []
            state = ClusterState.load(self.directory)
        stopped = []
        if state.real_node and any(p.name in ("kubelet", "containerd") for p in state.processes):
            from weightsync_tools.localcluster.realnode import RealNode

            # Its pods first (the kubelet tears their sandboxes down), then what containerd and the kubelet leave.
            RealNode.started(self, state).stop(state)
            stopped += ["kubelet", "containerd"]
        newest_first = list(reversed(state.processes))
        for wave in ([p for p in newest_first if p.name != "etcd"], [p for p in newest_first if p.name == "etcd"]):
            for process in wave:
                if not _alive(process):
                    continue
                os.kill(process.pid, signal.SIGTERM)
                stopped.append(process.name)
            deadline = time.monotonic() + 10
            for process in wave:
                while _alive(process) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if _alive(process):
                    os.kill(process.pid, signal.SIGKILL)
        state.processes = []
        state.save()
        return stopped

    def running(self) -> bool:
        try:
            state = ClusterState.load(self.directory)
        except (OSError, ValueError):
            return False
        return bool(state.processes) and all(_alive(p) for p in state.processes)

    # --- Faults (tests) -------------------------------------------------------------------------

    def component(self, state: ClusterState, name: str) -> Process:
        for process in state.processes:
            if process.name == name:
                return process
        raise ClusterError(f"no component {name!r} in this cluster ({[p.name for p in state.processes]})")

    def freeze(self, state: ClusterState, name: str) -> None:
        """SIGSTOP a component: its sockets stay open and accept, but nothing answers (a hung server)."""
        process = self.component(state, name)
        if _alive(process):
            os.kill(process.pid, signal.SIGSTOP)

    def thaw(self, state: ClusterState, name: str) -> None:
        process = self.component(state, name)
        if _alive(process):
            os.kill(process.pid, signal.SIGCONT)

    def stop_component(self, state: ClusterState, name: str) -> None:
        """Stop one component (SIGTERM, then SIGKILL after 10 s): its port refuses connections. It stays stopped
        (the supervisor leaves it) until :meth:`start_component`."""
        process = self.component(state, name)
        with self._starting:
            self._stopped_on_purpose.add(name)
        terminate(process)

    def start_component(self, state: ClusterState, name: str, timeout: float = 60) -> None:
        """Start a stopped component again with the arguments it first had (same ports, same data)."""
        process = self.component(state, name)
        with self._starting:
            if _alive(process):
                raise ClusterError(f"{name} is still running (pid {process.pid})")
            self._stopped_on_purpose.discard(name)
            self._start(state, name, Path(process.binary), process.args)
        if name == "kube-apiserver":
            self._wait_apiserver(state, timeout)
        self.revive(state)

    def revive(self, state: ClusterState) -> list[str]:
        """Start again every component that exited (what a kubelet does for a control plane's static pods):
        a controller that lost the API server for long enough may exit; the cluster must not stay without it."""
        revived = []
        with self._starting:
            for process in list(state.processes):
                if process.name in self._stopped_on_purpose:
                    continue
                if not _alive(process):
                    self._start(state, process.name, Path(process.binary), process.args)
                    revived.append(process.name)
        return revived

    def supervise(self, state: ClusterState, interval: float = 1.0) -> None:
        """Revive exited components every ``interval`` s until :meth:`down`, as a node's kubelet restarts its
        control plane's static pods. kube-scheduler, for one, exits by design when it finds its cache corrupt
        (seen after an API server restart: "Pod updated on a different node than previously added to"), and
        expects to be restarted. Components a test stops on purpose stay stopped."""

        def loop() -> None:
            while not self._supervising.wait(interval):
                try:
                    for name in self.revive(state):
                        print(f"local cluster: {name} had exited; started it again", flush=True)
                except ClusterError as exc:
                    print(f"local cluster: could not revive a component: {exc}", flush=True)

        self._supervising.clear()
        self._supervisor = threading.Thread(target=loop, name="localcluster-supervisor", daemon=True)
        self._supervisor.start()

    def dead(self, state: ClusterState) -> list[str]:
        return [p.name for p in state.processes if not _alive(p)]

    # --- Pieces ------------------------------------------------------------------------------------

    def _start(self, state: ClusterState, name: str, binary: Path, args: Sequence[str]) -> Process:
        log = self.logs / f"{name}.log"
        with open(log, "ab") as out:
            child = subprocess.Popen(
                [str(binary), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.directory,
            )
        process = Process(name, child.pid, str(binary), str(log), list(args))
        state.processes = [p for p in state.processes if p.name != name] + [process]
        state.save()
        time.sleep(0.2)
        if child.poll() is not None:
            raise ClusterError(
                f"{name} exited at start (code {child.returncode}); see {log}:\n"
                + "\n".join(log.read_text(errors="replace").splitlines()[-25:])
            )
        return process

    def _start_etcd(self, state: ClusterState) -> None:
        peer = free_port()
        client = f"http://127.0.0.1:{state.etcd_port}"
        self._start(
            state,
            "etcd",
            self.binaries.etcd,
            [
                "--name=weightsync",
                f"--data-dir={self.directory / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=weightsync=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync",
                "--quota-backend-bytes=4294967296",
                f"--listen-metrics-urls=http://127.0.0.1:{free_port()}",
            ],
        )

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as response:
                    return b"true" in response.read()
            except OSError:
                return False

        _wait("etcd", healthy, 30, self.logs / "etcd.log")

    def _start_apiserver(
        self,
        state: ClusterState,
        pki: pki_mod.Pki,
        timeout: float,
        *,
        audit: bool = False,
        kubelet_client: bool = False,
    ) -> None:
        extra_args: list[str] = []
        if kubelet_client:
            # A real kubelet (realnode.py) serves logs, exec and port-forward on its node's InternalIP; the API server
            # reaches it there (its default picks the Hostname address, which nothing resolves) with its own client
            # certificate, as kubeadm's apiserver-kubelet-client.
            cert, key = pki_mod.client_certificate(
                pki, "apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters"
            )
            extra_args += [
                "--kubelet-preferred-address-types=InternalIP",
                f"--kubelet-client-certificate={cert}",
                f"--kubelet-client-key={key}",
            ]
        if audit:
            policy = self.directory / "audit-policy.yaml"
            policy.write_text(yaml.safe_dump(AUDIT_POLICY))
            extra_args += [
                f"--audit-policy-file={policy}",
                f"--audit-log-path={self.directory / AUDIT_LOG}",
                "--audit-log-format=json",
                "--audit-log-maxsize=2000",
                "--audit-log-mode=batch",
                "--audit-log-batch-max-wait=1s",
            ]
        self._start(
            state,
            "kube-apiserver",
            self.binaries.kube_apiserver,
            [
                f"--etcd-servers=http://127.0.0.1:{state.etcd_port}",
                "--bind-address=127.0.0.1",
                f"--secure-port={state.apiserver_port}",
                f"--tls-cert-file={pki.serving_cert}",
                f"--tls-private-key-file={pki.serving_key}",
                f"--client-ca-file={pki.ca_cert}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki.sa_pub}",
                f"--service-account-signing-key-file={pki.sa_key}",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--authorization-mode=Node,RBAC",
                "--allow-privileged=true",
                "--endpoint-reconciler-type=none",
                f"--cert-dir={self.directory / 'certs'}",
                *extra_args,
            ],
        )
        self._wait_apiserver(state, timeout)

    def _wait_apiserver(self, state: ClusterState, timeout: float) -> None:
        context = ssl.create_default_context(cafile=str(pki_mod.Pki(self.directory / "pki").ca_cert))

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{state.server}/readyz", timeout=2, context=context) as response:
                    return bool(response.status == 200)
            except OSError:
                return False

        _wait("kube-apiserver", ready, timeout, self.logs / "kube-apiserver.log")

    def create_nodes(self, state: ClusterState, count: int, resources: dict[str, str]) -> None:
        existing = self._kubectl(state, "get", "nodes", "-o", "name", check=False).stdout.split()
        docs = []
        for index in range(count):
            name = f"kwok-node-{index}"
            if f"node/{name}" in existing:
                continue
            capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", **resources}
            docs.append(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": name,
                        "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                        "labels": {
                            "kubernetes.io/hostname": name,
                            "kubernetes.io/os": "linux",
                            "kubernetes.io/arch": "amd64",
                            "type": "kwok",
                        },
                    },
                    "status": {"allocatable": capacity, "capacity": capacity, "phase": "Running"},
                }
            )
        if docs:
            self._kubectl(state, "apply", "-f", "-", input=yaml.safe_dump_all(docs))

        def ready() -> bool:
            out = self._kubectl(
                state,
                "get",
                "nodes",
                "-o",
                "jsonpath={.items[*].status.conditions[?(@.type=='Ready')].status}",
                check=False,
            ).stdout.split()
            return len(out) >= count and all(s == "True" for s in out)

        _wait(f"{count} kwok nodes", ready, 60, self.logs / "kwok.log")

    def _kubectl(
        self, state: ClusterState, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.binaries.kubectl), f"--kubeconfig={state.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            check=check,
            timeout=60,
        )
