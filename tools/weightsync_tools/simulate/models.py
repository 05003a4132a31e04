"""Model presets: how many bytes a sync moves and how they are sharded.

Sources: the public model cards / configs, checked through the shared notes
(``shared/notes/weight-sync-prior-art.md``) where they mention a figure.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float
    """Total parameters."""
    wire_bytes: float
    """Bytes of the inference weights, in the engine's dtype: what a target holds across all its ranks."""
    train_bytes_per_param: float
    """The trainer's dtype (BF16 = 2). Buckets are filled and all-gathered in this dtype."""
    expert_fraction: float
    """Share of the parameters in routed experts: the part the trainer all-gathers across EP."""
    layers: int
    experts: int
    dtype: str
    post_process_s: float = 0.0
    """Engine-side ``post_load_weights`` after a P2P write (requantisation, MLA splits), per rank."""
    source: str = ""
    replicated_bytes: float = 0.0
    """Part of ``wire_bytes`` that every inference rank holds whole instead of a ``1/TP`` slice of it (the
    embedding and LM head of an engine that does not shard its vocabulary, as the reference engine). P2P
    writes it to every rank; a broadcast sends it once per member like everything else. Zero for the
    published presets: SGLang shards the vocabulary."""

    def __post_init__(self) -> None:
        if not 0 <= self.replicated_bytes <= self.wire_bytes:
            raise ValueError(f"replicated bytes {self.replicated_bytes} outside 0..wire bytes {self.wire_bytes}")

    def shard_bytes(self, tp: int) -> float:
        """What one inference rank of a TP-``tp`` engine holds: its slice of the split part, plus the
        replicated part whole."""
        return (self.wire_bytes - self.replicated_bytes) / tp + self.replicated_bytes

    @property
    def train_bytes(self) -> float:
        return self.params * self.train_bytes_per_param

    def scaled(self, factor: float) -> ModelSpec:
        """The same architecture with ``factor`` times the parameters (for monotonicity checks)."""
        return ModelSpec(
            name=f"{self.name}x{factor:g}",
            params=self.params * factor,
            wire_bytes=self.wire_bytes * factor,
            train_bytes_per_param=self.train_bytes_per_param,
            expert_fraction=self.expert_fraction,
            layers=self.layers,
            experts=self.experts,
            dtype=self.dtype,
            post_process_s=self.post_process_s,
            source=self.source,
            replicated_bytes=self.replicated_bytes * factor,
        )


KIMI_K2 = ModelSpec(
    name="Kimi-K2 1T (FP8, [64,64] blocks)",
    # 61 layers (1 dense + 60 MoE), 384 routed experts + 1 shared, hidden 7168, expert FFN 2048, MLA:
    # routed experts 60 x 384 x 3 x 7168 x 2048 = 1.015e12; model card: 1T total, 32B active.
    params=1.04e12,
    # FP8 weights (1 byte/param), BF16 embeddings/norms, fp32 block scales: the FP8 checkpoint is
    # 959 GiB = 1.03e12 bytes. Notes §1.10 derive "about 31 GB per inference rank" at TP/EP 32.
    wire_bytes=1.03e12,
    train_bytes_per_param=2.0,
    expert_fraction=0.976,
    layers=61,
    experts=384,
    dtype="fp8",
    # Notes §1.2: the docs' Kimi figure includes about 884 ms of GPU post_load_weights requantisation.
    post_process_s=0.884,
    source="moonshotai/Kimi-K2 model card and config.json; notes §1.2, §1.10",
)

GLM_5 = ModelSpec(
    name="GLM-5 744B-A40B (BF16)",
    # 78 layers (3 dense + 75 MoE), 256 routed + 1 shared expert, hidden 6144, expert FFN 2048, MLA+DSA
    # (transformers GlmMoeDsaConfig defaults): routed experts 75 x 256 x 3 x 6144 x 2048 = 7.25e11.
    params=744e9,
    wire_bytes=744e9 * 2,
    train_bytes_per_param=2.0,
    expert_fraction=0.974,
    layers=78,
    experts=256,
    dtype="bf16",
    post_process_s=0.0,  # not reported (notes §1.10); BF16 needs no requantisation
    source="zai-org/GLM-5 README (744B total, 40B active); notes §1.10",
)

QWEN3_235B = ModelSpec(
    name="Qwen3-235B-A22B (BF16)",
    # 94 layers, all MoE, 128 experts (8 active), hidden 4096, expert FFN 1536:
    # routed experts 94 x 128 x 3 x 4096 x 1536 = 2.27e11.
    params=235e9,
    wire_bytes=235e9 * 2,
    train_bytes_per_param=2.0,
    expert_fraction=0.966,
    layers=94,
    experts=128,
    dtype="bf16",
    post_process_s=0.0,
    source="Qwen/Qwen3-235B-A22B model card; notes §1.10",
)

MODELS: dict[str, ModelSpec] = {"kimi-k2": KIMI_K2, "glm-5": GLM_5, "qwen3-235b": QWEN3_235B}
