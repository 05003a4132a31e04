"""The published cluster configurations (notes §1.10, from the Miles docs and the companion post).

All runs: H100 8-GPU hosts with InfiniBand; trainer and inference node counts are equal; each number is
the mean of 10 updates after the first. Inference engines are TP = EP across all their ranks, so the
engine count is inference GPUs / TP.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from weightsync_tools.simulate.models import MODELS, ModelSpec


@dataclass(frozen=True)
class Published:
    broadcast_s: float
    p2p_s: float
    source: str = "radixark/miles docs/advanced/p2p-weight-transfer.md (notes §1.10)"


@dataclass(frozen=True)
class Scenario:
    preset: str
    model: ModelSpec
    trainer_nodes: int
    inference_nodes: int
    train_tp: int
    train_pp: int
    train_cp: int
    train_ep: int
    infer_tp: int
    """Ranks per engine (TP = EP in every published run)."""
    published: Published | None = None
    scale: int = 1
    broadcast_receivers: Literal["rank", "engine"] = "rank"
    """Who joins the broadcast group: every inference rank (SGLang's ``update_weights_from_distributed``),
    or one member per engine process that cuts its ranks' shards itself (the reference engine's
    ``broadcast: engine``, the testbed)."""
    miles_schedule: Literal["per_bucket", "stage_then_write"] = "per_bucket"
    """How the Miles P2P way orders its work. ``per_bucket``: Miles' own loop (gather, load each replica
    shape, write; notes §1.7). ``stage_then_write``: the testbed's Miles-style way, which gathers and stages
    everything and then runs one of our rounds (writes, per-bucket verify) over the staged replicas."""

    def scaled(self, factor: int) -> Scenario:
        """``factor`` times the nodes on both sides: more trainer data parallelism and more engines, with the
        same model sharding (TP/PP/EP), which is how an RL job grows."""
        if factor < 1:
            raise ValueError("scale factor must be >= 1")
        return replace(
            self,
            trainer_nodes=self.trainer_nodes * factor,
            inference_nodes=self.inference_nodes * factor,
            published=self.published if factor == 1 else None,
            scale=self.scale * factor,
        )

    def label(self) -> str:
        return (
            f"{self.trainer_nodes}+{self.inference_nodes} nodes; train TP{self.train_tp} PP{self.train_pp} "
            f"CP{self.train_cp} EP{self.train_ep}; infer TP{self.infer_tp} EP{self.infer_tp}"
        )


SCENARIOS: dict[str, Scenario] = {
    "kimi-k2": Scenario(
        preset="kimi-k2",
        model=MODELS["kimi-k2"],
        trainer_nodes=32,
        inference_nodes=32,
        train_tp=8,
        train_pp=8,
        train_cp=4,
        train_ep=32,
        infer_tp=32,
        published=Published(broadcast_s=53.2791, p2p_s=7.2273),
    ),
    "glm-5": Scenario(
        preset="glm-5",
        model=MODELS["glm-5"],
        trainer_nodes=16,
        inference_nodes=16,
        train_tp=4,
        train_pp=8,
        train_cp=2,
        train_ep=16,
        infer_tp=64,
        published=Published(broadcast_s=58.3015, p2p_s=8.4797),
    ),
    "qwen3-235b": Scenario(
        preset="qwen3-235b",
        model=MODELS["qwen3-235b"],
        trainer_nodes=8,
        inference_nodes=8,
        train_tp=4,
        train_pp=4,
        train_cp=2,
        train_ep=16,
        infer_tp=32,
        published=Published(broadcast_s=10.7536, p2p_s=3.1620),
    ),
}
PRESETS = tuple(SCENARIOS)
