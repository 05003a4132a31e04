"""Planner benchmark: time and size against the budgets, printed as a table.

    python bench/plan_bench.py [--runs N]

Budgets: a fresh plan for 10,000 targets x 1,000 sources in under 200 ms (planning, building the
Plan, validating and hashing it, i.e. all of ``plan_for``), and the serialised plan for 4,096 ranks
on each side under 1 MiB. The other rows are for information. Exits 1 if a budgeted row fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync.plan import Plan, plan_for, replan

TEMPLATE: dict[str, Any] = {"spec": {"containers": [{"name": "main", "image": "x"}]}}
TIME_BUDGET_MS = 200.0
SIZE_BUDGET = 1 << 20


def make_spec(
    pods: int, ranks_per_pod: int, engines: int, tp: int, *, planner: str = "balanced", cap: int | None = None
) -> WeightSyncGroupSpec:
    transfer: dict[str, Any] = {"planner": planner}
    if cap is not None:
        transfer["maxReplicaShapesPerSource"] = cap
    return WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": pods, "ranksPerPod": ranks_per_pod, "template": TEMPLATE},
            "inference": {
                "engines": engines,
                "ranksPerEngine": tp,
                "ranksPerPod": min(tp, 8),
                "template": TEMPLATE,
            },
            "transfer": transfer,
        }
    )


def median_ms(action: Callable[[], object], runs: int) -> float:
    action()  # warm caches (pydantic validators, imports) so the first run does not skew the median
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        action()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


@dataclass
class Row:
    name: str
    value: str
    budget: str = ""
    ok: bool | None = None

    def cells(self) -> list[str]:
        verdict = "" if self.ok is None else ("pass" if self.ok else "FAIL")
        return [self.name, self.value, self.budget, verdict]


def timed(name: str, action: Callable[[], object], runs: int, *, budgeted: bool = False) -> Row:
    ms = median_ms(action, runs)
    if budgeted:
        return Row(name, f"{ms:.1f} ms", f"< {TIME_BUDGET_MS:.0f} ms", ms < TIME_BUDGET_MS)
    return Row(name, f"{ms:.1f} ms")


def sized(name: str, plan: Plan, *, budgeted: bool = False) -> Row:
    size = len(plan.to_json().encode())
    value = f"{size / 1024:.0f} KiB"
    if budgeted:
        return Row(name, value, "< 1024 KiB", size < SIZE_BUDGET)
    return Row(name, value)


def rows(runs: int) -> list[Row]:
    big = make_spec(125, 8, 1250, 8)  # 1,000 sources, 10,000 targets
    wide = make_spec(1000, 1, 625, 16)
    uneven = make_spec(1000, 1, 1249, 8)  # 9,992 targets: loads 9 or 10
    old = plan_for(big)
    grown = make_spec(125, 8, 1300, 8)
    return [
        timed("plan_for balanced 1000 src x 1250 eng x TP8", lambda: plan_for(big), runs, budgeted=True),
        timed("plan_for balanced 1000 src x 625 eng x TP16", lambda: plan_for(wide), runs, budgeted=True),
        timed("plan_for balanced 1000 src x 1249 eng x TP8", lambda: plan_for(uneven), runs, budgeted=True),
        timed(
            "plan_for miles    1000 src x 1250 eng x TP8",
            lambda: plan_for(make_spec(125, 8, 1250, 8, planner="miles")),
            runs,
        ),
        timed(
            "plan_for balanced, cap binds (2000 src, 64x256, cap 1)",
            lambda: plan_for(make_spec(2000, 1, 64, 256, cap=1)),
            runs,
        ),
        timed(
            "plan_for balanced, shape DP (2467 src, 96x128)",
            lambda: plan_for(make_spec(2467, 1, 96, 128)),
            runs,
        ),
        timed("replan +50 engines (1250 -> 1300, TP8, 1000 src)", lambda: replan(old, grown), runs),
        timed("replan -16 trainer pods (1000 -> 872 src)", lambda: replan(old, make_spec(109, 8, 1250, 8)), runs),
        sized("plan.json, 4096 src -> 512 eng x TP8", plan_for(make_spec(512, 8, 512, 8)), budgeted=True),
        sized("plan.json, 16384 src -> 64 eng x TP256", plan_for(make_spec(256, 64, 64, 256))),
    ]


def table(lines: list[Row]) -> str:
    header = ["case", "measured", "budget", "result"]
    cells = [header] + [row.cells() for row in lines]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    out = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    out.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs per case (median reported)")
    args = parser.parse_args()
    lines = rows(args.runs)
    print(table(lines))
    return 0 if all(row.ok is not False for row in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
