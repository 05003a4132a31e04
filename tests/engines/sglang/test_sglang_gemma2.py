"""A live p2p round into the STOCK SGLang server serving Gemma-2 (tiny), whose norms SGLang derives a buffer from.

SGLang's ``GemmaRMSNorm`` keeps ``gemma_weight`` = ``weight + 1``, computed by its ``load_weights``: one-sided writes
of the parameters leave it stale, and SGLang's weight-update session does not re-derive it, so the trace refuses the
model. Started with the stock flag ``--custom-weight-loader weightsync_engine.sglang.aliases.rebind_parameter_aliases``,
SGLang accepts weightsync's custom weight loader, which runs SGLang's own ``_rebind_parameter_aliases``; the adapter
calls it after the writes, before the session ends (docs/engines/sglang.md). Checked: the manifest is the trace's,
listing the buffers SGLang re-derives; the round verifies with SGLang's own ``/weights_checker``; and greedy generation
equals an HF ``transformers`` forward of the trainer's weights, which needs the re-derived buffers (the norms scale by
``1 + weight``). One server, one round: the second version's path is the first's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from sglang_helpers import assert_generates_like_hf
from test_sglang_rounds import spec

from weightsync_testing.engine_harness import SglangEngines
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.sglang_models import ensure_tiny_model, trained_state
from weightsync_testing.trainer_ranks import publish_all

pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def tiny_gemma2(sglang_py: Path) -> Path:
    return ensure_tiny_model(sglang_py, "gemma2", seed=0, dtype="float32")


@pytest.fixture(scope="module")
def group(sglang_py: Path, tiny_gemma2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackGroup]:
    logs = tmp_path_factory.mktemp("sglang-gemma2")
    harness = SglangEngines(tiny_gemma2, python=str(sglang_py), dtype="float32", log_dir=logs, rebind=True)
    with LoopbackGroup(spec(1, trainers=1, timeout=120), group="sg-gemma2", engines=harness) as running:
        running.start(timeout=300)
        yield running


def test_gemma2_syncs_by_p2p_with_sglangs_own_rebind_verifies_and_generates_like_hf(
    group: LoopbackGroup, sglang_py: Path, tiny_gemma2: Path, tmp_path: Path
) -> None:
    manifest = group.manifest(0)
    assert {t.path for t in manifest.tensors} == {"trace"} and manifest.replica is None
    # Every GemmaRMSNorm's buffer: four per layer and the final norm; re-derived by SGLang, never written.
    assert len(manifest.rederived) == 9 and all(n.endswith(".gemma_weight") for n in manifest.rederived)
    assert "model.layers.0.input_layernorm.gemma_weight" in manifest.rederived
    assert not set(manifest.rederived) & {t.name for t in manifest.tensors}
    engine = group.engines[0].client(timeout=60)
    full = trained_state(tiny_gemma2, 1)
    with group.clients() as clients:
        outcomes = publish_all(clients, full, 1)
    assert all(getattr(o, "ok", False) for o in outcomes), [str(o) for o in outcomes]
    assert engine.weight_version() == "1"
    # SGLang's own checksum of a norm's weight is the trainer's bytes (the round's verification, checked again here).
    _, answer = engine.request("POST", "/weights_checker", body={"action": "checksum"}, timeout=60)
    [rank0] = answer["ranks"]
    norm = "model.layers.0.input_layernorm.weight"
    assert rank0["checksums"][norm] == hashlib.sha256(full[norm].numpy().tobytes()).digest()[:8].hex()
    # Right only if SGLang re-derived gemma_weight = weight + 1 from the written norms.
    assert_generates_like_hf(engine, sglang_py, tiny_gemma2, full, 1, tmp_path)
