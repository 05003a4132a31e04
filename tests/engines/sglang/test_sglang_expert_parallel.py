"""Live rounds into the STOCK SGLang server running expert parallelism: Qwen3-MoE-shaped (tiny), TP 2 with
``--ep-size 2``, each rank holding half the experts whole instead of every expert's half.

The trace follows TP only, and takes Qwen3-MoE at TP 2; but at TP 2 and EP 2 a TP cut of the experts has exactly as
many elements as SGLang's EP layout: a manifest built from it passed every size check, the rounds committed (SGLang's
checker hashed what was sent), and the experts held the wrong bytes (this test, before the fix: the independent hash
below differed). So a server running EP (or DP attention) is synced through the engine replica, built with the
server's own parallelism (targets/sglang/parallelism.py); DeepSeek-V3 with EP goes the same way (the survey checks it
bit-exact). Checked: both ranks' manifests take the engine-replica path with EP 2 and hold their own experts, SGLang's
``/weights_checker`` verifies each round, and, independently of the rounds, SGLang's hash of each rank's fused experts
is the hash of that rank's half of the trainer's experts, whole. Stock SGLang runs an EP MoE forward only on an
accelerator (its standard token dispatcher asks for one: "No accelerator ... is available"), so this server takes
rounds without a forward (no warm-up, ready without ``/health``), as the FP8 server does.
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

EXPERTS = "model.layers.0.mlp.experts.w13_weight"


@pytest.fixture(scope="module")
def group(sglang_py: Path, tiny_qwen3_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackGroup]:
    logs = tmp_path_factory.mktemp("sglang-ep")
    harness = SglangEngines(tiny_qwen3_moe, python=str(sglang_py), dtype="float32", log_dir=logs,
                            extra_args=["--ep-size", "2"], no_forward=True)  # fmt: skip
    with replica_group(sglang_py, harness, spec(2, trainers=1, timeout=180), "sg-ep", timeout=400) as running:
        yield running


def test_an_expert_parallel_server_is_synced_through_its_own_layout_each_rank_holding_its_own_experts(
    group: LoopbackGroup, tiny_qwen3_moe: Path
) -> None:
    shapes = []
    for rank in (0, 1):
        manifest = group.manifest(0, rank)
        assert {t.path for t in manifest.tensors} == {"engine-replica"}
        assert manifest.replica is not None and (manifest.replica.tp, manifest.replica.ep) == (2, 2)
        shapes.append(next(t.shape for t in manifest.tensors if t.name == EXPERTS))
    # Each rank holds half of the experts, whole (a TP cut would hold all of them, each half as wide).
    experts = json.loads((tiny_qwen3_moe / "config.json").read_text())["num_local_experts"]
    half = experts // 2
    assert shapes[0] == shapes[1] and shapes[0][0] == half, shapes
    engine = group.engines[0].client(timeout=60)
    with group.clients() as clients:
        for version in (1, 2):
            full = trained_state(tiny_qwen3_moe, version)
            publish_ok(clients, full, version)
            assert engine.weight_version() == str(version)
    _, answer = engine.request("POST", "/weights_checker", body={"action": "checksum"}, timeout=60)
    held = {
        next(int(i["tp_rank"]) for i in entry["parallelism_info"]): entry["checksums"][EXPERTS]
        for entry in answer["ranks"]
    }
    for rank, local in ((0, range(0, half)), (1, range(half, experts))):
        expert = "model.layers.0.mlp.experts.{}.{}_proj.weight"
        fused = torch.stack([torch.cat([full[expert.format(e, "gate")], full[expert.format(e, "up")]]) for e in local])
        assert held[rank] == hashlib.sha256(fused.contiguous().numpy().tobytes()).digest()[:8].hex(), rank
