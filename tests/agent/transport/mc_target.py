"""A Mooncake target process for the transport tests and the benchmark.

    python mc_target.py --size BYTES [--timeout S] [--host H] [--regions K]

Registers a zeroed torch CPU buffer of BYTES (as K equal, adjacent regions) with a MooncakeTransport,
prints one JSON line ``{"session_id", "address", "size", "pid"}``, then answers lines on stdin, one JSON
line each: ``hash OFFSET NBYTES`` (xxh3-64 of that range), ``zero``, ``quit``. Exits on EOF too, so a
dying test run never leaves it behind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import xxhash

from weightsync_agent.transport.mooncake import MooncakeTransport


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--regions", type=int, default=1)
    args = parser.parse_args()
    transport = MooncakeTransport(args.host, "tcp", force_tcp=True, timeout_seconds=args.timeout)
    buffer = torch.zeros(args.size, dtype=torch.uint8)
    step = args.size // args.regions
    for index in range(args.regions):
        transport.register(buffer.data_ptr() + index * step, step)
    view = buffer.numpy()
    out = {"session_id": transport.session_id, "address": buffer.data_ptr(), "size": args.size, "pid": os.getpid()}
    print(json.dumps(out), flush=True)
    for line in sys.stdin:
        command, *rest = line.split()
        if command == "hash":
            offset, nbytes = int(rest[0]), int(rest[1])
            reply: object = xxhash.xxh3_64_hexdigest(view[offset : offset + nbytes].data)
        elif command == "zero":
            buffer.zero_()
            reply = True
        elif command == "quit":
            break
        else:
            reply = f"unknown command {command!r}"
        print(json.dumps(reply), flush=True)
    transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
