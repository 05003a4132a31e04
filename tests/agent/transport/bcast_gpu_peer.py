"""One rank of the NCCL broadcast check (needs one GPU per rank): rank 0 sends, the others verify.

    python bcast_gpu_peer.py --rank R --world W --init tcp://127.0.0.1:PORT [--bucket BYTES]

Imports only torch and the broadcast module, so it runs where the rest of the project's
dependencies are not installed. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from weightsync_agent.transport.collective import BroadcastGroup


def fulls(device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    shapes = {"w": ((512, 256), torch.bfloat16), "big": ((1024, 1024), torch.float32), "ids": ((33,), torch.int64)}
    out = {}
    for name, (shape, dtype) in shapes.items():
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        out[name] = raw.view(dtype).view(shape).to(device)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init", required=True)
    parser.add_argument("--bucket", type=int, default=1 << 20)
    args = parser.parse_args()
    torch.cuda.set_device(args.rank)
    device = torch.device("cuda", args.rank)
    group = BroadcastGroup(args.rank, args.world, args.init, "auto", 60.0)
    expected = fulls(device)
    if group.is_source:
        stats = group.broadcast_buckets(expected, args.bucket, version=3)
        print(json.dumps({"rank": args.rank, "backend": group.backend, "buckets": stats.buckets}), flush=True)
        return 0
    seen: dict[str, bool] = {}

    def on_bucket(views: list[tuple[str, torch.Tensor]]) -> None:
        for name, view in views:
            seen[name] = view.device == device and torch.equal(
                view.contiguous().view(torch.uint8), expected[name].contiguous().view(torch.uint8)
            )

    stats = group.receive_buckets(on_bucket)
    torch.cuda.synchronize()
    out = {"rank": args.rank, "backend": group.backend, "version": stats.version, "buckets": stats.buckets}
    print(json.dumps(out | {"exact": seen}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
