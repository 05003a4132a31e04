"""NetworkPolicies enforced on the real node: kube-router's network policy controller (``--run-firewall`` alone,
no routing, no service proxy), the policy engine k3s embeds for the same kind of node (pods on one Linux bridge).

How it enforces: for every pod of the node a policy selects, iptables chains in the ``filter`` table (``FORWARD``,
``INPUT``, ``OUTPUT``; bridged packets with ``-m physdev --physdev-is-bridged``) and ipsets of the policies' peers;
traffic no policy admits gets ``REJECT`` (the client sees "connection refused" at once). The node's own traffic to
its pods is accepted whatever the policies say (kubelet probes). The pods' bridged packets reach iptables only with
``br_netfilter`` and ``net.bridge.bridge-nf-call-iptables=1`` (:func:`unavailable_reason` checks;
:meth:`NetworkPolicyEngine.start` sets the switch to 1 when the module is there).

It runs as a host process of the cluster (kube-router's DaemonSet runs it privileged in the host's network namespace:
the same), with the cluster's admin kubeconfig. Started only when a test asks: while its rules exist the kernel
tracks every connection of the host (the CPU cost the real node otherwise avoids, see realnode.py).

Why not kube-network-policies (the SIG Network project): it sends each new connection's first packet to userspace
with nftables' ``queue`` expression, which this machine's kernel lacks (``# CONFIG_NFT_QUEUE is not set``; its own
log: ``syncing nftables rules error=conn.Receive: netlink receive: no such file or directory``); the kernel has
iptables' NFQUEUE target, which kube-network-policies does not use. docs/security.md, "The group's NetworkPolicy".

kube-router 2.1.0 (the one version the module proxy serves here) cleans nothing with ``--cleanup-config`` (it
builds an empty controller whose iptables handles are nil; it then panics in the service proxy's cleanup), so
:meth:`NetworkPolicyEngine.stop` removes its chains and ipsets itself (:func:`without_kube_router`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from weightsync_tools.localcluster.cluster import ClusterError, ClusterState, terminate

if TYPE_CHECKING:  # realnode.py imports this module: its stop removes what a test left enforced
    from weightsync_tools.localcluster.realnode import RealNode

#: build-node-binaries.sh's KUBE_ROUTER_VERSION (a unit test keeps the two equal).
VERSION = "v2.1.0"
PROCESS = "kube-router"
#: The API server's --service-cluster-ip-range (cluster.py): kube-router admits pods' traffic to Service IPs.
SERVICE_RANGE = "10.96.0.0/16"
BRIDGE_NF_CALL = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
#: What kube-router's network policy controller names in the filter table: its three top chains (and the jumps
#: to them from INPUT, FORWARD and OUTPUT), one chain per policy, one per pod.
KUBE_ROUTER_CHAIN = re.compile(r"KUBE-(ROUTER-(INPUT|FORWARD|OUTPUT)|NWPLCY-|POD-FW-)")
#: Its ipsets: the sources and destinations of each policy rule.
KUBE_ROUTER_IPSET = re.compile(r"KUBE-(SRC|DST)-")
TOOLS = ("iptables", "iptables-save", "iptables-restore", "ipset")


def binary(node: RealNode) -> Path:
    return node.binaries.directory / f"kube-router-{VERSION}" / "kube-router"


def unavailable_reason(node: RealNode) -> str | None:
    """Why policies cannot be enforced on this host's real node, in one line; None when they can."""
    if not binary(node).is_file():
        return f"{binary(node)} is not built (build-node-binaries.sh builds it)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"kube-router needs {', '.join(missing)} (Debian packages iptables, ipset)"
    if not BRIDGE_NF_CALL.exists():
        return "br_netfilter is not loaded (no /proc/sys/net/bridge): bridged pod-to-pod packets would bypass iptables"
    return None


def arguments(kubeconfig: Path, node_name: str) -> list[str]:
    """The network policy controller alone, for ``node_name``; no health or metrics port (none is free to take)."""
    return [
        f"--kubeconfig={kubeconfig}",
        "--run-firewall=true",
        "--run-router=false",
        "--run-service-proxy=false",
        "--enable-cni=false",
        f"--hostname-override={node_name}",
        f"--service-cluster-ip-range={SERVICE_RANGE}",
        "--health-port=0",
        "--metrics-port=0",
        "--v=1",
    ]


def without_kube_router(filter_table: str) -> str:
    """``iptables-save -t filter``'s output less every chain of kube-router's and every rule naming one: what
    ``iptables-restore -T filter`` takes back to leave the host's own rules as they were."""
    return "".join(line for line in filter_table.splitlines(keepends=True) if not KUBE_ROUTER_CHAIN.search(line))


def _run(*argv: str, stdin: str | None = None) -> str:
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False, timeout=60)
    if result.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} exited {result.returncode}: {result.stderr.strip()}")
    return result.stdout


def installed() -> bool:
    """Whether kube-router's chains are in the filter table (it has synced its rules at least once)."""
    return bool(KUBE_ROUTER_CHAIN.search(_run("iptables-save", "-t", "filter")))


def remove_rules() -> None:
    """kube-router's chains and ipsets, gone; the host's other rules kept."""
    table = _run("iptables-save", "-t", "filter")
    if KUBE_ROUTER_CHAIN.search(table):
        _run("iptables-restore", "-T", "filter", stdin=without_kube_router(table))
    for name in _run("ipset", "list", "-n").split():
        if KUBE_ROUTER_IPSET.match(name):
            _run("ipset", "destroy", name)


class NetworkPolicyEngine:
    """kube-router's policy controller for ``node``: :meth:`start` returns once its rules are in place, :meth:`stop`
    once it has exited and its rules are gone."""

    def __init__(self, node: RealNode) -> None:
        self.node = node

    def start(self, state: ClusterState, timeout: float = 60) -> None:
        reason = unavailable_reason(self.node)
        if reason is not None:
            raise ClusterError(f"NetworkPolicies cannot be enforced here: {reason}")
        if BRIDGE_NF_CALL.read_text().strip() != "1":
            BRIDGE_NF_CALL.write_text("1\n")
        self.node.cluster._start(state, PROCESS, binary(self.node), arguments(state.kubeconfig, self.node.name))
        deadline = time.monotonic() + timeout
        while not installed():
            if time.monotonic() > deadline:
                raise ClusterError(f"kube-router installed no rules in {timeout:.0f} s:\n{self.logs()[-3000:]}")
            time.sleep(0.5)

    def stop(self, state: ClusterState) -> None:
        process = next((p for p in state.processes if p.name == PROCESS), None)
        if process is not None:
            terminate(process)
            state.processes = [p for p in state.processes if p.name != PROCESS]
            state.save()
        remove_rules()

    def logs(self) -> str:
        log = self.node.cluster.logs / f"{PROCESS}.log"
        return log.read_text(errors="replace") if log.exists() else ""
