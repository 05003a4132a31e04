"""Emulated nodes on one machine: network namespaces, veth links to a bridge, tc caps per link.

::

    root namespace: bridge wsb-<tag>-br 10.231.<s>.1/24  (the benchmark process, the trainers' clients)
       │            │                 │                         │
     veth         veth              veth                     veth            each link: tbf `rate` on
       │            │                 │                         │            both ends = both directions
    ns wsb-<tag>-t0 … ns wsb-<tag>-t3  ns wsb-<tag>-e0            ns wsb-<tag>-e1
    eth0 10.231.s.10   eth0 .13        r0 .100   r1 .101          r0 .102   r1 .103
    agent (+coordinator) agent         reference engine 0         reference engine 1
    broadcast sender                   (rank r's Mooncake session  (one process, both ranks)
                                        on link r)

A trainer node is a namespace with one link. An engine's process holds all its tensor-parallel ranks
(the reference engine is one process per engine), so its namespace gets **one link per rank**, each
with its own address and cap: rank r's Mooncake session advertises the address of link r, and the
namespace answers ARP for an address only on its own link (``arp_ignore=1``) and routes replies from it
back out of the same link (a policy-routing table per link). So every inference rank has its own node
link, as engine pods of one rank each have.

Names carry a tag made of the creating process id (``wsb-<pid in base 36>``): a later run removes the
leftovers of runs whose process is gone (:func:`cleanup_leftovers`) and never touches a live run's.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("weightsync.testbed")

PREFIX = "wsb-"
DEFAULT_MTU = 9000
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


class NetnsUnavailableError(RuntimeError):
    """This process may not create network namespaces (not root, or no ``ip``/``tc``)."""


def _base36(number: int) -> str:
    out = ""
    while True:
        number, digit = divmod(number, 36)
        out = _DIGITS[digit] + out
        if number == 0:
            return out


def tag_for(pid: int) -> str:
    return f"{PREFIX}{_base36(pid)}"


def _pid_of(name: str) -> int | None:
    match = re.match(rf"^{PREFIX}([0-9a-z]+)(-|$)", name)
    return int(match.group(1), 36) if match else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def check_available() -> None:
    """Raise :class:`NetnsUnavailableError` with the reason unless namespaces can be made here."""
    if os.geteuid() != 0:
        raise NetnsUnavailableError(
            "creating network namespaces needs root (run as root, or use --no-caps for loopback)"
        )
    for tool in ("ip", "tc", "sysctl"):
        if shutil.which(tool) is None:
            raise NetnsUnavailableError(f"`{tool}` is not installed (iproute2 / procps)")
    probe = f"{tag_for(os.getpid())}-probe"
    done = _run("ip", "netns", "add", probe, check=False)
    if done.returncode != 0:
        raise NetnsUnavailableError(f"`ip netns add` is not permitted here: {done.stderr.strip()}")
    _run("ip", "netns", "del", probe, check=False)


def namespaces() -> list[str]:
    done = _run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def links() -> list[str]:
    done = _run("ip", "-o", "link", "show", check=False)
    names = []
    for line in done.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def cleanup_leftovers() -> list[str]:
    """Remove ``wsb-*`` namespaces and links whose creating process no longer runs; returns their names."""
    removed: list[str] = []
    for name in namespaces():
        pid = _pid_of(name)
        if pid is not None and not _alive(pid):
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    for name in links():
        pid = _pid_of(name)
        if pid is not None and not _alive(pid):
            _run("ip", "link", "del", name, check=False)
            removed.append(name)
    return removed


def burst_bytes(rate_bits: int) -> int:
    """tbf bucket: 10 ms at the rate, at least 256 KiB (a 64 KiB GSO packet must fit)."""
    return max(256 * 1024, rate_bits // 8 // 100)


@dataclass
class NodeLink:
    """One node link: a veth pair, ``host_if`` on the bridge, ``ns_if`` inside ``namespace``."""

    node: str
    namespace: str
    host_if: str
    ns_if: str
    address: str
    table: int = 0  # policy-routing table in a namespace with several links; 0 when it has one

    def counters(self) -> tuple[int, int]:
        """(bytes into the node, bytes out of the node) so far: the host end's tx and rx counters."""
        base = Path("/sys/class/net") / self.host_if / "statistics"
        return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())


