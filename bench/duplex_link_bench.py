"""How much of a testbed link's inbound rate is left while the node also sends at full rate (needs root).

One emulated node (``weightsync_tools.testbed``: a namespace, a veth pair to the bridge, tc tbf both ways), the
trainer's gather into it (``gather.py``: a source process in the root namespace, a sink process in the node,
two requests ahead) of ``--mib`` MiB, first alone, then while a plain TCP stream from the node saturates its
outbound direction. No Mooncake and no agents: what this shows is the emulated link's, not the round's.

    sudo python bench/duplex_link_bench.py [--rate 500mbit] [--mib 256] [--mtu 9000] [--latency 100ms]

Measured on the 2-core development machine (27 Nov 2026): at MTU 1500 alone 4.485 s (0.96 of the link: tbf
charges each 1448-byte segment's 66 bytes of headers), with the outbound stream 4.673 s (0.92: the other
direction's ACKs too); at MTU 9000 4.321 s (0.99) and 4.453 s (0.96) (docs/testbed.md, "MTU").
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time

from weightsync_tools.testbed.gather import GatherLink
from weightsync_tools.testbed.netns import DEFAULT_MTU, burst_bytes
from weightsync_tools.testbed.runner import build_testbed
from weightsync_tools.testbed.scenario import Layout, parse_rate

MiB = 1 << 20
PIECE = 4 * MiB
AHEAD = 2


def _drain_forever(server: socket.socket) -> None:
    def drain(conn: socket.socket) -> None:
        buffer = bytearray(4 * MiB)
        while conn.recv_into(buffer):
            pass

    while True:
        conn, _ = server.accept()
        threading.Thread(target=drain, args=(conn,), daemon=True).start()


def _gather(link: GatherLink, total: int) -> float:
    sizes = [PIECE] * (total // PIECE)
    started = time.monotonic()
    for size in sizes[:AHEAD]:
        link.request(size)
    for position in range(len(sizes)):
        link.wait()
        if position + AHEAD < len(sizes):
            link.request(sizes[position + AHEAD])
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="500mbit")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--mtu", type=int, default=DEFAULT_MTU, help="every link's MTU (default %(default)s)")
    parser.add_argument("--latency", default=None, help="the tbf queue of both directions (default: the testbed's)")
    args = parser.parse_args()
    rate = parse_rate(args.rate)
    testbed = build_testbed(Layout(trainers=1, engines=1, tp=1), rate, args.mtu)
    testbed.create()
    processes: list[subprocess.Popen[bytes]] = []
    try:
        node, link_of = "t0", testbed.links["t0"]
        if args.latency:
            burst = str(burst_bytes(rate))
            for where, dev in ((["-n", testbed.ns(node)], link_of.ns_if), ([], link_of.host_if)):
                tbf = ["tbf", "rate", f"{rate}bit", "burst", burst, "latency", args.latency]
                subprocess.run(["tc", *where, "qdisc", "change", "dev", dev, "root", *tbf], check=True)
        gateway, address = testbed.gateway, link_of.address
        module = [sys.executable, "-m", "weightsync_tools.testbed.gather"]
        for command in ([*module, "source", "--host", gateway, "--port", "29480"],
                        [*testbed.wrap(node), *module, "sink", "--host", address, "--port", "9480",
                         "--source", f"{gateway}:29480"]):  # fmt: skip
            process = subprocess.Popen(command, stdout=subprocess.PIPE)
            assert process.stdout is not None
            process.stdout.readline()
            processes.append(process)
        link = GatherLink(address, 9480)
        total = args.mib * MiB
        alone = _gather(link, total)
        server = socket.create_server((gateway, 29999))
        threading.Thread(target=_drain_forever, args=(server,), daemon=True).start()
        code = (f"import socket\ns = socket.create_connection(('{gateway}', 29999))\nz = bytes(4 << 20)\n"
                "while True: s.sendall(z)")  # fmt: skip
        processes.append(subprocess.Popen([*testbed.wrap(node), sys.executable, "-c", code]))
        time.sleep(2)
        before = link_of.counters()
        busy = _gather(link, total)
        after = link_of.counters()
        bound = total * 8 / rate
        queue = args.latency or "the testbed default"
        print(f"# one node, {args.rate} per direction, MTU {args.mtu}, tbf queue {queue}")
        print(f"gather {args.mib} MiB alone                    {alone:.3f} s  ({bound / alone:.2f} of the link)")
        print(f"gather {args.mib} MiB, outbound saturated      {busy:.3f} s  ({bound / busy:.2f} of the link)")
        print(f"# outbound meanwhile: {(after[1] - before[1]) / MiB:.0f} MiB; busy / alone = {busy / alone:.3f}")
    finally:
        for process in processes:
            process.kill()
        testbed.destroy()


if __name__ == "__main__":
    main()
