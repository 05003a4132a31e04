"""Live rounds into the STOCK SGLang server running expert parallelism and DP attention, as DeepSeek-V3 and Kimi-K2
are served: Qwen3-MoE-shaped (tiny), TP 2 with ``--ep-size 2 --dp-size 2 --enable-dp-attention``: each rank holds
half the experts whole (not every expert's half), and the attention and the embedding whole (the attention's TP group
is one rank). One server for both: each costs minutes to start on two cores.

The trace follows TP only, and takes Qwen3-MoE at TP 2; but at TP 2 and EP 2 a TP cut of the experts has exactly as
many elements as SGLang's EP layout: a manifest built from it passed every size check, the rounds committed (SGLang's
checker hashed what was sent), and the experts held the wrong bytes (with EP alone, before the fix: the independent
hash below differed). So a server running EP or DP attention is synced through the engine replica, built with the
server's own parallelism, read from its ``/server_info`` (targets/sglang/parallelism.py; SGLang 0.5.23 reports DP
attention as ``attn_dp_size``, its ``dp_size`` stays 1: read as ``dp_size``, the replica was built without DP
attention and refused by size, its embedding half the server's). Checked: both ranks' manifests take the
engine-replica path with the server's parallelism, SGLang's ``/weights_checker`` verifies each round, and,
independently of the rounds, SGLang's hash of each tensor the parallelism lays out otherwise (a rank's experts, the
embedding) equals the hash of the trainer's tensor cut as that parallelism cuts it. Stock SGLang computes neither
layout on a CPU (its EP dispatcher and its DP-attention batches ask for an accelerator), so the server takes rounds
without a forward (no warm-up, ready without ``/health``), as the FP8 server does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sglang_helpers import replica_group
from test_sglang_rounds import spec

from weightsync_testing.engine_harness import SglangEngines
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.sglang_models import trained_state
from weightsync_testing.trainer_ranks import publish_ok

pytest.importorskip("safetensors.torch")


def fused_experts(model: Path, full: dict[str, torch.Tensor], rank: int) -> tuple[str, torch.Tensor]:
    """EP 2: rank ``rank``'s half of the experts, each whole, gate and up fused (``w13_weight``)."""
    experts = json.loads((model / "config.json").read_text())["num_local_experts"]
    half = experts // 2
    name = "model.layers.0.mlp.experts.{}.{}_proj.weight"
    local = range(rank * half, (rank + 1) * half)
    return "model.layers.0.mlp.experts.w13_weight", torch.stack(
        [torch.cat([full[name.format(e, "gate")], full[name.format(e, "up")]]) for e in local]
    )


def whole_embedding(model: Path, full: dict[str, torch.Tensor], rank: int) -> tuple[str, torch.Tensor]:
    """DP attention 2 at TP 2: the attention's TP group is one rank, so every rank holds the whole embedding."""
    return "model.embed_tokens.weight", full["model.embed_tokens.weight"]


ARGS = ["--ep-size", "2", "--dp-size", "2", "--enable-dp-attention"]
#: What each parallelism lays out otherwise than TP 2 would: (tensor name, what rank r holds of the trainer's).
HELD = (fused_experts, whole_embedding)


@pytest.fixture(scope="module")
def group(sglang_py: Path, tiny_qwen3_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackGroup]:
    logs = tmp_path_factory.mktemp("sglang-parallel")
    harness = SglangEngines(tiny_qwen3_moe, python=str(sglang_py), dtype="float32", log_dir=logs, extra_args=ARGS,
                            no_forward=True)  # fmt: skip
    with replica_group(sglang_py, harness, spec(2, trainers=1, timeout=180), "sg-par", timeout=400) as running:
        yield running


def test_a_server_running_ep_and_dp_attention_is_synced_through_its_own_layout(
    group: LoopbackGroup, tiny_qwen3_moe: Path
) -> None:
    model = tiny_qwen3_moe
    for rank in (0, 1):
        manifest = group.manifest(0, rank)
        assert {t.path for t in manifest.tensors} == {"engine-replica"}
        assert manifest.replica is not None
        assert (manifest.replica.tp, manifest.replica.ep, manifest.replica.dp) == (2, 2, 2)
    engine = group.engines[0].client(timeout=60)
    with group.clients() as clients:
        for version in (1, 2):
            full = trained_state(model, version)
            publish_ok(clients, full, version)
            assert engine.weight_version() == str(version)
    _, answer = engine.request("POST", "/weights_checker", body={"action": "checksum"}, timeout=60)
    held = {next(int(i["tp_rank"]) for i in entry["parallelism_info"]): entry["checksums"] for entry in answer["ranks"]}
    for rank in (0, 1):
        for cut in HELD:
            name, tensor = cut(model, full, rank)
            want = hashlib.sha256(tensor.contiguous().numpy().tobytes()).digest()[:8].hex()
            assert held[rank][name] == want, (rank, name)
