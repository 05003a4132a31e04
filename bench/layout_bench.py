"""Layout benchmark: one sync round, p2p against broadcast, for 2 trainer ranks -> 2 engines x TP2.

    python bench/layout_bench.py [--mib 256] [--reps 5] [--bucket-mib 64] [--json PATH]

The same reference-model weights (``--mib`` of full tensors, float32) go to the same two engine
processes (``launch_engine``, Mooncake TCP sessions) through the same ``RoundDriver`` in live mode
(pause, begin, write, verify, commit, resume), three ways, round-robin so machine load hits them alike:

- **p2p**: 2 sources (one ``Source`` + ``MooncakeTransport`` each, in this process), each writing its
  planned targets' shards from its CPU replica;
- **broadcast, 2 receivers**: trainer rank 0 (this process) broadcasts every full tensor over gloo to one
  member per engine process, which cuts both its ranks' shards (``receivers="engine"``);
- **broadcast, 4 receivers**: one member per engine rank, as SGLang's broadcast path has it
  (``receivers="rank"``): every inference rank receives every byte.

The time of a round is ``RoundResult.duration_seconds``, the whole protocol. Regrouping the broadcast
group between modes is not timed. The summary is the issue's target, p2p total time <= broadcast / TP,
printed as ``p2p / (broadcast / TP)`` of medians (<= 1.0 meets it). A benchmark, not a test: nothing
is asserted beyond every round succeeding.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync.plan import Plan, plan_for
from weightsync.ports import free_port
from weightsync_agent.modes.broadcast.layout import Receivers, broadcast_round_plan
from weightsync_agent.modes.broadcast.sender import BroadcastSource
from weightsync_agent.rounds.driver import RoundDriver, RoundResult
from weightsync_agent.source.control import SourceControl
from weightsync_agent.source.writer import InProcessSourceControl, Source
from weightsync_agent.targets.reference.adapter import reference_adapter
from weightsync_agent.transport.mooncake import MooncakeTransport
from weightsync_testing.reference_engine.launch import EngineProcess, launch_engine
from weightsync_testing.reference_engine.model import ModelConfig, full_state

MiB = 1 << 20
TP = 2
ENGINES = 2
TRAINERS = 2
TIMEOUT = 300
TEMPLATE = {"spec": {"containers": [{"name": "main"}]}}


def model_config(mib: int) -> ModelConfig:
    """A reference-model shape of about ``mib`` MiB of float32 full tensors (per layer 15 h^2 floats)."""
    hidden = 1024 if mib >= 128 else 256
    vocab = 4096
    per_layer = 15 * hidden * hidden * 4
    embeddings = 2 * vocab * hidden * 4
    layers = max(1, round((mib * MiB - embeddings) / per_layer))
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=8,
        num_kv_heads=4,
        head_dim=hidden // 8,
        intermediate_size=4 * hidden,
    )


def group_plan(mode: str, bucket_mib: int) -> Plan:
    spec = WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": TRAINERS, "template": TEMPLATE},
            "inference": {
                "engines": ENGINES,
                "ranksPerEngine": TP,
                "ranksPerPod": TP,
                "adapter": "reference",
                "template": TEMPLATE,
            },
            "transfer": {"mode": mode, "protocol": "tcp", "bucketSizeMiB": bucket_mib, "timeoutSeconds": TIMEOUT},
        }
    )
    return plan_for(spec, group="bench", namespace="bench")


@dataclass
class Mode:
    name: str
    driver: RoundDriver
    before: Callable[[], None] = lambda: None  # untimed set-up before each round
    results: list[RoundResult] = field(default_factory=list)

    @property
    def seconds(self) -> list[float]:
        return [r.duration_seconds for r in self.results]

    def row(self) -> dict[str, Any]:
        s = self.seconds
        return {
            "mode": self.name,
            "reps": len(s),
            "min_s": round(min(s), 3),
            "median_s": round(statistics.median(s), 3),
            "max_s": round(max(s), 3),
            "wire_MiB": round(self.results[-1].bytes / MiB, 1),
        }


def machine() -> dict[str, Any]:
    model = "unknown"
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="model size, MiB of full tensors (default 256)")
    parser.add_argument("--reps", type=int, default=5, help="rounds per mode (default 5)")
    parser.add_argument("--bucket-mib", type=int, default=64, help="bucketSizeMiB of both plans (default 64)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = model_config(args.mib)
    full = full_state(seed=1, config=config)
    model_bytes = sum(t.numel() * t.element_size() for t in full.values())
    extra = ("--layers", str(config.num_layers), "--model-config", json.dumps(_config_json(config)))
    p2p_plan, broadcast_plan = group_plan("p2p", args.bucket_mib), group_plan("broadcast", args.bucket_mib)
    bucket_bytes = args.bucket_mib * MiB
    engines: list[EngineProcess] = []
    sources: list[Source] = []
    broadcast: BroadcastSource | None = None
    modes: list[Mode] = []
    try:
        for e in range(ENGINES):
            engines.append(launch_engine(e, TP, seed=7 + e, extra=extra, timeout=300))
        clients = {e: engines[e].client(timeout=TIMEOUT) for e in range(ENGINES)}
        manifests = {t: clients[t[0]].manifest(t[1]) for t in p2p_plan.layout.all_targets()}
        controls = {e: reference_adapter(e, clients[e].base_url, bucket_bytes=bucket_bytes) for e in range(ENGINES)}
        for assignment in p2p_plan.sources:
            mine = {t: manifests[t] for t in assignment.targets}
            transport = MooncakeTransport("127.0.0.1", "tcp", force_tcp=True, timeout_seconds=60)
            sources.append(Source(transport, p2p_plan, assignment.source, mine, pin=False))
            sources[-1].replicas.stage_many(full)
        p2p_sources: dict[int, SourceControl] = {s.source: InProcessSourceControl(s) for s in sources}
        broadcast = BroadcastSource(broadcast_plan, manifests, controls, call_timeout=60)
        broadcast.stage_many(full)
        sender = broadcast

        def regroup(receivers: Receivers) -> Callable[[], None]:
            return lambda: sender.connect(f"tcp://127.0.0.1:{free_port()}", backend="gloo", receivers=receivers)

        def driver(plan: Plan, chosen: dict[int, SourceControl]) -> RoundDriver:
            return RoundDriver(plan, controls, chosen, staging="live", timeout_seconds=TIMEOUT, call_timeout=TIMEOUT)

        view = broadcast_round_plan(broadcast_plan)
        modes = [
            Mode("p2p: 2 sources, Mooncake TCP", driver(p2p_plan, p2p_sources)),
            Mode("broadcast: rank 0 -> 2 engine processes", driver(view, {0: broadcast}), regroup("engine")),
            Mode("broadcast: rank 0 -> 4 engine ranks", driver(view, {0: broadcast}), regroup("rank")),
        ]
        version = 0
        for rep in range(args.reps):
            for mode in modes:
                mode.before()
                version += 1
                result = mode.driver.run(version)
                if result.result != "Succeeded":
                    print(f"{mode.name}: round {version} {result.result}: {result.reason}", file=sys.stderr)
                    return 1
                mode.results.append(result)
            print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{m.seconds[-1]:.2f}s" for m in modes), file=sys.stderr)
    finally:
        for mode in modes:
            mode.driver.close()
        if broadcast is not None:
            broadcast.close()
        for source in sources:
            source.close()
            source.transport.close()
        for engine in engines:
            engine.stop()
    info = machine()
    rows = [m.row() for m in modes]
    p2p, to_engines, to_ranks = (statistics.median(m.seconds) for m in modes)
    print(
        f"# {TRAINERS} trainer ranks -> {ENGINES} engines x TP{TP}; {model_bytes / MiB:.0f} MiB of full tensors "
        f"({config.num_layers} layers, hidden {config.hidden_size}); bucket {args.bucket_mib} MiB; live rounds; "
        f"{info['cpus_usable']} CPUs ({info['cpu_model']}), loopback TCP, load {info['load_average']}"
    )
    print(f"{'mode':<42}{'reps':>5}{'min s':>8}{'median s':>10}{'max s':>8}{'wire MiB':>10}")
    for row in rows:
        print(
            f"{row['mode']:<42}{row['reps']:>5}{row['min_s']:>8.3f}{row['median_s']:>10.3f}{row['max_s']:>8.3f}"
            f"{row['wire_MiB']:>10.1f}"
        )
    ratio_ranks, ratio_engines = p2p / (to_ranks / TP), p2p / (to_engines / TP)
    print(
        f"# p2p / (broadcast / TP), medians: {ratio_ranks:.2f} against 4 rank receivers, "
        f"{ratio_engines:.2f} against 2 engine-process receivers (target <= 1.0)"
    )
    if args.json:
        with open(args.json, "w") as out:
            summary = {"p2p_over_broadcast_per_tp": {"rank_receivers": ratio_ranks, "engine_receivers": ratio_engines}}
            json.dump({"machine": info, "model_bytes": model_bytes, "rows": rows, **summary}, out, indent=1)
    return 0


def _config_json(config: ModelConfig) -> dict[str, Any]:
    return {k: v for k, v in vars(config).items() if k != "num_layers"}


if __name__ == "__main__":
    sys.exit(main())