@dataclass
class Testbed:
    """A bridge plus namespaces with capped links; ``namespace_links`` maps each namespace to its nodes."""

    namespace_links: Mapping[str, list[tuple[str, str]]]  # short ns name -> [(node, address)]
    subnet: int
    rate_bits: int | None
    #: Every link's MTU. tbf charges each segment's headers, so at 1500 a TCP stream's payload gets 0.956 of the
    #: rate and the reverse direction's ACKs another ~2 %; 9000 (jumbo frames, as data-centre fabrics run) 0.993.
    mtu: int = DEFAULT_MTU
    tag: str = field(default_factory=lambda: tag_for(os.getpid()))
    links: dict[str, NodeLink] = field(default_factory=dict)  # node -> link
    created: bool = False

    @property
    def bridge(self) -> str:
        return f"{self.tag}-br"

    @property
    def gateway(self) -> str:
        return f"10.231.{self.subnet}.1"

    def ns(self, short: str) -> str:
        return f"{self.tag}-{short}"

    def wrap(self, short: str, env: Mapping[str, str] | None = None) -> tuple[str, ...]:
        """Command prefix that runs a program inside namespace ``short`` (with extra environment)."""
        extra = tuple(f"{k}={v}" for k, v in (env or {}).items())
        return ("ip", "netns", "exec", self.ns(short), *(("env", *extra) if extra else ()))

    # --- Lifecycle -------------------------------------------------------------------------------

    def create(self) -> Testbed:
        atexit.register(self.destroy)
        self.created = True
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise
        return self

    def _create(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "mtu", str(self.mtu))
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for short, nodes in self.namespace_links.items():
            ns = self.ns(short)
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            multi = len(nodes) > 1
            if multi:  # answer ARP only on the link that holds the address; no reverse-path drops
                _sysctl(ns, "net.ipv4.conf.all.arp_ignore=1", "net.ipv4.conf.all.arp_announce=2",
                        "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0")  # fmt: skip
            for index, (node, address) in enumerate(nodes):
                link = NodeLink(node, ns, f"{self.tag}-{node}", f"eth{index}", address, 100 + index if multi else 0)
                self.links[node] = link
                _run("ip", "link", "add", link.host_if, "mtu", str(self.mtu), "type", "veth", "peer", "name",
                     link.ns_if, "mtu", str(self.mtu), "netns", ns)  # fmt: skip
                _run("ip", "link", "set", link.host_if, "master", self.bridge, "up")
                _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", link.ns_if)
                _run("ip", "-n", ns, "link", "set", link.ns_if, "up")
                if multi:
                    _sysctl(ns, f"net.ipv4.conf.{link.ns_if}.rp_filter=0")
                    net = f"10.231.{self.subnet}.0/24"
                    table = str(link.table)
                    _run("ip", "-n", ns, "route", "add", net, "dev", link.ns_if, "src", address, "table", table)
                    _run("ip", "-n", ns, "rule", "add", "from", address, "table", str(link.table))
                if self.rate_bits is not None:
                    self._cap(None, link.host_if)  # into the node
                    self._cap(ns, link.ns_if)  # out of the node

    def _cap(self, ns: str | None, dev: str) -> None:
        assert self.rate_bits is not None
        where = ("-n", ns) if ns else ()
        _run("tc", *where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{self.rate_bits}bit",
             "burst", str(burst_bytes(self.rate_bits)), "latency", "100ms")  # fmt: skip

    def destroy(self) -> None:
        """Delete every namespace and link of this testbed (idempotent; also runs at exit)."""
        if not self.created:
            return
        self.created = False
        with contextlib.suppress(Exception):
            atexit.unregister(self.destroy)
        for short in self.namespace_links:
            _run("ip", "netns", "del", self.ns(short), check=False)  # deletes the veth pairs inside too
        for link in self.links.values():
            if link.host_if in links():
                _run("ip", "link", "del", link.host_if, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        leftover = [n for n in namespaces() if n.startswith(self.tag + "-")] + [
            n for n in links() if n.startswith(self.tag + "-")
        ]
        if leftover:
            log.warning("testbed %s: could not remove %s", self.tag, leftover)

    def __enter__(self) -> Testbed:
        return self.create()

    def __exit__(self, *_: object) -> None:
        self.destroy()

    # --- Measuring -------------------------------------------------------------------------------

    def counters(self) -> dict[str, tuple[int, int]]:
        return {node: link.counters() for node, link in self.links.items()}


def counter_delta(
    before: Mapping[str, tuple[int, int]], after: Mapping[str, tuple[int, int]]
) -> dict[tuple[str, str], int]:
    """Per (node, "in"|"out"): bytes that crossed the link between two :meth:`Testbed.counters` snapshots."""
    out: dict[tuple[str, str], int] = {}
    for node, (into, outof) in after.items():
        was_in, was_out = before.get(node, (0, 0))
        out[(node, "in")] = into - was_in
        out[(node, "out")] = outof - was_out
    return out


def _sysctl(ns: str, *settings: str) -> None:
    _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", *settings)


def free_subnet(candidates: Iterable[int] = range(16, 250)) -> int:
    """A ``10.231.<s>.0/24`` no interface of the root namespace uses."""
    used = _run("ip", "-o", "-4", "addr", "show", check=False).stdout
    for subnet in candidates:
        if f"10.231.{subnet}." not in used:
            return subnet
    raise RuntimeError("no free 10.231.x.0/24 subnet")
