"""One rank of a broadcast-mode test: rank 0 sends a toy model's full tensors, the others keep a TP shard.

    python bcast_peer.py --rank R --world W --init tcp://127.0.0.1:PORT [--bucket BYTES] [--version V]
                         [--timeout S] [--sender send|quit|hang]

Receivers (rank r holds TP shard r - 1 of W - 1) rebuild their tensors with ShardAssembler, check them
bit for bit against narrow + cat of the same seeded full tensors, and print one JSON line; the sender
prints its round stats. ``--sender quit`` forms the group and exits without sending; ``--sender hang``
forms it and sleeps (a hung trainer).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from weightsync_agent.layout.manifest import ITEMSIZE, ShardPart, TensorEntry
from weightsync_agent.transport.base import TransportError
from weightsync_agent.transport.collective import BroadcastGroup, plan_buckets
from weightsync_testing.reference_engine.assemble import ShardAssembler

FULLS = {  # name: (shape, dtype)
    "embed": ((64, 32), "bfloat16"),
    "q": ((48, 32), "float32"),
    "k": ((24, 32), "float32"),
    "v": ((24, 32), "float32"),
    "o": ((32, 48), "float16"),
    "up": ((96, 32), "bfloat16"),
    "big": ((384, 256), "float32"),  # 384 KiB: larger than the test's buckets, travels alone
    "norm": ((32,), "float32"),
}


def full_tensors(seed: int = 7) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in FULLS.items():
        raw = torch.randint(0, 256, (math.prod(shape) * ITEMSIZE[dtype],), dtype=torch.uint8, generator=gen)
        out[name] = raw.view(getattr(torch, dtype)).view(shape)  # random bits, NaNs included
    return out


def laid_out(tensors: dict[str, torch.Tensor], bucket: int) -> dict[str, torch.Tensor]:
    """The same tensors as views of one flat buffer laid out exactly as the buckets (zero-copy segments)."""
    plans = plan_buckets(list(tensors.items()), bucket)
    flat = torch.zeros(sum(p.nbytes for p in plans), dtype=torch.uint8)
    out, base = {}, 0
    for plan in plans:
        for slot in plan.slots:
            region = flat[base + slot.offset : base + slot.offset + slot.nbytes]
            region.copy_(tensors[slot.name].reshape(-1).view(torch.uint8))
            out[slot.name] = region.view(tensors[slot.name].dtype).view(tensors[slot.name].shape)
        base += plan.nbytes
    return out


def part(name: str, dim: int, rank: int, tp: int) -> ShardPart:
    shape = FULLS[name][0]
    n = shape[dim] // tp
    return ShardPart(source=name, full_shape=shape, dim=dim, start=rank * n, length=n)


def entries(rank: int, tp: int) -> list[TensorEntry]:
    specs = [
        ("embed", (ShardPart(source="embed", full_shape=(64, 32), dim=0, start=0, length=64),), 0),
        ("qkv", tuple(part(n, 0, rank, tp) for n in ("q", "k", "v")), 0),
        ("o", (part("o", 1, rank, tp),), 1),
        ("up", (part("up", 0, rank, tp),), 0),
        ("big", (part("big", 0, rank, tp),), 0),
        ("norm", (ShardPart(source="norm", full_shape=(32,), dim=0, start=0, length=32),), 0),
    ]
    out, address = [], 1 << 20
    for name, parts, cat_dim in specs:
        shape = list(parts[0].shape)
        shape[cat_dim] = sum(p.shape[cat_dim] for p in parts)
        dtype = FULLS[parts[0].source][1]
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        out.append(
            TensorEntry(
                name=name, dtype=dtype, shape=tuple(shape), address=address, nbytes=nbytes, cat_dim=cat_dim, parts=parts
            )
        )
        address += nbytes
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init", required=True)
    parser.add_argument("--bucket", type=int, default=64 << 10)
    parser.add_argument("--version", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--sender", choices=("send", "quit", "hang"), default="send")
    parser.add_argument("--direct", type=int, default=0, help="sender: direct-segment threshold in bytes")
    args = parser.parse_args()
    try:
        group = BroadcastGroup(args.rank, args.world, args.init, "gloo", args.timeout, direct_bytes=args.direct)
        if group.is_source:
            if args.sender != "send":
                print(json.dumps({"rank": args.rank, "sender": args.sender}), flush=True)
                if args.sender == "hang":
                    time.sleep(3600)  # the test kills it
                return 0
            fulls = laid_out(full_tensors(), args.bucket) if args.direct else full_tensors()
            stats = group.broadcast_buckets(fulls, args.bucket, version=args.version)
            print(json.dumps({"rank": args.rank, "buckets": stats.buckets, "nbytes": stats.nbytes}), flush=True)
            return 0
        tp, shard = args.world - 1, args.rank - 1
        mine = entries(shard, tp)
        dests = {e.name: torch.zeros(e.shape, dtype=getattr(torch, e.dtype)) for e in mine}
        assembler = ShardAssembler(mine, dests)
        started = time.monotonic()
        try:
            stats = group.receive_buckets(assembler)
        except TransportError as exc:
            print(json.dumps({"rank": args.rank, "error": str(exc), "seconds": time.monotonic() - started}), flush=True)
            return 3
        fulls = full_tensors()
        bad = []
        for e in mine:
            expected = torch.cat([fulls[p.source].narrow(p.dim, p.start, p.length) for p in e.parts], dim=e.cat_dim)
            if not torch.equal(expected.contiguous().view(torch.uint8), dests[e.name].view(torch.uint8)):
                bad.append(e.name)
        result = {"rank": args.rank, "version": stats.version, "buckets": stats.buckets, "mismatched": bad}
        print(json.dumps(result | {"missing": assembler.missing()}), flush=True)
    except TransportError as exc:
        print(json.dumps({"rank": args.rank, "error": str(exc)}), flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
