"""Transfer benchmark: the same N bytes moved six ways on this machine, in one run.

    python bench/transfer_bench.py [--size MIB] [--reps N] [--chunk-mib C] [--poll-ms P] [--sweep] [--json PATH]

Rows: memcpy (``torch.Tensor.copy_``); a plain Python socket between two processes (``sendall`` /
``recv_into``, loopback); torch.distributed gloo broadcast 1 -> 1; the Mooncake engine used directly
(one ``transfer_submit_write``, polled with ``transfer_check_status`` and a sleep); and our
``MooncakeTransport`` 1 -> 1 (chunked submit + poll through ``wait_all``). ``--sweep`` adds our transport
at other chunk sizes and poll intervals. Each transfer ends when the receiver has everything (an ack for
the socket and gloo; Mooncake completes a write once the target acked it). Modes run round-robin, one
rep of each in turn, so load from other processes hits them alike; the target is zeroed before every rep
and its xxh3 hash checked after the last. GB/s is 10^9 bytes per second. The table ends with our median
over the socket's and the median of per-rep ratios (the goal: within 10%, i.e. >= 0.90); on a shared
machine single reps vary by tens of percent, so read ratios over several runs. A benchmark, not a
test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from importlib import metadata
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch._C._distributed_c10d import TCPStore

from weightsync_agent.transport.base import wait_all
from weightsync_agent.transport.mooncake import MooncakeTransport

MiB = 1 << 20
TIMEOUT = 120.0


def fill(nbytes: int) -> torch.Tensor:
    """A fast non-trivial pattern (torch.randint takes ~9 s per GiB here)."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    words = out[: nbytes // 8 * 8].view(torch.int64)
    torch.arange(words.numel(), dtype=torch.int64, out=words)
    words.mul_(-7046029254386353131).bitwise_xor_(words >> 29)
    out[nbytes // 8 * 8 :] = 7
    return out


def digest(buffer: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(buffer.numpy().data)


# ------------------------------------------------------------------------------------- children


def _serve(conn: Connection, buffer: torch.Tensor, extra: Callable[[str], None] | None = None) -> None:
    while True:
        command = conn.recv()
        if command == "zero":
            buffer.zero_()
            conn.send(True)
        elif command == "hash":
            conn.send(digest(buffer))
        elif command == "quit":
            return
        elif extra is not None:
            extra(command)


def socket_child(conn: Connection, nbytes: int) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    conn.send(server.getsockname()[1])
    peer, _ = server.accept()
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    view = buffer.numpy().data.cast("B")

    def receive(_: str) -> None:
        got = 0
        while got < nbytes:
            got += peer.recv_into(view[got:], nbytes - got)
        peer.sendall(b"k")

    _serve(conn, buffer, receive)


def gloo_child(conn: Connection, port: int, nbytes: int) -> None:
    store = TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=TIMEOUT))
    group: Any = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=TIMEOUT))
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    ack = torch.zeros(1)

    def receive(_: str) -> None:
        group.broadcast([buffer], _root(0)).wait()
        group.broadcast([ack], _root(1)).wait()

    conn.send(True)
    _serve(conn, buffer, receive)


def mooncake_child(conn: Connection, nbytes: int) -> None:
    transport = MooncakeTransport("127.0.0.1", "tcp", timeout_seconds=TIMEOUT)
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    transport.register(buffer.data_ptr(), nbytes)
    conn.send((transport.session_id, buffer.data_ptr()))
    _serve(conn, buffer)
    transport.close()


def _root(rank: int) -> Any:
    options = dist.BroadcastOptions()
    options.rootRank = rank
    return options


# ----------------------------------------------------------------------------------------- modes


@dataclass
class Mode:
    name: str
    run: Callable[[], None]
    control: Connection | None  # the receiver's control pipe (None: in-process)
    seconds: list[float] = field(default_factory=list)
    verified: bool | None = None

    def rate(self, nbytes: int) -> list[float]:
        return [nbytes / s / 1e9 for s in self.seconds]


