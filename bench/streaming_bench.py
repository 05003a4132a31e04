"""Streaming benchmark: does a streamed round overlap staging and writing, and what does verification cost?

    python bench/streaming_bench.py [--mib 256] [--bucket-mib 16] [--reps 5] [--device cpu|cuda] [--json PATH]

One trainer rank (this process, ``WeightSyncClient.coordinating`` + ``MooncakeTransport`` over TCP
loopback) and one reference engine process at TP1; every round is a full live round (pause, begin,
write, verify, commit, resume) through the same ``RoundDriver``. Per repetition, round-robin:

- **staging alone**: ``client.stage`` of every full tensor (from ``--device`` memory) into the replica,
  in :meth:`WeightSyncClient.staging_order`; staging also files each bucket's digest;
- **writing alone**: ``client.publish(v)`` of the replica just staged (the round, its writes, the engine's
  verification and commit);
- **stage then publish**: both, one after the other (the simple form);
- **streaming stage-to-commit**: ``with client.stream(v) as s: s.stage(...)``, from opening the stream to
  the committed outcome.

Then, on the same engine, ``Source.publish`` alone (no round) three ways: verified with the digests staging
filed, verified hashing at publish time (the former path: digests ignored), and unverified.

``--link-gbps R`` paces the link: every write still moves through Mooncake, but completes no earlier than a
single link of R GB/s would have delivered it (writes queue on the link in submission order), as in the
emulated cluster's rate-limited links, where the network and not the CPU bounds the writes. Without it,
on a small CPU box, staging and Mooncake's TCP copies compete for the same cores.

Printed: the medians, ``streaming / max(staging, writing)`` (issue 12's target: <= 1.15) and ``verified /
unverified`` publish (target: about 1). A benchmark, not a test: nothing is asserted beyond every round
succeeding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from layout_bench import machine, model_config

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync.plan import Plan, plan_for
from weightsync_agent.client.trainer import WeightSyncClient
from weightsync_agent.layout.checksums import checksum_ranges
from weightsync_agent.source.writer import InProcessSourceControl, Source
from weightsync_agent.targets.reference.adapter import reference_adapter
from weightsync_agent.transport.base import Transfer, TransferState, Transport
from weightsync_agent.transport.mooncake import MooncakeTransport
from weightsync_testing.reference_engine.launch import EngineProcess, launch_engine
from weightsync_testing.reference_engine.model import full_state

MiB = 1 << 20
TIMEOUT = 300
TEMPLATE = {"spec": {"containers": [{"name": "main"}]}}


class PacedTransfer:
    """A write that is DONE only once the transport did it *and* the paced link would have delivered it."""

    def __init__(self, inner: Transfer, done_at: float) -> None:
        self.inner = inner
        self.peer = inner.peer
        self.nbytes = inner.nbytes
        self.done_at = done_at

    def poll(self) -> TransferState:
        state = self.inner.poll()
        if state is TransferState.DONE and time.monotonic() < self.done_at:
            return TransferState.PENDING
        return state

    def error(self) -> str | None:
        return self.inner.error()


class PacedTransport:
    """A transport behind one link of ``gbps`` GB/s: writes queue on it in submission order."""

    def __init__(self, inner: MooncakeTransport, gbps: float) -> None:
        self.inner = inner
        self.bytes_per_second = gbps * 1e9
        self.free_at = 0.0
        self.timeout_seconds = inner.timeout_seconds

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    def register(self, address: int, nbytes: int) -> None:
        self.inner.register(address, nbytes)

    def unregister(self, address: int) -> None:
        self.inner.unregister(address)

    def probe(self, peer: str, timeout: float) -> bool:
        return self.inner.probe(peer, timeout)

    def submit_write(self, peer: str, local_address: int, remote_address: int, nbytes: int) -> Transfer:
        start = max(time.monotonic(), self.free_at)
        self.free_at = start + nbytes / self.bytes_per_second
        return PacedTransfer(self.inner.submit_write(peer, local_address, remote_address, nbytes), self.free_at)

    def close(self) -> None:
        self.inner.close()


def group_plan(bucket_mib: int, *, verify: bool = True) -> Plan:
    spec = WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": 1, "template": TEMPLATE},
            "inference": {
                "engines": 1,
                "ranksPerEngine": 1,
                "ranksPerPod": 1,
                "adapter": "reference",
                "template": TEMPLATE,
            },
            "transfer": {"protocol": "tcp", "bucketSizeMiB": bucket_mib, "timeoutSeconds": TIMEOUT, "verify": verify},
        }
    )
    return plan_for(spec, group="bench", namespace="bench")


def timed(action: Callable[[], object]) -> float:
    began = time.perf_counter()
    action()
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="model size, MiB of full tensors (default 256)")
    parser.add_argument("--bucket-mib", type=int, default=16, help="bucketSizeMiB (default 16)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions (default 5)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="stage from here")
    parser.add_argument("--link-gbps", type=float, default=0.0, help="pace the link at this many GB/s (0: off)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = model_config(args.mib)
    full = {k: v.to(args.device) for k, v in full_state(seed=1, config=config).items()}
    model_bytes = sum(t.numel() * t.element_size() for t in full.values())
    extra = ("--layers", str(config.num_layers), "--model-config", json.dumps(_config_json(config)))
    plan = group_plan(args.bucket_mib)
    bucket_bytes = args.bucket_mib * MiB
    engine: EngineProcess | None = None
    client: WeightSyncClient | None = None
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "staging",
            "writing",
            "stage_then_publish",
            "streaming",
            "streaming_staged",
            "verified",
            "rehashed",
            "unverified",
            "hash_once",
        )
    }
    try:
        engine = launch_engine(0, 1, seed=7, extra=extra, timeout=300)
        manifests = {(0, 0): engine.client(timeout=TIMEOUT).manifest(0)}
        adapter = reference_adapter(0, engine.client(timeout=TIMEOUT).base_url, bucket_bytes=bucket_bytes)
        mooncake = MooncakeTransport("127.0.0.1", "tcp", force_tcp=True, timeout_seconds=60)
        transport: Transport = mooncake if not args.link_gbps else PacedTransport(mooncake, args.link_gbps)
        client = WeightSyncClient.coordinating(
            transport,
            plan,
            0,
            manifests,
            {0: adapter},
            pin=args.device.startswith("cuda"),  # pinned: D2H at full speed
        )
        order = client.staging_order()
        source = _own_source(client)
        version = 0

        def stage_all(stage: Callable[[str, torch.Tensor], object]) -> None:
            for name in order:
                stage(name, full[name])
            if args.device != "cpu":
                torch.cuda.synchronize()

        def publish() -> None:
            nonlocal version
            version += 1
            client.publish(version)  # type: ignore[union-attr]

        for rep in range(args.reps):
            times["staging"].append(timed(lambda: stage_all(client.stage)))  # type: ignore[union-attr]
            times["writing"].append(timed(publish))
            times["stage_then_publish"].append(timed(lambda: (stage_all(client.stage), publish())))  # type: ignore[union-attr]
            version += 1

            def streamed(v: int = version) -> None:
                began = time.perf_counter()
                with client.stream(v) as stream:  # type: ignore[union-attr]
                    stage_all(stream.stage)
                    times["streaming_staged"].append(time.perf_counter() - began)

            times["streaming"].append(timed(streamed))
            # Source.publish alone (no round), to the same target: digests reused / rehashed / not verified.
            stage_all(client.stage)
            sums: list[str] = []
            for key in ("verified", "rehashed", "unverified"):
                source.checksums = key != "unverified"
                reuse = source.staged_digest
                if key == "rehashed":
                    source.staged_digest = lambda target, index, until=None: None  # type: ignore[method-assign]
                version += 1
                rid = f"bench-{version}"  # the engine takes writes only inside an open round
                adapter.pause(60, round_id=rid)
                adapter.begin(version, 60, round_id=rid)
                try:
                    result = source.publish(version, timeout=TIMEOUT)
                finally:
                    source.staged_digest = reuse  # type: ignore[method-assign]
                    source.checksums = True
                if not result.ok:
                    print(f"Source.publish {key}: {result.summary()}", file=sys.stderr)
                    return 1
                # Close the round as the driver would (an engine whose live weights were written serves again only
                # after a verified commit): verified against the first publish's checksums, the same bytes.
                sums = sums if key != "verified" else list(result.targets[(0, 0)].checksums)
                verdict = adapter.verify(0, version, sums, 60, round_id=rid)
                if not verdict.ok:
                    print(f"engine verification after {key}: {verdict}", file=sys.stderr)
                    return 1
                adapter.commit(version, 60, round_id=rid)
                adapter.resume(60, round_id=rid)
                times[key].append(result.seconds)
            whole = [(r.address, r.nbytes) for r in client.replicas]
            times["hash_once"].append(timed(lambda whole=whole: checksum_ranges(whole)))
            client.replicas.reset()
            shown = ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items())
            print(f"rep {rep + 1}/{args.reps}: {shown}", file=sys.stderr)
    finally:
        if client is not None:
            client.close(unlink=True)
        if engine is not None:
            engine.stop()
    info = machine()
    med = {k: statistics.median(v) for k, v in times.items()}
    bound = max(med["staging"], med["writing"])
    print(
        f"# 1 trainer rank -> 1 reference engine (TP1), {model_bytes / MiB:.0f} MiB of full tensors from "
        f"{args.device}, bucket {args.bucket_mib} MiB, live rounds over Mooncake TCP loopback"
        f"{f' paced at {args.link_gbps} GB/s' if args.link_gbps else ''}; "
        f"{info['cpus_usable']} CPUs ({info['cpu_model']}), load {info['load_average']}"
    )
    print(f"{'what':<48}{'reps':>5}{'min s':>8}{'median s':>10}{'max s':>8}")
    labels = {
        "staging": "staging alone (digests filed)",
        "writing": "writing alone (round: write, verify, commit)",
        "stage_then_publish": "stage, then publish",
        "streaming": "streaming stage-to-commit",
        "streaming_staged": "  of which staging done after",
        "verified": "Source.publish verified, staged digests",
        "rehashed": "Source.publish verified, hashing at publish",
        "unverified": "Source.publish unverified",
        "hash_once": "xxh3 over the whole replica, one thread",
    }
    for key, label in labels.items():
        v = times[key]
        print(f"{label:<48}{len(v):>5}{min(v):>8.3f}{med[key]:>10.3f}{max(v):>8.3f}")
    ratios = {
        "streaming_over_max_stage_write": med["streaming"] / bound,
        "streaming_over_stage_then_publish": med["streaming"] / med["stage_then_publish"],
        "verified_over_unverified": med["verified"] / med["unverified"],
        "rehashed_over_unverified": med["rehashed"] / med["unverified"],
    }
    print(
        f"# streaming / max(staging, writing) = {ratios['streaming_over_max_stage_write']:.3f} (target <= 1.15); "
        f"streaming / stage-then-publish = {ratios['streaming_over_stage_then_publish']:.3f}"
    )
    print(
        f"# verified / unverified Source.publish = {ratios['verified_over_unverified']:.3f} with staged digests, "
        f"{ratios['rehashed_over_unverified']:.3f} hashing at publish"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"machine": info, "model_bytes": model_bytes, "times": times, "ratios": ratios}, out, indent=1)
    return 0


def _own_source(client: WeightSyncClient) -> Source:
    control = getattr(client.publisher, "control", None)
    if not isinstance(control, InProcessSourceControl):
        raise SystemExit("expected a coordinating client")
    return control.sender


def _config_json(config: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(config).items() if k != "num_layers"}


if __name__ == "__main__":
    sys.exit(main())
