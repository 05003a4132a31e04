"""What a stock SGLang engine holds by its own checksums (``/weights_checker``), against the trainer's bytes: an
independent look at a round's result, beside the round's own verification."""

from __future__ import annotations

from pathlib import Path

from weightsync_agent.layout.sglang_hash.tensor_hash import sglang_cpu_hash
from weightsync_agent.targets.engine_client import EngineClient
from weightsync_testing.sglang_models import trained_state


def assert_tp2_engine_holds(engine: EngineClient, model: Path, version: int) -> None:
    """The tiny model's TP 2 CPU engine ``engine``, rank by rank, holds the trainer's ``version`` of ``model``: a
    replicated norm whole on both ranks, the row-parallel o_proj as each rank's half of its columns."""
    full = trained_state(model, version)
    _, answer = engine.request("POST", "/weights_checker", body={"action": "checksum"}, timeout=60)
    assert len(answer["ranks"]) == 2, answer  # TP 2
    norm, o_proj = "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.o_proj.weight"
    for rank, held in enumerate(r["checksums"] for r in answer["ranks"]):
        assert held[norm] == sglang_cpu_hash(full[norm]), (rank, norm)
        assert held[o_proj] == sglang_cpu_hash(full[o_proj].chunk(2, dim=1)[rank]), (rank, o_proj)