def start(target: Callable[..., None], *args: Any) -> tuple[Any, Connection]:
    parent, child = mp.get_context("spawn").Pipe()
    process = mp.get_context("spawn").Process(target=target, args=(child, *args), daemon=True)
    process.start()
    return process, parent


def stop(conn: Connection, process: Any, grace: float) -> None:
    conn.send("quit")
    process.join(grace)
    if process.is_alive():
        process.kill()
        process.join()


def ask(conn: Connection, command: str) -> Any:
    conn.send(command)
    if not conn.poll(TIMEOUT):
        raise TimeoutError(f"no answer to {command!r}")
    return conn.recv()


def build_modes(args: argparse.Namespace, source: torch.Tensor, cleanup: list[Callable[[], None]]) -> list[Mode]:
    nbytes = source.numel()
    modes: list[Mode] = []

    memcpy_target = torch.empty_like(source)

    def memcpy() -> None:
        memcpy_target.copy_(source)

    modes.append(Mode("memcpy torch copy_", memcpy, None))

    process, sock_ctl = start(socket_child, nbytes)
    cleanup.append(lambda: stop(sock_ctl, process, 10))
    sock = socket.create_connection(("127.0.0.1", sock_ctl.recv()))
    data = source.numpy().data.cast("B")

    def via_socket() -> None:
        sock_ctl.send("recv")
        sock.sendall(data)
        sock.recv(1)

    modes.append(Mode("python socket sendall/recv_into", via_socket, sock_ctl))

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process_g, gloo_ctl = start(gloo_child, port, nbytes)
    cleanup.append(lambda: stop(gloo_ctl, process_g, 10))
    store = TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=TIMEOUT))
    group: Any = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=TIMEOUT))
    gloo_ctl.recv()
    ack = torch.zeros(1)

    def via_gloo() -> None:
        gloo_ctl.send("bcast")
        group.broadcast([source], _root(0)).wait()
        group.broadcast([ack], _root(1)).wait()

    modes.append(Mode("gloo broadcast 1->1", via_gloo, gloo_ctl))

    process_m, mc_ctl = start(mooncake_child, nbytes)
    cleanup.append(lambda: stop(mc_ctl, process_m, 30))
    session, remote = mc_ctl.recv()
    configs = [(args.chunk_mib, args.poll_ms)]
    if args.sweep:
        configs += [(c, args.poll_ms) for c in (16, 256, 1 << 20) if c != args.chunk_mib]
        configs += [(args.chunk_mib, p) for p in (0.1, 2.0, 5.0) if p != args.poll_ms]
    for chunk_mib, poll_ms in configs:
        transport = MooncakeTransport("127.0.0.1", "tcp", timeout_seconds=TIMEOUT, chunk_bytes=chunk_mib * MiB)
        cleanup.append(transport.close)
        transport.register(source.data_ptr(), nbytes)
        if not transport.probe(session, 30):
            raise RuntimeError(f"Mooncake target {session} did not answer")

        def via_ours(t: MooncakeTransport = transport, poll: float = poll_ms / 1000) -> None:
            transfer = t.submit_write(session, source.data_ptr(), remote, nbytes)
            if wait_all([transfer], time.monotonic() + TIMEOUT, poll):
                raise RuntimeError(f"MooncakeTransport write failed: {transfer.error()}")

        chunk = "whole" if chunk_mib >= 1 << 20 else f"{chunk_mib} MiB"
        modes.append(Mode(f"ours MooncakeTransport chunk {chunk}, poll {poll_ms:g} ms", via_ours, mc_ctl))
    modes.insert(3, raw_mooncake(session, remote, source, args.poll_ms, mc_ctl, cleanup))
    return modes


def raw_mooncake(
    session: str,
    remote: int,
    source: torch.Tensor,
    poll_ms: float,
    control: Connection,
    cleanup: list[Callable[[], None]],
) -> Mode:
    from mooncake.engine import TransferEngine  # after our transports set the MC_* environment

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake initialize failed")
    engine.register_memory(source.data_ptr(), source.numel())
    cleanup.append(lambda: engine.unregister_memory(source.data_ptr()))

    def via_raw() -> None:
        batch = engine.transfer_submit_write(session, source.data_ptr(), remote, source.numel())
        if batch <= 0:
            raise RuntimeError(f"transfer_submit_write returned {batch}")
        while (status := engine.transfer_check_status(batch)) == 0:
            time.sleep(poll_ms / 1000)
        if status != 1:
            raise RuntimeError(f"transfer_check_status returned {status}")

    return Mode(f"mooncake engine direct, 1 request, poll {poll_ms:g} ms", via_raw, control)


