"""The PNG for ``weightsync simulate --plot``: broadcast vs Miles P2P vs ours, per preset, at 1x/2x/4x.

The one module of the package that does I/O; matplotlib is imported lazily (it is a dev extra).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from weightsync_tools.simulate.hardware import Hardware
from weightsync_tools.simulate.model import Simulation, simulate
from weightsync_tools.simulate.scenario import SCENARIOS

SCALES = (1, 2, 4)


def sweep(presets: Sequence[str], hw: Hardware, scales: Sequence[int] = SCALES) -> dict[str, list[Simulation]]:
    return {name: [simulate(SCENARIOS[name].scaled(k), hw) for k in scales] for name in presets}


def write_plot(path: Path, results: dict[str, list[Simulation]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = (("broadcast", "NCCL broadcast", "#c44e52"), ("p2p", "Miles P2P", "#4c72b0"), ("ours", "ours", "#55a868"))
    fig, axes = plt.subplots(1, len(results), figsize=(3.4 * len(results), 3.3), squeeze=False)
    for ax, sims in zip(axes[0], results.values(), strict=True):
        width = 0.26
        for i, (attr, label, colour) in enumerate(modes):
            xs = [j + (i - 1) * width for j in range(len(sims))]
            ys = [getattr(s, attr).seconds for s in sims]
            ax.bar(xs, ys, width, label=label, color=colour)
            for x, y in zip(xs, ys, strict=True):
                ax.text(x, y, f"{y:.0f}" if y >= 10 else f"{y:.1f}", ha="center", va="bottom", fontsize=6)
        published = sims[0].scenario.published
        if published is not None:
            ax.hlines(
                [published.broadcast_s, published.p2p_s],
                [-1.5 * width, -0.5 * width],
                [-0.5 * width, 0.5 * width],
                colors="k",
                linewidth=2,
            )
        ax.set_xticks(
            range(len(sims)),
            [f"{s.scenario.scale}x\n{s.scenario.trainer_nodes}+{s.scenario.inference_nodes}" for s in sims],
        )
        ax.set_title(sims[0].scenario.model.name.split(" (")[0], fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_ylabel("sync time (s)", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="upper right", ncol=3, frameon=False)
    fig.suptitle("Modelled sync time (black lines: published, 1x)", fontsize=9, x=0.3)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
