"""A round into an FP8 block target against a BF16 round of the same model, on the emulated cluster (a benchmark,
not a test; docs/engines/engine-replicas.md, "Costs").

The trainer holds BF16 in both. Into the BF16 target the sources copy its bytes; into the FP8 block target (the
DeepSeek-V3 / Kimi-K2 checkpoint format: e4m3 linear weights with float32 scales per 128 x 128 tile, embedding, norms
and head in BF16) they quantize each linear weight where they stage (on the CPU here; a trainer's GPU does it at
~120 GB/s, ``bench/quantize_bench.py``) and send about half the bytes. Does half the bytes pay for the quantizing?

Both run on the testbed of ``weightsync bench`` (docs/testbed.md): every trainer node and every engine rank in its
own network namespace behind a capped link, real ``weightsync agent`` processes, reference engines whose FP8 form
holds the checkpoint's bytes and computes with them dequantized. Per round, as a trainer sees it: every rank stages
its BF16 tensors (the FP8 target's quantizing happens here), then publishes; the time runs from the first staged
byte to the last rank's commit. The two targets run one after the other, ``--rounds`` each after a warm-up round,
and every target is checked bit-exact against the checkpoint the engine's own load would hold.

    sudo python bench/fp8_round_bench.py [--mib 256] [--rounds 5] [--rate 1gbit] [--layout 4,2,2] [--json]
    python bench/fp8_round_bench.py --no-caps     # loopback, no namespaces: the CPU's side only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from weightsync_tools.testbed.runner import (
    P2P_SEED,
    Group,
    Net,
    Options,
    TimedRound,
    _model_bytes,
    new_workdir,
    open_testbed,
    tear_down,
)
from weightsync_tools.testbed.scenario import Layout, MiB, Stats, format_rate, model_shape, parse_rate

TARGETS: dict[str, dict[str, Any]] = {
    "bf16": {"dtype": "bfloat16"},
    "fp8": {"dtype": "bfloat16", "quantization": "fp8-block"},
}
#: Staged: every rank stages everything, then publishes (quantizing, then sending). Streamed: each bucket goes out as
#: soon as its bytes are staged (quantizing the next tensors while the last ones are on the wire).
WAYS = ("staged", "streamed")
#: The issue's bar: an FP8 round at most this many times a BF16 round of the same model.
TARGET_RATIO = 1.0


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def measure(target: str, net: Net, layout: Layout, mib: float, options: Options) -> dict[str, Any]:
    # model_shape sizes float32 tensors: twice the MiB gives ``mib`` of BF16.
    model = {**model_shape(2 * mib), **TARGETS[target]}
    workdir = new_workdir()
    group = Group(net, layout, model, options, workdir, say)
    try:
        group.start_engines(layout.engines)
        group.start_agents(layout.engines)
        assert group.p2p_plan is not None
        wire = sum(group.target_bytes(group.p2p_plan).values())
        rounds: dict[str, list[TimedRound]] = {way: [] for way in WAYS}
        version = 0
        for repetition in range(options.rounds + 1):
            for way, run in (("staged", group.staged_p2p_round), ("streamed", group.streamed_p2p_round)):
                version += 1
                timed = run(version)
                timed.round.check()
                if repetition:  # the first of each way is a warm-up: connections, registrations, page faults
                    rounds[way].append(timed)
                say(f"  {target} {way} round {version}: stage {timed.stage_s:.2f} s, round "
                    f"{timed.round.seconds:.2f} s, stage to commit {timed.total_s:.2f} s")  # fmt: skip
        wrong = group.check_targets(group.p2p_plan, P2P_SEED) if options.check else []
        out: dict[str, Any] = {"trainer_bytes": _model_bytes(model), "target_bytes": wire, "bit_exact": not wrong,
                               "not_bit_exact": wrong}  # fmt: skip
        for way, timed_rounds in rounds.items():
            out[way] = {
                "stage_s": Stats.of(r.stage_s for r in timed_rounds).as_json(),
                "round_s": Stats.of(r.round.seconds for r in timed_rounds).as_json(),
                "total_s": Stats.of(r.total_s for r in timed_rounds).as_json(),
            }
        return out
    finally:
        tear_down(group, None, workdir, None)


def table(report: dict[str, Any]) -> str:
    rows = ["| target | way | trainer bytes | bytes to the engines | staging (median) | round (median) | stage to "
            "commit (median, min-max) | bit-exact |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for target in TARGETS:
        r = report[target]
        for way in WAYS:
            w, t = r[way], r[way]["total_s"]
            rows.append(f"| {target} | {way} | {r['trainer_bytes'] / MiB:.0f} MiB | {r['target_bytes'] / MiB:.0f} MiB "
                        f"| {w['stage_s']['median']:.2f} s | {w['round_s']['median']:.2f} s | {t['median']:.2f} s "
                        f"({t['min']:.2f}-{t['max']:.2f}) | {'yes' if r['bit_exact'] else 'NO'} |")  # fmt: skip
    rows.append("")
    for way in WAYS:
        met = "met" if report["ratio_met"][way] else "NOT met"
        rows.append(f"FP8 / BF16, {way}, stage to commit: **{report['ratio'][way]:.2f}** (bar <= {TARGET_RATIO}: "
                    f"{met})")  # fmt: skip
    rows.append(f"{report['network']}; {report['cpus']} CPUs")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=256, help="the BF16 model's size in MiB (default 256)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per target, after one warm-up")
    parser.add_argument("--rate", default="1gbit", help="every link's cap per direction (default 1gbit)")
    parser.add_argument("--layout", default="4,2,2", help="trainer nodes,engines,TP (default 4,2,2)")
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--no-caps", action="store_true", help="loopback, no namespaces (no root needed)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    trainers, engines, tp = (int(x) for x in args.layout.split(","))
    layout = Layout(trainers, engines, tp)
    options = Options(caps=not args.no_caps, rate=args.rate, rounds=args.rounds, bucket_mib=args.bucket_mib,
                      sweep=[], layout=layout)  # fmt: skip
    rate_bits = parse_rate(args.rate) if options.caps else None
    started = time.monotonic()
    testbed = open_testbed(options, layout, rate_bits, say)
    workdir = new_workdir()
    network = f"links capped at {format_rate(rate_bits)}" if rate_bits else "loopback"
    report: dict[str, Any] = {"layout": args.layout, "mib": args.mib, "rounds": args.rounds, "network": network}
    try:
        if testbed is not None:
            testbed.create()
        net = Net(testbed)
        for target in TARGETS:
            say(f"{target} target: {args.mib:.0f} MiB BF16 trainer, {trainers} trainer nodes -> {engines} engines "
                f"x TP{tp}, {report['network']}")  # fmt: skip
            report[target] = measure(target, net, layout, args.mib, options)
    finally:
        tear_down(None, testbed, workdir, None)
    report["ratio"] = {w: report["fp8"][w]["total_s"]["median"] / report["bf16"][w]["total_s"]["median"] for w in WAYS}
    report["ratio_met"] = {w: ratio <= TARGET_RATIO for w, ratio in report["ratio"].items()}
    report["cpus"] = os.cpu_count()
    report["runtime_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(report, indent=2) if args.json else table(report))
    return 0 if any(report["ratio_met"].values()) and all(report[t]["bit_exact"] for t in TARGETS) else 1


if __name__ == "__main__":
    sys.exit(main())
