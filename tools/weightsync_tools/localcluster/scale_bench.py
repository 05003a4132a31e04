"""``weightsync bench --scenario scale``: the control plane with 1,000+ pods on the local cluster (docs/scale.md).

A local cluster with 64 kwok nodes and the API server's audit log, the chart installed with helm, the operator
running as the chart's ServiceAccount, and **stand-in agents** (:mod:`weightsync_tools.localcluster.standin_agents`:
the agents' exact API calls with pod-bound tokens, no Mooncake, no engines). For each group size it measures

* apply -> the group's first status, and apply -> Ready (every pod's agent reported ready, the operator folded it);
* at the largest size: the idle API traffic over a window, per user (operator, agents, the rest), from the audit
  log; then a scale-out by an eighth of the pods -> Ready, with the plan's ``movedTargets``;
* delete -> nothing of the group left (pods, plan ConfigMap, Role, RoleBinding, ServiceAccount, Service, Secret),
  with the kube-controller-manager's garbage-collector settings stated (it deletes the owned objects);
* the operator's CPU seconds and peak RSS (``/proc``).

Group shape for ``pods`` (a multiple of 16): a quarter trainer pods (one rank each), the rest engine pods of the
reference engine, two ranks per engine and one rank per pod.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from weightsync.api import names
from weightsync.plan import Plan
from weightsync_tools.localcluster import binaries as binaries_mod
from weightsync_tools.localcluster.cluster import AUDIT_LOG, KWOK_POD_PARALLELISM, ClusterState, LocalCluster
from weightsync_tools.localcluster.session import Kube, OperatorProcess, install_chart, token_kubeconfig, wait_for
from weightsync_tools.localcluster.standin_agents import Kubelet

NAMESPACE = "scale"
SYSTEM_NS = "weightsync-system"
NODES = 64
#: kube-controller-manager's garbage-collector settings: its defaults, stated in the report (they bound delete).
GC_SETTINGS = {"--concurrent-gc-syncs": "20 (default)", "--kube-api-qps": "20 (default)",
               "--kube-api-burst": "30 (default)"}  # fmt: skip
#: What paces pods from created to Running: the scheduler's binding requests and kwok's stage parallelism.
START_SETTINGS = {"kube-scheduler --kube-api-qps/--kube-api-burst": "50/100 (defaults)",
                  "kwok podPlayStageParallelism": f"{KWOK_POD_PARALLELISM} (kwok's default: 4)"}  # fmt: skip
OPERATOR_USER = f"system:serviceaccount:{SYSTEM_NS}:weightsync"

Say = Callable[[str], None]
Progress = Callable[[str, int, int], None]  # (what, done, total)


@dataclass
class SizeResult:
    pods: int
    trainer_pods: int
    engine_pods: int
    first_status_s: float | None = None
    ready_s: float | None = None
    delete_s: float | None = None
    left_behind: list[str] = field(default_factory=list)


@dataclass
class ScaleReport:
    sizes: list[SizeResult] = field(default_factory=list)
    scale_out_from: int | None = None
    scale_out_to: int | None = None
    scale_out_ready_s: float | None = None
    moved_targets: int | None = None
    idle_window_s: float | None = None
    idle_rps: dict[str, float] = field(default_factory=dict)
    idle_agent_rps_per_100_pods: float | None = None
    idle_by_verb: dict[str, dict[str, int]] = field(default_factory=dict)
    operator_cpu_s: float | None = None
    operator_peak_rss_mib: float | None = None
    gc_settings: dict[str, str] = field(default_factory=lambda: dict(GC_SETTINGS))
    start_settings: dict[str, str] = field(default_factory=lambda: dict(START_SETTINGS))
    standin_errors: list[str] = field(default_factory=list)
    note: str = (
        "agents are stand-ins: 8 worker processes making every pod's agent API calls (plan watch, readiness condition, "
        "annotations) with the agent's own code and the pod's bound ServiceAccount token; no Mooncake, no engines"
    )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def group_object(name: str, pods: int) -> dict[str, Any]:
    if pods % 16 or pods < 16:
        raise ValueError(f"--pods must be a multiple of 16, got {pods}")
    trainers, engine_pods = pods // 4, pods - pods // 4
    sleeper = {"spec": {"containers": [{"name": "main", "image": "python:3.11-slim",
                                        "command": ["sleep", "infinity"]}]}}  # fmt: skip
    return {
        "apiVersion": "weightsync.io/v1alpha1",
        "kind": "WeightSyncGroup",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "trainer": {"replicas": trainers, "ranksPerPod": 1, "template": sleeper},
            "inference": {
                "engines": engine_pods // 2,
                "ranksPerEngine": 2,
                "ranksPerPod": 1,
                "adapter": "reference",
                "port": 30000,
                "template": sleeper,
            },
            "transfer": {"mode": "p2p", "protocol": "tcp", "bucketSizeMiB": 64, "verify": True},
        },
    }


class Bench:
    def __init__(self, directory: Path, say: Say, progress: Progress, *, idle_seconds: float = 30.0) -> None:
        self.directory = directory
        self.say = say
        self.progress = progress
        self.idle_seconds = idle_seconds
        self.report = ScaleReport()

    def run(self, sizes: Sequence[int], *, scale_out: bool = True) -> ScaleReport:
        found = binaries_mod.ensure(quiet=True)
        if self.directory.exists():
            LocalCluster(self.directory, found).down()
            shutil.rmtree(self.directory)
        local = LocalCluster(self.directory, found)
        operator: OperatorProcess | None = None
        kubelet: Kubelet | None = None
        # A thousand stand-ins would each log a plan ConfigMap's deletion: only their errors are shown.
        logging.getLogger("weightsync.agent").setLevel(logging.ERROR)
        try:
            self.say(f"local cluster: {NODES} kwok nodes, API server audit log on")
            state = local.up(nodes=NODES, audit=True, timeout=180)
            admin = Kube(state.kubeconfig, found)
            self.say("helm install weightsync charts/weightsync")
            install_chart(admin, namespace=SYSTEM_NS)
            account = admin.json("-n", SYSTEM_NS, "get", "deployment", "weightsync")["spec"]["template"]["spec"][
                "serviceAccountName"
            ]
            config = token_kubeconfig(state, admin, SYSTEM_NS, account, self.directory / "operator.kubeconfig")
            # The chart's resync period (30 s), not the tests' 5 s: the idle traffic measured is a deployment's.
            operator = OperatorProcess(config, self.directory / "logs" / "operator.log", verbose=False,
                                       resync_seconds=30)  # fmt: skip
            operator.start()
            admin.kubectl("create", "namespace", NAMESPACE)
            api = admin_api(state)
            kubelet = Kubelet(state, api, NAMESPACE)
            kubelet.start()
            for index, pods in enumerate(sizes):
                last = index == len(sizes) - 1
                self._size(admin, api, pods, last_size=last and scale_out)
            if operator.process is not None:
                self.report.operator_cpu_s, self.report.operator_peak_rss_mib = process_usage(operator.process.pid)
            self.report.standin_errors = kubelet.errors[:20]
        finally:
            if kubelet is not None:
                kubelet.stop()
            if operator is not None:
                operator.stop()
            local.down()
        return self.report

    # --- One group size ------------------------------------------------------------------------------

    def _size(self, admin: Kube, api: Any, pods: int, *, last_size: bool) -> None:
        name = f"scale-{pods}"
        group = group_object(name, pods)
        result = SizeResult(pods, group["spec"]["trainer"]["replicas"], pods - group["spec"]["trainer"]["replicas"])
        self.report.sizes.append(result)
        self.say(f"apply a group of {pods} pods ({result.trainer_pods} trainer, {result.engine_pods} engine)")
        applied = time.monotonic()
        admin.kubectl("apply", "-f", "-", input=yaml.safe_dump(group))
        result.first_status_s, result.ready_s = self._until_ready(api, name, pods, applied, timeout=300)
        if last_size:
            self._idle(api, name, pods)
            self._scale_out(admin, api, name, group, pods)
        self.say(f"delete the group of {pods} pods")
        deleted = time.monotonic()
        admin.kubectl("-n", NAMESPACE, "delete", "wsg", name, "--wait=false")
        result.left_behind = self._until_gone(admin, name, timeout=300)
        result.delete_s = round(time.monotonic() - deleted, 2)

    def _until_ready(
        self, api: Any, name: str, pods: int, since: float, *, timeout: float
    ) -> tuple[float | None, float | None]:
        first: float | None = None
        deadline = since + timeout
        while time.monotonic() < deadline:
            status = group_status(api, name)
            now = time.monotonic()
            if status and first is None:
                first = round(now - since, 2)
            counts = [status.get("trainers") or {}, status.get("engines") or {}]
            ready = sum(int(c.get("ready", 0)) for c in counts)  # pods, both kinds
            desired = sum(int(c.get("desired", 0)) for c in counts)
            self.progress(f"{name} Ready", min(ready, pods), pods)
            if status.get("phase") == "Ready" and desired == pods and ready == pods:
                return first, round(now - since, 2)
            time.sleep(0.1)
        self.say(f"{name} not Ready within {timeout:.0f} s")
        return first, None

    def _idle(self, api: Any, name: str, pods: int) -> None:
        """Requests per second per user over an idle window (nothing of the bench asks meanwhile)."""
        self.say(f"idle for {self.idle_seconds:.0f} s: counting API requests in the audit log")
        time.sleep(5)  # let the last reports of the Ready transition land
        start = datetime.now().astimezone()
        time.sleep(self.idle_seconds)
        end = datetime.now().astimezone()
        time.sleep(2.5)  # the audit log's batch flush
        by_user, by_verb = count_requests(self.directory / AUDIT_LOG, start, end, NAMESPACE)
        window = (end - start).total_seconds()
        self.report.idle_window_s = round(window, 1)
        self.report.idle_rps = {user: round(n / window, 3) for user, n in sorted(by_user.items())}
        self.report.idle_by_verb = by_verb
        agents = by_user.get("agents", 0) / window
        self.report.idle_agent_rps_per_100_pods = round(agents / pods * 100, 3)

    def _scale_out(self, admin: Kube, api: Any, name: str, group: dict[str, Any], pods: int) -> None:
        more = pods // 8
        engines = group["spec"]["inference"]["engines"] + more // 2
        self.say(f"scale out {pods} -> {pods + more} pods (engines -> {engines})")
        before = plan_of(api, name)
        started = time.monotonic()
        admin.kubectl("-n", NAMESPACE, "patch", "wsg", name, "--type=merge",
                      "-p", json.dumps({"spec": {"inference": {"engines": engines}}}))  # fmt: skip
        self.report.scale_out_from, self.report.scale_out_to = pods, pods + more
        try:
            wait_for("the replan", lambda: plan_of(api, name).revision != before.revision, timeout=120, interval=0.1)
        except AssertionError as exc:
            self.say(str(exc))
            return
        _, ready = self._until_ready(api, name, pods + more, started, timeout=120)
        self.report.scale_out_ready_s = ready
        self.report.moved_targets = plan_of(api, name).moved_targets

    def _until_gone(self, admin: Kube, name: str, *, timeout: float) -> list[str]:
        selector = f"{names.LABEL_GROUP}={name}"
        kinds = "pods,configmaps,roles,rolebindings,serviceaccounts,services,secrets"

        def left() -> list[str]:
            found = admin.kubectl("-n", NAMESPACE, "get", kinds, "-l", selector, "-o", "name", check=False)
            owned = [line for line in found.stdout.split() if line]
            named = admin.kubectl("-n", NAMESPACE, "get", "configmap", names.plan_config_map(name), "-o", "name",
                                  check=False).stdout.split()  # fmt: skip
            return sorted(set(owned) | set(named))

        deadline = time.monotonic() + timeout
        remaining = left()
        total = max(len(remaining), 1)
        while remaining and time.monotonic() < deadline:
            self.progress(f"{name} deleted", total - len(remaining), total)
            time.sleep(0.5)
            remaining = left()
        return remaining


def admin_api(state: ClusterState) -> Any:
    from kubernetes import client
    from kubernetes import config as kube_config

    config = client.Configuration()
    kube_config.load_kube_config(str(state.kubeconfig), client_configuration=config)  # type: ignore[no-untyped-call]
    config.connection_pool_maxsize = 32  # the stand-in kubelet's token requests run 16 at a time
    return client.CoreV1Api(client.ApiClient(config))


def group_status(api: Any, name: str) -> dict[str, Any]:
    from kubernetes import client

    custom = client.CustomObjectsApi(api.api_client)
    found: Any = custom.get_namespaced_custom_object("weightsync.io", "v1alpha1", NAMESPACE, "weightsyncgroups", name)
    return dict(found.get("status") or {})


def plan_of(api: Any, name: str) -> Plan:
    cm = api.read_namespaced_config_map(names.plan_config_map(name), NAMESPACE)
    return Plan.from_json(cm.data[names.PLAN_KEY])


def user_class(user: str, namespace: str) -> str:
    if user == OPERATOR_USER:
        return "operator"
    if user.startswith(f"system:serviceaccount:{namespace}:"):
        return "agents"
    return "other"


def count_requests(
    log: Path, start: datetime, end: datetime, namespace: str
) -> tuple[Counter[str], dict[str, dict[str, int]]]:
    """Requests received in [start, end) per user class, and per class and verb (one per auditID)."""
    seen: set[str] = set()
    event: dict[str, Any]
    by_user: Counter[str] = Counter()
    by_verb: dict[str, Counter[str]] = {}
    with open(log, errors="replace") as lines:
        for line in lines:
            try:
                event = json.loads(line)
                received = datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00"))
            except (ValueError, KeyError):
                continue
            if not start <= received < end or event.get("auditID") in seen:
                continue
            seen.add(event.get("auditID", ""))
            who = user_class(str((event.get("user") or {}).get("username", "")), namespace)
            by_user[who] += 1
            resource = (event.get("objectRef") or {}).get("resource", "")
            subresource = (event.get("objectRef") or {}).get("subresource", "")
            verb = f"{event.get('verb')} {resource}{'/' + subresource if subresource else ''}"
            by_verb.setdefault(who, Counter())[verb] += 1
    return by_user, {who: dict(counts.most_common(8)) for who, counts in by_verb.items()}


def process_usage(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) and peak RSS in MiB of a live process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    peak_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            peak_kib = int(line.split()[1])
    return round(cpu, 2), round(peak_kib / 1024, 1)
