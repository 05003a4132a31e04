"""One engine's data link, down or slowed, on loopback (the fault matrix's ``link-down`` and ``link-slow``). Test-only,
root only (``tc`` needs CAP_NET_ADMIN).

Every process of a local group shares ``lo``, so the fault is cut by port: the engine process's listening ports in
Mooncake's range (its handshake and data ports, per rank: docs/security.md, "Mooncake's ports, pinned") are steered,
both ways, by ``u32`` filters into an ``htb`` class of their own: held to a rate (slowed), or to 8 bit/s behind a
one-packet queue (down: nothing gets through). Everything else takes a class of 100 Gbit/s. Only ``htb``, ``tbf``,
the fifos and ``u32`` are needed (the VMs here have no ``netem``, ``prio`` or tc actions). ``tc qdisc del dev lo
root`` puts ``lo`` back as it was.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable

#: ``ss -Hltnp``'s process column: users:(("python",pid=123,fd=7),...).
_PID = re.compile(r"pid=(\d+)")


def listening_ports(pid: int, within: range) -> list[int]:
    """The TCP ports process ``pid`` listens on, within ``within``."""
    shown = subprocess.run(["ss", "-Hltnp"], check=True, capture_output=True, text=True).stdout
    ports: set[int] = set()
    for line in shown.splitlines():
        fields = line.split()
        if len(fields) < 6 or pid not in {int(p) for p in _PID.findall(fields[-1])}:
            continue
        port = int(fields[3].rsplit(":", 1)[1])
        if port in within:
            ports.add(port)
    return sorted(ports)


class LinkFault:
    """The link to ``ports`` slowed to ``rate`` (tc's units), or down (``rate=None``), from :meth:`install` to
    :meth:`remove`."""

    def __init__(self, ports: Iterable[int], *, rate: str | None = None, device: str = "lo") -> None:
        self.ports = sorted(set(ports))
        if not self.ports:
            raise ValueError("a link fault needs the ports it cuts")
        self.rate, self.device = rate, device
        self.installed = False

    def _tc(self, *args: str, check: bool = True) -> None:
        subprocess.run(["tc", *args], check=check, capture_output=True, text=True)

    def install(self) -> None:
        dev = self.device
        # r2q: htb derives each class's quantum from its rate; the default would warn on both extremes.
        self._tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1", "r2q", "100000")
        self.installed = True
        self._tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit")
        self._tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:2", "htb", "rate", self.rate or "8bit")
        if self.rate is None:  # down: what does not fit one packet's queue is dropped
            self._tc("qdisc", "add", "dev", dev, "parent", "1:2", "handle", "20:", "pfifo", "limit", "1")
        for port in self.ports:
            for direction in ("dport", "sport"):
                self._tc("filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                         "match", "ip", direction, str(port), "0xffff", "flowid", "1:2")  # fmt: skip

    def remove(self) -> None:
        if self.installed:
            self._tc("qdisc", "del", "dev", self.device, "root", check=False)
            self.installed = False
