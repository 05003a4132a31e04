"""Publish throughput, in-process: ``python tests/agent/source/bench_publish.py [--mib 256] [--targets 2]``.

One source, ``--targets`` targets of the same layout (one shared replica), ``--bucket-mib`` buckets.
Prints GB/s (bytes confirmed on all targets / wall time of publish) and verifies one target's checksums.
Transports: ``memory`` (weightsync_agent.transport.memory.MemoryTransport), ``fake`` (the in-test one), or
``mooncake`` (TCP loopback; each target is its own process, see mooncake_peer.py).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from mooncake_peer import TargetProcess, bench_model, mooncake_transport
from source_helpers import TargetMemory, make_plan, random_full, tp_layout
from transports import new_transport

from weightsync.plan import Target
from weightsync_agent.layout.buckets import plan_buckets
from weightsync_agent.layout.checksums import target_checksum
from weightsync_agent.layout.manifest import Manifest
from weightsync_agent.source.writer import Source


def local_verify(manifest: Manifest, bucket_bytes: int) -> list[str]:
    return [target_checksum(b) for b in plan_buckets(manifest, bucket_bytes)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256, help="replica size")
    parser.add_argument("--targets", type=int, default=2)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--inflight", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--poll-ms", type=float, default=1.0)
    parser.add_argument("--transport", default="memory", choices=["memory", "fake", "mooncake"])
    args = parser.parse_args()

    model = bench_model(args.mib)
    plan = make_plan(1, args.targets, 1, timeout=600, bucket_mib=args.bucket_mib)
    closers: list[Callable[[], None]] = []
    keep: list[TargetMemory] = []
    manifests: dict[Target, Manifest] = {}
    verifiers: dict[Target, Callable[[int], list[str]]] = {}
    if args.transport == "mooncake":  # every target is its own process, as in production
        tmp = Path(tempfile.mkdtemp(prefix="ws-bench-"))
        source_transport = mooncake_transport()
        for target in plan.sources[0].targets:
            peer = TargetProcess(tmp, engine=target[0], mib=args.mib)
            closers.append(peer.close)
            manifests[target] = peer.manifest
            verifiers[target] = peer.verify
        closers.append(source_transport.close)
    else:
        parties = [new_transport(args.transport) for _ in range(args.targets + 1)]
        source_transport = parties[0].transport
        for target, party in zip(plan.sources[0].targets, parties[1:], strict=True):
            mem = TargetMemory(tp_layout(model, 1, 0), engine=target[0], rank=0, session_id=party.transport.session_id)
            party.transport.register(mem.address, mem.buffer.numel())
            manifests[target] = mem.manifest
            keep.append(mem)  # the target's memory must outlive the publishes
            verifiers[target] = functools.partial(local_verify, mem.manifest)
        closers += [p.close for p in parties]
    gen = torch.Generator().manual_seed(0)
    fulls = {f.name: random_full(f, gen) for _, group in model for f in group}
    source = Source(
        source_transport, plan, 0, manifests, pin=False, max_inflight=args.inflight, poll_interval=args.poll_ms / 1000
    )
    rates, hash_s = [], []
    for version in range(1, args.reps + 1):
        source.replicas.reset()
        source.replicas.stage_many(fulls)
        result = source.publish(version, timeout=600)
        assert result.ok, result.summary()
        rates.append(result.gbps)
        hash_s.append(result.checksum_seconds)
    for target, verify in verifiers.items():
        assert verify(source.bucket_bytes) == result.targets[target].checksums, target
    print(
        f"transport={args.transport} replica={source.replicas.nbytes / 2**20:.0f} MiB targets={args.targets} "
        f"bucket={args.bucket_mib} MiB inflight={args.inflight} poll={args.poll_ms} ms reps={args.reps}: "
        f"GB/s min/median/max = {min(rates):.2f} / {statistics.median(rates):.2f} / {max(rates):.2f} "
        f"(bytes = replica x targets); checksum time median {statistics.median(hash_s):.3f} s; "
        "targets verified their bucket checksums"
    )
    source.close()
    for close in reversed(closers):
        close()


if __name__ == "__main__":
    main()
