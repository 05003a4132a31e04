"""The real node's cluster DNS: CoreDNS (its ``kubernetes`` plugin) on the node's bridge address, port 53, the
kubelet's ``clusterDNS``. Pods of ``dnsPolicy: ClusterFirst`` (Kubernetes' default) resolve Services and the pods of
headless Services (``<pod>.<service>.<namespace>.svc``: the stable names of the operator's workload identity,
docs/workload-identity.md) as on any cluster. Names outside ``cluster.local`` get REFUSED: nothing upstream is
reachable from this machine.

A host process of the cluster (a Deployment behind the ``kube-dns`` Service elsewhere; the node has no kube-proxy,
so the Service's address would route nowhere), reading the API server with the cluster's admin kubeconfig.
"""

from __future__ import annotations

import socket
from pathlib import Path

from weightsync_tools.localcluster.cluster import ClusterError, ClusterState, LocalCluster, _wait

#: build-node-binaries.sh's COREDNS_VERSION (a unit test keeps the two equal).
VERSION = "v1.15.0"
PROCESS = "cluster-dns"
DOMAIN = "cluster.local"


def binary(directory: Path) -> Path:
    """CoreDNS in the node binaries' cache ``directory``."""
    return directory / f"coredns-{VERSION}" / "coredns"


def corefile(kubeconfig: Path, address: str) -> str:
    """The cluster domain from the API server (pod records by IP too, as kube-dns had them), bound to ``address``
    alone (the host's own resolver may hold port 53 elsewhere); every other name refused."""
    return (
        f"{DOMAIN}:53 {{\n"
        f"    bind {address}\n"
        "    errors\n"
        f"    kubernetes {DOMAIN} {{\n"
        f"        kubeconfig {kubeconfig}\n"
        "        pods insecure\n"
        "    }\n"
        "}\n"
    )


def _answers(address: str) -> bool:
    """Whether something answers DNS over UDP at ``address``:53 (a query for the API server's Service name)."""
    # A query of kubernetes.default.svc.cluster.local, type A: header (id 1, recursion desired, one question), name.
    name = b"".join(bytes([len(label)]) + label.encode() for label in f"kubernetes.default.svc.{DOMAIN}".split("."))
    query = b"\x00\x01\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + name + b"\x00\x00\x01\x00\x01"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(0.5)
        try:
            sock.sendto(query, (address, 53))
            return sock.recv(512)[:2] == b"\x00\x01"
        except OSError:
            return False


def start(cluster: LocalCluster, state: ClusterState, directory: Path, address: str, timeout: float = 30) -> None:
    """CoreDNS from the binaries' cache ``directory``, serving at ``address``; returns once it answers."""
    found = binary(directory)
    if not found.is_file():
        raise ClusterError(f"{found} is not built (build-node-binaries.sh builds it)")
    config = cluster.directory / "realnode" / "Corefile"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(corefile(state.kubeconfig, address))
    cluster._start(state, PROCESS, found, [f"-conf={config}"])
    _wait("the cluster DNS", lambda: _answers(address), timeout, cluster.logs / f"{PROCESS}.log")
