"""Round times into the reference engine and into stock SGLang, measured in the same run (a benchmark, not a test).

Both groups are 2 trainer ranks -> 1 engine x TP``--tp`` through real agents over Mooncake TCP on loopback;
each round is a full live-mode round (pause, begin, write, verify, commit, resume) as the coordinator reports it.
The models differ (the reference engine's small transformer, SGLang's tiny Llama), so the table gives bytes and
throughput as well as seconds: at these sizes a round is dominated by the engines' control calls, which is what
the ratio compares. Absolute times mean something only on the machine that produced them.

    python bench/engine_round_bench.py [--rounds 5] [--tp 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_agent.client import WeightSyncClient
from weightsync_testing.engine_harness import EngineHarness, ReferenceEngines, SglangEngines
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.trainer_ranks import publish_all

TEMPLATE: dict[str, Any] = {"spec": {"containers": [{"name": "main", "image": "x"}]}}


def spec(adapter: str, tp: int) -> WeightSyncGroupSpec:
    return WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": 2, "template": TEMPLATE},
            "inference": {"engines": 1, "ranksPerEngine": tp, "ranksPerPod": tp, "adapter": adapter,
                          "template": TEMPLATE},
            "transfer": {"protocol": "tcp", "bucketSizeMiB": 4, "timeoutSeconds": 120},
        }
    )  # fmt: skip


def publish(clients: list[WeightSyncClient], state: dict[str, torch.Tensor], version: int) -> dict[str, Any]:
    outcome: Any = publish_all(clients, state, version, timeout=300)[0]
    if isinstance(outcome, Exception) or not outcome.ok:
        raise RuntimeError(str(outcome) if isinstance(outcome, Exception) else outcome.summary())
    return {"seconds": outcome.round.duration_seconds, "bytes": outcome.round.bytes}


def measure(name: str, group: LoopbackGroup, state: dict[str, torch.Tensor], rounds: int) -> dict[str, Any]:
    clients = [group.client(rank) for rank in range(2)]
    try:
        publish(clients, state, 1)  # warm-up: connections, first registration
        runs = []
        for version in range(2, rounds + 2):
            moved = {k: v + version * 1e-3 for k, v in state.items()}
            runs.append(publish(clients, moved, version))
    finally:
        for client in clients:
            client.close()
    seconds = statistics.median(r["seconds"] for r in runs)
    nbytes = runs[0]["bytes"]
    return {"engine": name, "rounds": rounds, "median_s": seconds, "bytes": nbytes, "gbps": nbytes * 8 / seconds / 1e9}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)

    from safetensors.torch import load_file

    from weightsync_testing.reference_engine.model import full_state
    from weightsync_testing.sglang_env import sglang_python
    from weightsync_testing.sglang_models import ensure_tiny_model

    python = str(sglang_python())
    model = ensure_tiny_model(python, "llama", dtype="float32")
    cases: list[tuple[str, str, EngineHarness, dict[str, torch.Tensor]]] = [
        ("reference", "reference", ReferenceEngines(), full_state(0)),
        ("sglang", "sglang", SglangEngines(model, python=python, dtype="float32",
                                           log_dir=Path(tempfile.mkdtemp(prefix="bench-sglang-"))),
         load_file(str(next(model.glob("*.safetensors"))))),
    ]  # fmt: skip
    results = []
    for name, adapter, harness, state in cases:
        started = time.monotonic()
        with LoopbackGroup(spec(adapter, args.tp), group=f"bench-{name}", engines=harness) as group:
            group.start(timeout=300)
            print(f"{name}: group ready in {time.monotonic() - started:.1f} s", file=sys.stderr)
            results.append(measure(name, group, state, args.rounds))
    ratio = results[1]["median_s"] / results[0]["median_s"]
    if args.json:
        print(json.dumps({"results": results, "sglang_over_reference": ratio}))
        return 0
    print(f"{'engine':<10}{'rounds':>7}{'median s':>10}{'bytes':>12}{'Gbit/s':>9}")
    for r in results:
        print(f"{r['engine']:<10}{r['rounds']:>7}{r['median_s']:>10.3f}{r['bytes']:>12}{r['gbps']:>9.3f}")
    print(f"sglang round / reference round: {ratio:.2f}x (TP{args.tp}, same machine, same run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
