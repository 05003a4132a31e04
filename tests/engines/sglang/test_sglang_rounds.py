"""Live-mode rounds into the STOCK SGLang server (PyPI 0.5.23, unedited, on CPU), through real agents.

Two trainer ranks (this process, as trainer code does in pods) stage an HF state dict that differs from
the checkpoint SGLang loaded, and publish. Their agents build replicas from manifests the engine's own
agent assembles (a trace of SGLang's model code joined with the addresses SGLang publishes); trainer
rank 0's agent pauses SGLang (retract), opens a weight-update session, the sources write over Mooncake
TCP into SGLang's live weights, SGLang's own ``/weights_checker`` verifies every written parameter, the
session closes and only then is the version relabelled. Checked: the engine reports the version, its
checksums equal the trainer's, and its greedy generation equals an HF ``transformers`` forward of the
trainer's weights. Skipped only where the pinned SGLang venv cannot be built (never in CI:
``WEIGHTSYNC_REQUIRE_SGLANG=1``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sglang_helpers import assert_generates_like_hf

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_testing.engine_harness import SglangEngines
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.sglang_models import trained_state
from weightsync_testing.trainer_ranks import publish_all

pytest.importorskip("safetensors.torch")

TEMPLATE: dict[str, Any] = {"spec": {"containers": [{"name": "main", "image": "x"}]}}


@pytest.fixture
def engine_python(sglang_py: Path) -> str:
    return str(sglang_py)


@pytest.fixture
def model_dir(tiny_llama: Path) -> Path:
    return tiny_llama


def spec(tp: int, engines: int = 1, trainers: int = 2, timeout: int = 60, scrub: int = 0) -> WeightSyncGroupSpec:
    return WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": trainers, "template": TEMPLATE},
            "inference": {
                "engines": engines,
                "ranksPerEngine": tp,
                "ranksPerPod": tp,
                "adapter": "sglang",
                "template": TEMPLATE,
            },
            "transfer": {"protocol": "tcp", "bucketSizeMiB": 1, "timeoutSeconds": timeout, "scrubSeconds": scrub},
        }
    )


@pytest.fixture(params=[1, 2], ids=["tp1", "tp2"])
def group(
    request: pytest.FixtureRequest, engine_python: str, model_dir: Path, tmp_path: Path
) -> Iterator[LoopbackGroup]:
    harness = SglangEngines(model_dir, python=engine_python, dtype="float32", log_dir=tmp_path / "sglang")
    with LoopbackGroup(spec(request.param), group=f"sg-tp{request.param}", engines=harness) as running:
        running.start(timeout=300)
        yield running


def test_live_rounds_into_stock_sglang_verify_and_generate_like_hf(
    group: LoopbackGroup, engine_python: str, model_dir: Path, tmp_path: Path
) -> None:
    clients = [group.client(rank) for rank in range(2)]
    engine = group.engines[0].client(timeout=60)
    try:
        for version in (1, 2):
            full = trained_state(model_dir, version)
            outcomes = publish_all(clients, full, version)
            assert all(getattr(o, "ok", False) for o in outcomes), [str(o) for o in outcomes]
            assert engine.weight_version() == str(version)

            # SGLang's own checksums of its live weights equal the sha256[:8] of the bytes the trainer staged.
            _, answer = engine.request("POST", "/weights_checker", body={"action": "checksum"}, timeout=60)
            held = {
                (int(e["parallelism_info"][0]["tp_rank"]), name): value
                for e in answer["ranks"]
                for name, value in e["checksums"].items()
            }
            embed = full["model.embed_tokens.weight"]
            tp = group.plan.layout.ranks_per_engine
            for rank, shard in enumerate(embed.chunk(tp, dim=0)):
                want = hashlib.sha256(shard.contiguous().numpy().tobytes()).digest()[:8].hex()
                assert held[(rank, "model.embed_tokens.weight")] == want, rank

            assert_generates_like_hf(engine, Path(engine_python), model_dir, full, version, tmp_path)
    finally:
        for client in clients:
            client.close()
