"""The operator alone at scale on the local cluster (kwok nodes, no agents): how fast a big group's pods exist, how
soon its status shows progress, and what the operator costs while the group is idle.

    python bench/operator_scale_bench.py [--trainers 256] [--engine-pods 768] [--nodes 64] [--idle 60]
                                         [--resync 10] [--tree PATH]

``--tree``: run the operator from another checkout (e.g. /work/main, for a before/after on the same machine).
Without agents no pod turns Ready, so the group stays Provisioning: apply -> Ready is ``weightsync bench --scenario
scale``'s business (with stand-in agents). Printed: apply -> first status (and its phase and counts), apply ->
first ``Provisioning``, apply -> all pods exist, scale-out by 128 engine pods -> all exist, the operator's CPU
seconds (utime+stime from /proc) while provisioning and while idle, its peak RSS (VmHWM), its log bytes while idle,
and (operators that count them) its API requests by verb while idle.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from weightsync.api import names
from weightsync_operator.kube import KINDS, KubeApi, login
from weightsync_tools.localcluster import binaries as binaries_mod
from weightsync_tools.localcluster.cluster import LocalCluster
from weightsync_tools.localcluster.session import Kube, OperatorProcess, install_chart, token_kubeconfig

ROOT = Path(__file__).resolve().parents[1]
NS = "scale"
GROUP = "big"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def peak_rss_mib(pid: int) -> float:
    match = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(match.group(1)) / 1024 if match else float("nan")


def api_requests(port: int) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        found = re.match(r'weightsync_operator_api_requests_total\{verb="(\w+)"\} ([\d.e+]+)', line)
        if found:
            out[found.group(1)] = float(found.group(2))
    return out


def group_manifest(trainers: int, engine_pods: int) -> dict[str, Any]:
    obj = yaml.safe_load((ROOT / "examples" / "tcp-group.yaml").read_text())
    obj["metadata"].update(name=GROUP, namespace=NS)
    obj["spec"]["trainer"]["replicas"] = trainers
    obj["spec"]["inference"].update(engines=engine_pods // 2, ranksPerEngine=2, ranksPerPod=1)
    return obj


async def count_pods(api: KubeApi, *, running: bool = False) -> int:
    params = {"labelSelector": f"{names.LABEL_GROUP}={GROUP}", "limit": "5000"}
    if running:
        params["fieldSelector"] = "status.phase=Running"
    result = await api.request("GET", KINDS["Pod"].collection(NS), params=params)
    return len((result or {}).get("items") or [])


async def measure(args: argparse.Namespace, kube: Kube, operator: OperatorProcess) -> dict[str, Any]:
    os.environ["KUBECONFIG"] = str(kube.kubeconfig)
    api = KubeApi(login)
    out: dict[str, Any] = {}
    assert operator.process is not None
    pid = operator.process.pid
    wanted = args.trainers + args.engine_pods
    group_path = KINDS["WeightSyncGroup"].item(NS, GROUP)
    try:
        cpu0 = cpu_seconds(pid)
        manifest = group_manifest(args.trainers, args.engine_pods)
        applied = time.monotonic()
        await api.create(manifest)
        first_status = provisioning = all_exist = None
        while all_exist is None or provisioning is None:
            now = time.monotonic() - applied
            if now > args.timeout:
                break
            group = await api.get(group_path) or {}
            status = group.get("status") or {}
            if first_status is None and status:
                first_status = now
                out["first status"] = (
                    f"{now:.2f} s: phase {status.get('phase')}, trainers {status.get('trainers')}, "
                    f"engines {status.get('engines')}"
                )
            if provisioning is None and status.get("phase") == "Provisioning":
                provisioning = now
                out["first Provisioning"] = f"{now:.2f} s"
            if all_exist is None and await count_pods(api) >= wanted:
                all_exist = now
                out[f"all {wanted} pods exist"] = f"{now:.2f} s ({wanted / now:.0f} pods/s)"
            await asyncio.sleep(0.1)
        if first_status is None:
            out["first status"] = f"none within {args.timeout} s"
        # Settle: kwok starts every pod (3 pod events each), the operator follows.
        while await count_pods(api, running=True) < wanted and time.monotonic() - applied < args.timeout:
            await asyncio.sleep(0.5)
        out[f"all {wanted} pods Running (kwok)"] = f"{time.monotonic() - applied:.2f} s"
        await asyncio.sleep(5)
        out["operator CPU, apply -> all Running + 5 s"] = f"{cpu_seconds(pid) - cpu0:.1f} s"

        # Idle: nothing changes; resyncs only.
        log_size = operator.log.stat().st_size
        requests0, cpu1, idle0 = api_requests(operator.metrics_port), cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(args.idle)
        idle = time.monotonic() - idle0
        requests1 = api_requests(operator.metrics_port)
        out[f"operator CPU while idle ({idle:.0f} s, resync every {args.resync} s)"] = (
            f"{cpu_seconds(pid) - cpu1:.2f} s ({(cpu_seconds(pid) - cpu1) / idle * args.resync:.2f} s per resync)"
        )
        out["operator log while idle"] = f"{(operator.log.stat().st_size - log_size) / 1024:.1f} KiB"
        if requests1:
            delta = {verb: requests1.get(verb, 0) - requests0.get(verb, 0) for verb in requests1}
            per_s = ", ".join(f"{verb} {n / idle:.2f}/s" for verb, n in sorted(delta.items()) if n)
            out["operator API requests while idle"] = per_s or "none"
        else:
            out["operator API requests while idle"] = "(this operator does not count them)"

        # Scale-out: 128 more engine pods.
        more = args.engine_pods + 128
        patch = {"spec": {"inference": {"engines": more // 2}}}
        started = time.monotonic()
        await api.merge_patch(group_path, patch)
        while await count_pods(api) < args.trainers + more and time.monotonic() - started < args.timeout:
            await asyncio.sleep(0.1)
        out[f"scale-out +128 engine pods -> all {args.trainers + more} exist"] = f"{time.monotonic() - started:.2f} s"
        await asyncio.sleep(5)
        out["operator peak RSS (VmHWM)"] = f"{peak_rss_mib(pid):.0f} MiB"
    finally:
        await api.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", type=int, default=256)
    parser.add_argument("--engine-pods", type=int, default=768)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--idle", type=float, default=60.0)
    parser.add_argument("--resync", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--tree", type=Path, default=ROOT, help="checkout whose operator runs")
    args = parser.parse_args()

    tree = args.tree.resolve()
    os.environ["PYTHONPATH"] = os.pathsep.join(str(tree / p) for p in ("", "agent", "operator"))
    directory = Path(tempfile.mkdtemp(prefix="operator-scale-"))
    found = binaries_mod.ensure()
    local = LocalCluster(directory / "cluster", found)
    state = local.up(nodes=args.nodes)
    print(f"cluster up in {state.startup_seconds} s with {args.nodes} kwok nodes ({directory})", file=sys.stderr)
    operator: OperatorProcess | None = None
    try:
        admin = Kube(state.kubeconfig, found)
        install_chart(admin)
        admin.kubectl("create", "namespace", NS)
        deployment = admin.json("-n", "weightsync-system", "get", "deployment")["items"][0]
        account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        kubeconfig = token_kubeconfig(state, admin, "weightsync-system", account, directory / "operator.kubeconfig")
        operator = OperatorProcess(kubeconfig, directory / "operator.log", resync_seconds=args.resync)
        operator.start()
        time.sleep(5)  # started and watching
        results = asyncio.run(measure(args, admin, operator))
    finally:
        if operator is not None:
            operator.stop()
        local.down()
    log = (directory / "operator.log").read_text(errors="replace")
    errors = [line for line in log.splitlines() if "[ERROR" in line]
    print(f"\noperator from {tree}; group of {args.trainers} trainer pods + {args.engine_pods} engine pods")
    width = max(len(k) for k in results)
    for key, value in results.items():
        print(f"  {key:<{width}}  {value}")
    print(f"  {'operator [ERROR] lines':<{width}}  {len(errors)}")
    print(f"  (log: {directory / 'operator.log'})")


if __name__ == "__main__":
    main()
