"""A Mooncake source process for the transport tests, driven line by line over stdin.

    python mc_writer.py --size BYTES [--timeout S] [--chunk BYTES]

Owns a registered source buffer filled with a seeded pattern, prints ``{"session_id", "pid"}``, then
answers each command with one JSON line:

* ``probe PEER TIMEOUT`` -> ``{"ok", "seconds"}``
* ``write ID PEER OFFSET REMOTE NBYTES`` -> ``{"submit_seconds"}`` (submits and returns at once)
* ``wait ID TIMEOUT`` -> ``{"state", "error", "seconds"}`` (seconds from submit to the final state)
* ``hash OFFSET NBYTES`` -> xxh3-64 of the source range; ``quit``

Tests that need short Mooncake timeouts drive their writes from here, because Mooncake's settings are
process-wide and must not leak into transports that other tests create in the pytest process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import xxhash

from weightsync_agent.transport.base import TransferState
from weightsync_agent.transport.mooncake import MooncakeTransport


def pattern(nbytes: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--chunk", type=int, default=64 << 20)
    args = parser.parse_args()
    transport = MooncakeTransport("127.0.0.1", "tcp", timeout_seconds=args.timeout, chunk_bytes=args.chunk)
    source = pattern(args.size)
    base = source.data_ptr()
    transport.register(base, args.size)
    print(json.dumps({"session_id": transport.session_id, "pid": os.getpid()}), flush=True)
    transfers = {}
    for line in sys.stdin:
        command, *rest = line.split()
        reply: object
        if command == "probe":
            started = time.monotonic()
            ok = transport.probe(rest[0], float(rest[1]))
            reply = {"ok": ok, "seconds": time.monotonic() - started}
        elif command == "write":
            name, peer, offset, remote, nbytes = rest[0], rest[1], int(rest[2]), int(rest[3]), int(rest[4])
            started = time.monotonic()
            transfers[name] = (transport.submit_write(peer, base + offset, remote, nbytes), started)
            reply = {"submit_seconds": time.monotonic() - started}
        elif command == "wait":
            transfer, started = transfers[rest[0]]
            deadline = time.monotonic() + float(rest[1])
            while (state := transfer.poll()) is TransferState.PENDING and time.monotonic() < deadline:
                time.sleep(0.001)
            reply = {"state": state.value, "error": transfer.error(), "seconds": time.monotonic() - started}
        elif command == "hash":
            offset, nbytes = int(rest[0]), int(rest[1])
            reply = xxhash.xxh3_64_hexdigest(source.numpy()[offset : offset + nbytes].data)
        elif command == "quit":
            break
        else:
            reply = f"unknown command {command!r}"
        print(json.dumps(reply), flush=True)
    transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
