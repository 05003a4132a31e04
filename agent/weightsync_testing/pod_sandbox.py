"""Pod sandboxes for kwok pods: each pod gets a network namespace at the IP kwok gave it, on a bridge, the DNS names of
its group's pods, its own host name and its own ``/dev/shm``, so the processes a test starts for it see what a pod's
containers see.

What that buys over loopback: every pod has its own address and ports (two job leaders both listen on 29500, as
they do in a cluster), the names in the operator's workload identity (``<pod>.<group>.<ns>.svc``) resolve (through
the namespace's ``/etc/hosts``: ``ip netns exec`` mounts ``/etc/netns/<ns>/hosts`` over it), and peers reach each
other by pod IP, so nothing needs ``WEIGHTSYNC_LOOPBACK_PEERS``. Each process runs in a mount namespace of its own in
which the pod's shared-memory folder is ``/dev/shm`` (all of one pod's processes share it, as a pod's containers share
its memory volume; another pod's are apart: SGLang, for one, decides which ranks share a node by opening a
shared-memory segment). The local API server listens on the root
namespace's loopback only: a forwarder in every pod's namespace listens on its loopback at the API server's port and
relays through the bridge to one in the root namespace, so an agent's kubeconfig (``https://127.0.0.1:<port>``, whose
certificate names 127.0.0.1) works unchanged. Needs root (``ip netns``); test-only.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: The bridge's own address inside kwok's pod range (``--cidr=10.0.0.1/16``), at its end, where kwok never
#: allocates in a test.
GATEWAY = "10.0.255.254"
PREFIX = 16
FORWARD_PORT = 16443  # the root namespace's forwarder, on the gateway
#: Where each pod's /dev/shm lives (memory, as a pod's ``medium: Memory`` volume).
SHM_ROOT = Path("/dev/shm/weightsync-pods")


class PodSandboxUnavailableError(RuntimeError):
    """This machine cannot make network namespaces (not root, or no ``ip``)."""


def check_available() -> None:
    if os.geteuid() != 0:
        raise PodSandboxUnavailableError("network and mount namespaces need root")
    if shutil.which("ip") is None:
        raise PodSandboxUnavailableError("no ip command (iproute2)")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if check and result.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


@dataclass
class PodSandboxes:
    """A bridge ``<tag>-br``, and per added pod a network namespace ``<tag>-<n>`` and a shared-memory folder;
    :meth:`close` removes them all."""

    api_port: int
    tag: str = field(default_factory=lambda: f"wsp{os.getpid() % 100000}")
    namespaces: dict[str, str] = field(default_factory=dict)  # pod name -> namespace
    shm: dict[str, Path] = field(default_factory=dict)  # pod name -> its /dev/shm
    forwarders: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _up: bool = False

    @property
    def bridge(self) -> str:
        return f"{self.tag}-br"

    def open(self) -> PodSandboxes:
        check_available()
        atexit.register(self.close)  # Ctrl-C included; a SIGKILL leaves them (``ip netns list | grep wsp``)
        _ip("link", "add", self.bridge, "type", "bridge")
        self._up = True
        _ip("addr", "add", f"{GATEWAY}/{PREFIX}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self.forwarders.append(_forward([], GATEWAY, FORWARD_PORT, "127.0.0.1", self.api_port))
        return self

    def add(self, pod: str, ip: str, hosts: Mapping[str, str]) -> None:
        """Pod ``pod`` at ``ip``, resolving each of ``hosts`` (name -> IP)."""
        ns = f"{self.tag}-{len(self.namespaces)}"
        host_if, pod_if = f"{ns}-h", f"{ns}-p"
        _ip("netns", "add", ns)
        self.namespaces[pod] = ns
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", host_if, "type", "veth", "peer", "name", pod_if, "netns", ns)
        _ip("link", "set", host_if, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{ip}/{PREFIX}", "dev", pod_if)
        _ip("-n", ns, "link", "set", pod_if, "up")
        _ip("-n", ns, "route", "add", "default", "via", GATEWAY)
        self.shm[pod] = SHM_ROOT / ns
        self.shm[pod].mkdir(parents=True, exist_ok=True)
        folder = Path("/etc/netns") / ns
        folder.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost", f"{ip} {pod}", *(f"{address} {name}" for name, address in hosts.items())]
        (folder / "hosts").write_text("\n".join(lines) + "\n")
        # No cluster DNS here: a lookup the hosts file cannot answer (gloo's and c10d's reverse lookups of peers) fails
        # at once instead of waiting on a name server the namespace cannot reach.
        (folder / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        wrap = ["ip", "netns", "exec", ns]
        self.forwarders.append(_forward(wrap, "127.0.0.1", self.api_port, GATEWAY, FORWARD_PORT))

    def wrap(self, pod: str) -> list[str]:
        """The command prefix that runs a process in ``pod``'s sandbox: its network namespace (its hosts file
        mounted), the pod's name as host name, as a pod's containers have it (the operator sets ``hostname``; gloo,
        for one, finds its own address by resolving it), and the pod's ``/dev/shm``."""
        script = 'hostname "$0" && mount --bind "$1" /dev/shm && shift && exec "$@"'
        pod_view = [
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            pod,
            str(self.shm[pod]),
        ]
        return ["ip", "netns", "exec", self.namespaces[pod], *pod_view]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        for forwarder in self.forwarders:
            if forwarder.poll() is None:
                forwarder.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    forwarder.wait(timeout=5)
        self.forwarders.clear()
        for pod, ns in self.namespaces.items():
            _ip("netns", "del", ns, check=False)  # its veth pair goes with it
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
            shutil.rmtree(self.shm.get(pod, SHM_ROOT / ns), ignore_errors=True)
        self.namespaces.clear()
        self.shm.clear()
        if self._up:
            _ip("link", "del", self.bridge, check=False)
            self._up = False

    def __enter__(self) -> PodSandboxes:
        return self.open()

    def __exit__(self, *_: object) -> None:
        self.close()


def _forward(wrap: Sequence[str], host: str, port: int, to_host: str, to_port: int) -> subprocess.Popen[bytes]:
    command = [*wrap, sys.executable, "-m", "weightsync_testing.tcp_forward", host, str(port), to_host, str(to_port)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    assert process.stdout is not None
    if process.stdout.readline().strip() != b"listening":  # bound before anyone connects
        process.kill()
        raise RuntimeError(f"the forwarder {host}:{port} -> {to_host}:{to_port} did not start")
    return process