# ------------------------------------------------------------------------------------------ main


def machine() -> dict[str, Any]:
    model = "unknown"
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break

    def version(dist_name: str) -> str:
        try:
            return metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            return "absent"

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "mooncake": version("mooncake-transfer-engine-non-cuda"),
    }


def summarize(mode: Mode, nbytes: int) -> dict[str, Any]:
    rates = mode.rate(nbytes)
    return {
        "name": mode.name,
        "reps": len(rates),
        "GBps_min": round(min(rates), 3),
        "GBps_median": round(statistics.median(rates), 3),
        "GBps_max": round(max(rates), 3),
        "verified": mode.verified,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--size", type=int, default=256, help="MiB per transfer (default 256)")
    parser.add_argument("--reps", type=int, default=5, help="reps per mode (default 5)")
    parser.add_argument("--chunk-mib", type=int, default=64, help="our chunk size (default 64)")
    parser.add_argument("--poll-ms", type=float, default=0.5, help="our poll interval (default 0.5)")
    parser.add_argument("--sweep", action="store_true", help="also other chunk sizes and poll intervals")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    nbytes = args.size * MiB
    info = machine()
    print(
        f"# {info['date']}  {info['cpu_model']}, {info['cpu_count']} CPUs ({info['cpus_usable']} usable), "
        f"load {' '.join(f'{x:.2f}' for x in info['load_average'])}"
    )
    print(
        f"# python {info['python']}, torch {info['torch']} ({info['torch_threads']} threads), "
        f"mooncake {info['mooncake']}; {args.size} MiB x {args.reps} reps, round-robin"
    )
    source = fill(nbytes)
    expected = digest(source)
    cleanup: list[Callable[[], None]] = []
    try:
        modes = build_modes(args, source, cleanup)
        for mode in modes:  # one untimed rep each: connections, page faults, first handshakes
            mode.run()
        for rep in range(args.reps):
            for mode in modes:
                if mode.control is not None:
                    ask(mode.control, "zero")
                started = time.perf_counter()
                mode.run()
                mode.seconds.append(time.perf_counter() - started)
                if rep == args.reps - 1 and mode.control is not None:
                    mode.verified = ask(mode.control, "hash") == expected
    finally:
        for step in reversed(cleanup):
            try:
                step()
            except Exception as exc:  # a benchmark tears down what it can and still reports
                print(f"# cleanup: {exc}", file=sys.stderr)
    rows = [summarize(mode, nbytes) for mode in modes]
    print(f"{'mode':<50} {'reps':>4} {'min':>7} {'median':>7} {'max':>7}  verified")
    for row in rows:
        print(
            f"{row['name']:<50} {row['reps']:>4} {row['GBps_min']:>7.2f} {row['GBps_median']:>7.2f} "
            f"{row['GBps_max']:>7.2f}  {row['verified']}"
        )
    socket_mode = next(m for m in modes if m.name.startswith("python socket"))
    ours_mode = next(m for m in modes if m.name.startswith("ours"))
    ratio = statistics.median(ours_mode.rate(nbytes)) / statistics.median(socket_mode.rate(nbytes))
    # Round-robin puts each rep of ours right after the socket's, so per-rep ratios cancel slow drift.
    paired = [s / o for s, o in zip(socket_mode.seconds, ours_mode.seconds, strict=True)]
    print(
        f"# ours / socket: {ratio:.2f} of medians; per rep {statistics.median(paired):.2f} "
        f"(min {min(paired):.2f}, max {max(paired):.2f})  (goal >= 0.90)   [{ours_mode.name}]"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {"machine": info, "bytes": nbytes, "rows": rows, "ours_over_socket": round(ratio, 3)}, out, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
