"""The trainer's gather, emulated over each trainer node's own inbound link.

A real trainer does not hold full tensors: before a rank can stage a parameter it all-gathers the parts
the other ranks of its shard group hold (FSDP/HSDP over the network, or EP across nodes). That costs
time on the rank's *inbound* link, comparable to the writes on its outbound link (the simulator's
Kimi-K2 and Qwen3 runs are gather- or stage-bound, docs/simulator.md). Copying CPU tensors into the
replica, as the benchmark otherwise does, costs 4 % of a round and hides what overlapping staging with
writing is for.

So with ``gather_shards = S`` every trainer node is in a shard group of ``S`` nodes: before staging a
tensor of ``n`` bytes it receives ``n * (S - 1) / S`` bytes over its own capped link into its namespace,
where a :class:`sink <serve>` reads them. The bytes are real and cross the same tc cap as everything
else into that node, full duplex with the node's outbound writes, as on InfiniBand. What is then staged
is the process's own copy of the tensor (the same values a real gather would assemble), so the rounds
stay bit-exact.

Two processes per trainer node, neither of them the trainer's (a real all-gather runs in NCCL's threads, not
in the training loop): a **source** in the root namespace (the other shard holders), a **sink** in the node's
namespace, and the trainer rank's :class:`GatherLink` to the sink. The rank asks the sink for ``n`` bytes; the
sink asks its source for them over its own connection, reads them (they cross the node's inbound cap) and
answers the rank with one byte. Every message is ``!Q`` length; a zero length ends a connection, a length above
:data:`MAX_PULL_BYTES` closes it (nothing read is trusted).

Run them as ``python -m weightsync_tools.testbed.gather source --host H --port P`` and ``python -m
weightsync_tools.testbed.gather sink --host H --port P --source SH:SP``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import queue
import socket
import struct
import threading
from collections.abc import Callable

HEADER = struct.Struct("!Q")
MAX_PULL_BYTES = 1 << 32
_CHUNK = 4 << 20
_ACK = b"\x01"


def gathered_bytes(tensor_bytes: int, shards: int) -> int:
    """What a rank of a shard group of ``shards`` nodes receives to assemble a tensor of ``tensor_bytes``."""
    if shards < 1:
        raise ValueError(f"gather shards must be at least 1, got {shards}")
    return tensor_bytes * (shards - 1) // shards


def _read_exactly(conn: socket.socket, buffer: memoryview, count: int) -> bool:
    while count:
        got = conn.recv_into(buffer[: min(count, len(buffer))])
        if got == 0:
            return False
        count -= got
    return True


def _feed(conn: socket.socket) -> None:
    """The source's side of one sink's connection: send each asked-for count of bytes."""
    zeros = memoryview(bytes(_CHUNK))
    header = memoryview(bytearray(HEADER.size))
    with conn:
        while _read_exactly(conn, header, HEADER.size):
            (count,) = HEADER.unpack(header)
            if count == 0 or count > MAX_PULL_BYTES:
                return
            while count:
                piece = min(count, _CHUNK)
                conn.sendall(zeros[:piece])
                count -= piece


def _relay(rank: socket.socket, source: tuple[str, int]) -> None:
    """The sink's side of one rank's connection: each asked-for count is passed on to the source at once (a rank
    may ask ahead, so the source streams without a gap between tensors), then read and answered in order."""
    scratch = memoryview(bytearray(_CHUNK))
    asked: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    with rank, socket.create_connection(source, timeout=30) as feed:
        feed.settimeout(None)

        def forward() -> None:
            header = memoryview(bytearray(HEADER.size))
            try:
                while _read_exactly(rank, header, HEADER.size):
                    (count,) = HEADER.unpack(header)
                    if count == 0 or count > MAX_PULL_BYTES:
                        break
                    feed.sendall(HEADER.pack(count))
                    asked.put(count)
            except OSError:
                pass
            asked.put(None)

        threading.Thread(target=forward, daemon=True).start()
        while (count := asked.get()) is not None:
            if not _read_exactly(feed, scratch, count):
                return
            rank.sendall(_ACK)


def _accept_forever(host: str, port: int, what: str, handle: Callable[[socket.socket], None]) -> None:
    with socket.create_server((host, port)) as server:
        print(f"gather {what} on {host}:{port}", flush=True)
        while True:
            conn, _ = server.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=handle, args=(conn,), daemon=True).start()


def serve_source(host: str, port: int) -> None:
    """The shard holders' side: feed every connecting sink the bytes it asks for."""
    _accept_forever(host, port, "source", _feed)


def serve(host: str, port: int, source: tuple[str, int]) -> None:
    """A trainer node's sink: relay each rank's gathers from ``source`` into this node."""
    _accept_forever(host, port, "sink", lambda conn: _relay(conn, source))


class GatherLink:
    """One trainer rank's side: :meth:`pull` moves a gather's bytes into the rank's node and waits for them."""

    def __init__(self, host: str, port: int, *, timeout: float = 600.0, connect_timeout: float = 30.0) -> None:
        self._sock = socket.create_connection((host, port), timeout=connect_timeout)
        self._sock.settimeout(timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pulled = 0
        #: The counts asked for and not yet waited for, oldest first (0: nothing to gather, nothing sent).
        self._asked: collections.deque[int] = collections.deque()

    def request(self, count: int) -> None:
        """Ask for ``count`` bytes without waiting (a rank asks ahead; :meth:`wait` collects in order)."""
        if count > MAX_PULL_BYTES:
            raise ValueError(f"a gather of {count} bytes is over {MAX_PULL_BYTES}")
        count = max(count, 0)
        if count:
            self._sock.sendall(HEADER.pack(count))
        self._asked.append(count)

    def wait(self) -> None:
        """Wait until the oldest request's bytes are in the node."""
        count = self._asked.popleft()
        if not count:
            return
        if self._sock.recv(1) != _ACK:
            raise ConnectionError("the gather sink closed the connection")
        self.pulled += count

    def pull(self, count: int) -> None:
        """Gather ``count`` bytes into the rank's node: returns once the sink has received them all."""
        self.request(count)
        self.wait()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.sendall(HEADER.pack(0))
        self._sock.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The emulated all-gather of a trainer node (see the module).")
    parser.add_argument("role", choices=("source", "sink"))
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--source", help="sink: the source's HOST:PORT")
    args = parser.parse_args(argv)
    if args.role == "source":
        serve_source(args.host, args.port)
        return
    if not args.source or ":" not in args.source:
        parser.error("a sink needs --source HOST:PORT")
    source_host, source_port = args.source.rsplit(":", 1)
    serve(args.host, args.port, (source_host, int(source_port)))


if __name__ == "__main__":
    main()
