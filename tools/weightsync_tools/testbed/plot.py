"""The sweep as a PNG: round time against the number of engines, p2p and broadcast, with their link bounds."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def plot_sweep(report: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = report["sweep"]
    engines = [p["engines"] for p in points]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
    ax.plot(engines, [p["broadcast_s"] for p in points], "o-", color="tab:red", label="broadcast (gloo, rank 0)")
    ax.plot(engines, [p["p2p_s"] for p in points], "o-", color="tab:blue", label="p2p (Mooncake, 4 trainer nodes)")
    if all(p["p2p_bound_s"] is not None for p in points):
        ax.plot(engines, [p["broadcast_bound_s"] for p in points], "--", color="tab:red", alpha=0.5,
                label="broadcast link bound")  # fmt: skip
        ax.plot(engines, [p["p2p_bound_s"] for p in points], "--", color="tab:blue", alpha=0.5, label="p2p link bound")
    lay = report["layout"]
    network = f"{report['rate']} links" if report.get("rate") else "loopback, no caps"
    mib = points[0].get("model_mib")
    model = f", {mib:.0f} MiB model" if mib else ""
    ax.set_title(f"{lay['trainers']} trainer nodes -> N engines x TP{lay['tp']} ({network}{model})", fontsize=10)
    ax.set_xlabel("engines (N)")
    ax.set_ylabel("round time, s (live round, whole protocol)")
    ax.set_xticks(engines)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
