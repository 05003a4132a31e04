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

Protocol (one TCP connection per trainer rank): ``!Q`` length, then that many bytes, answered with one
byte once the sink has read them all; a zero length ends the connection. A length above
:data:`MAX_PULL_BYTES` closes it (the sink trusts nothing it reads).

Run the sink as ``python -m weightsync_testing.testbed.gather --host H --port P``.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import struct
import threading

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


def _serve_one(conn: socket.socket) -> None:
    scratch = memoryview(bytearray(_CHUNK))
    header = memoryview(bytearray(HEADER.size))
    with conn:
        while _read_exactly(conn, header, HEADER.size):
            (count,) = HEADER.unpack(header)
            if count == 0 or count > MAX_PULL_BYTES:
                return
            if not _read_exactly(conn, scratch, count):
                return
            conn.sendall(_ACK)


def serve(host: str, port: int) -> None:
    """Accept gather connections on ``host:port`` forever, one thread each."""
    with socket.create_server((host, port), reuse_port=False) as server:
        print(f"gather sink on {host}:{port}", flush=True)
        while True:
            conn, _ = server.accept()
            threading.Thread(target=_serve_one, args=(conn,), daemon=True).start()


class GatherLink:
    """One trainer rank's side: :meth:`pull` moves a gather's bytes into the rank's node and waits for them."""

    def __init__(self, host: str, port: int, *, timeout: float = 600.0, connect_timeout: float = 30.0) -> None:
        self._sock = socket.create_connection((host, port), timeout=connect_timeout)
        self._sock.settimeout(timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._zeros = memoryview(bytes(_CHUNK))
        self.pulled = 0

    def pull(self, count: int) -> None:
        if count <= 0:
            return
        if count > MAX_PULL_BYTES:
            raise ValueError(f"a gather of {count} bytes is over {MAX_PULL_BYTES}")
        self._sock.sendall(HEADER.pack(count))
        left = count
        while left:
            piece = min(left, _CHUNK)
            self._sock.sendall(self._zeros[:piece])
            left -= piece
        if self._sock.recv(1) != _ACK:
            raise ConnectionError("the gather sink closed the connection")
        self.pulled += count

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.sendall(HEADER.pack(0))
        self._sock.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The gather sink of an emulated trainer node.")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    serve(args.host, args.port)


if __name__ == "__main__":
    main()
