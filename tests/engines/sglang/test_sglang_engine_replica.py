"""Live rounds into the STOCK SGLang server serving a DeepSeek-V3-shaped model (Kimi-K2's architecture, tiny), synced
through an engine replica: SGLang's own model class on the source, filled by its own ``load_weights``.

The trace refuses this model (MLA's ``fused_qkv_a_proj_with_mqa`` is ``q_a_proj`` and ``kv_a_proj_with_mqa`` fused on
load, and ``w_kc``/``w_vc`` are derived from ``kv_b_proj`` after it), so the engine's agent publishes an
engine-replica manifest; the source's agent runs SGLang's loader over what the trainer staged and writes the result
into SGLang's live weights over Mooncake. Checked: the manifest's path per parameter, SGLang's own
``/weights_checker`` (the round's verification), the version, and greedy generation against an HF ``transformers``
forward of the trainer's weights (which is right only if SGLang's end of session re-derived ``w_kc``/``w_vc``).

And the same model as an FP8 block checkpoint (DeepSeek-V3's and Kimi-K2's rollout format) from a BF16 trainer: the
source quantizes the trainer's tensors into the checkpoint's format and SGLang's loader takes them; verified by
SGLang's ``/weights_checker`` (on this CPU, SGLang has no FP8 kernel to generate with: docs/engines/engine-replicas.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang_helpers import assert_generates_like_hf, replica_group
from test_sglang_rounds import spec

from weightsync_agent.client.trainer import RoundOutcome
from weightsync_agent.layout.checksums import dequantized_bytes
from weightsync_agent.layout.quantize import fp8_block
from weightsync_agent.layout.sglang_hash.tensor_hash import sglang_cpu_hash
from weightsync_agent.rounds.canary import Canary
from weightsync_agent.rounds.driver import RoundResult
from weightsync_agent.rounds.remote import AgentClient
from weightsync_testing import sglang_cpu
from weightsync_testing.engine_harness import SglangEngines
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.sglang_models import ensure_fp8_model, hf_prompt_logprobs, trained_state, with_weights
from weightsync_testing.trainer_ranks import publish_all

pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def skip_post_load(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """While this file exists, the server's weight-update sessions end without ``post_load_weights`` (a test fault,
    armed in the server below; docs/engines/sglang-testing.md)."""
    return tmp_path_factory.mktemp("fault") / "skip-post-load"


@pytest.fixture(scope="module")
def harness(
    sglang_py: Path, tiny_deepseek_v3: Path, skip_post_load: Path, tmp_path_factory: pytest.TempPathFactory
) -> SglangEngines:
    logs = tmp_path_factory.mktemp("sglang-dsv3")
    fault = sglang_cpu.fault_env(sglang_cpu.SKIP_POST_LOAD, skip_post_load)
    return SglangEngines(tiny_deepseek_v3, python=str(sglang_py), dtype="float32", log_dir=logs, extra_env=fault)


@pytest.fixture(scope="module")
def group(sglang_py: Path, harness: SglangEngines) -> Iterator[LoopbackGroup]:
    with replica_group(sglang_py, harness, spec(1, trainers=1, timeout=120), "sg-dsv3") as running:
        yield running


def test_deepseek_v3_rounds_through_an_engine_replica_verify_and_generate_like_hf(
    group: LoopbackGroup, harness: SglangEngines, sglang_py: Path, tiny_deepseek_v3: Path, tmp_path: Path
) -> None:
    manifest = group.manifest(0)
    assert {t.path for t in manifest.tensors} == {"engine-replica"}
    names = {t.name for t in manifest.tensors}
    assert "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight" in names  # the loader's fused pair
    assert manifest.replica is not None and manifest.replica.engine == "sglang"
    assert {f.name for f in manifest.replica.feeds} >= {"model.layers.0.self_attn.q_a_proj.weight"}
    feed_bytes = sum(f.nbytes for f in manifest.replica.feeds)
    engine = group.engines[0].client(timeout=60)
    with group.clients() as clients:
        [client] = clients
        for version in (1, 2):
            full = trained_state(tiny_deepseek_v3, version)
            if version == 1:
                outcomes: list[object] = publish_all(clients, full, version)
            else:  # streamed: each layer is loaded as soon as the trainer staged it, while it stages the next
                with client.stream(version, check=False) as stream:
                    for name, tensor in full.items():
                        stream.stage(name, tensor)
                outcomes = [stream.outcome]
            assert all(getattr(o, "ok", False) for o in outcomes), [str(o) for o in outcomes]
            assert engine.weight_version() == str(version)
            [loader] = AgentClient(group.agents[0].url, token=group.token).state()["sources"]["engineReplicas"]["0"]
            assert "(sglang rank 0)" in loader["loader"]
            assert loader["loaded"] is False  # the version is committed: the next one loads again
            # SGLang's loader took the feed a decoder layer at a time (its engine checked that this leaves the same
            # bytes) and the feed gave each layer's memory back: between rounds it holds next to nothing.
            assert loader["layerGroups"] == len(manifest.replica.layer_groups) > 2
            assert loader["feedHeldBytes"] < feed_bytes // 4, (loader["feedHeldBytes"], feed_bytes)
            # The first round proves the engine re-derives MLA's w_kc/w_vc; the second the reload, streamed.
            assert_generates_like_hf(engine, sglang_py, tiny_deepseek_v3, full, version, tmp_path)
    assert "layer groups)" in group.agents[0].log_text()
    # The CPU server attended in SGLang's absorbed MLA form (a gated workaround: docs/engines/sglang-testing.md).
    server = harness.servers[0]
    assert sglang_cpu.ABSORBED_MLA in server.workarounds
    used = {e["workaround"] for e in server.workaround_events() if e["event"] == "used"}
    assert sglang_cpu.ABSORBED_MLA in used


#: The semantic gate's canary prompt (the tiny model's vocabulary is 512), and the largest logprob difference a true
#: sync shows between SGLang on CPU (float32, absorbed MLA) and HF's eager forward (measured: docs/agent.md).
CANARY_IDS = [1, 17, 42, 99, 250, 7, 3, 300, 12, 5, 480, 64, 33, 2, 411, 128]
CANARY_TOLERANCE = 1e-3


def trainer_canary(sglang_py: Path, model: Path, weights: dict[str, Any], scratch: Path) -> Canary:
    """The canary a trainer holding ``weights`` publishes: its own forward's logprobs (HF ``transformers`` here)."""
    logprobs = hf_prompt_logprobs(sglang_py, with_weights(model, weights, scratch), CANARY_IDS)
    return Canary.model_validate({"inputIds": CANARY_IDS, "logprobs": logprobs, "tolerance": CANARY_TOLERANCE})


def test_the_semantic_gate_passes_true_syncs_and_catches_what_byte_verification_cannot(
    group: LoopbackGroup,
    harness: SglangEngines,
    sglang_py: Path,
    tiny_deepseek_v3: Path,
    skip_post_load: Path,
    tmp_path: Path,
) -> None:
    """Rank 0 publishes each version with a canary scored by its own forward; SGLang scores it after its end of
    session and before the label. Two faults whose bytes verify: the trainer staged one layer of the previous
    version (a skipped layer), and SGLang's end of session skipped ``post_load_weights`` (MLA's ``w_kc``/``w_vc``
    stale). Each fails the round at the gate, unlabelled and paused; the next true sync passes and serves."""
    engine = group.engines[0].client(timeout=60)

    def publish(version: int, staged: dict[str, Any], truth: dict[str, Any]) -> RoundResult:
        canary = trainer_canary(sglang_py, tiny_deepseek_v3, truth, tmp_path / f"v{version}")
        with group.clients() as clients:
            [outcome] = publish_all(clients, staged, version, canary=canary)
        assert isinstance(outcome, RoundOutcome), outcome
        return outcome.round

    previous = trained_state(tiny_deepseek_v3, 3)
    passed = publish(3, previous, previous)
    assert passed.result == "Succeeded", passed.reason
    assert engine.weight_version() == "3" and passed.phases["gate"] > 0
    print(f"\ngate: {passed.phases['gate']:.3f} s of a {passed.duration_seconds:.3f} s round")

    truth = trained_state(tiny_deepseek_v3, 4)
    skipped = {n: previous[n] if n.startswith("model.layers.1.") else t for n, t in truth.items()}
    failed = publish(4, skipped, truth)
    assert failed.result == "Failed" and not failed.committed and failed.engines_paused
    assert "the semantic gate failed for version 4: engine 0: token" in (failed.reason or ""), failed.reason
    assert engine.weight_version() == "3"  # the bytes verified; the label did not move

    skip_post_load.touch()
    try:
        truth = trained_state(tiny_deepseek_v3, 5)
        stale = publish(5, truth, truth)
    finally:
        skip_post_load.unlink()
    assert stale.result == "Failed" and "the semantic gate failed for version 5" in (stale.reason or ""), stale.reason
    assert engine.weight_version() == "3"
    fired = [e for e in harness.servers[0].workaround_events() if e["workaround"] == sglang_cpu.SKIP_POST_LOAD]
    assert [e["event"] for e in fired] == ["applied", "used"]  # armed at start, fired in version 5's session only

    truth = trained_state(tiny_deepseek_v3, 6)
    repaired = publish(6, truth, truth)
    assert repaired.result == "Succeeded", repaired.reason
    assert engine.weight_version() == "6" and engine.health(30)  # serving again, labelled


@pytest.fixture(scope="module")
def fp8_group(
    sglang_py: Path, tiny_deepseek_v3: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LoopbackGroup]:
    """The same model served as an FP8 block checkpoint. SGLang on a CPU without AMX loads and post-processes FP8
    weights but has no kernel to compute with them (its FP8 GEMM is Triton's, which needs a GPU driver): the server
    never runs a forward here (no warm-up, ready without /health), and rounds need none."""
    fp8 = ensure_fp8_model(tiny_deepseek_v3)
    logs = tmp_path_factory.mktemp("sglang-dsv3-fp8")
    engines = SglangEngines(fp8, python=str(sglang_py), dtype="bfloat16", log_dir=logs, no_forward=True)
    with replica_group(sglang_py, engines, spec(1, trainers=1, timeout=120), "sg-dsv3-fp8") as running:
        yield running


def test_bf16_trainer_tensors_sync_into_an_fp8_block_target_quantized_on_the_source(
    fp8_group: LoopbackGroup, tiny_deepseek_v3: Path
) -> None:
    """A BF16 trainer stages its tensors; the source quantizes them as the target's checkpoint stores them (FP8 e4m3
    weights, float32 ``weight_scale_inv`` per block) into the engine replica's feed, SGLang's loader fuses them, and
    the round lands: SGLang's own /weights_checker verified every FP8 weight and scale before the commit."""
    manifest = fp8_group.manifest(0)
    assert manifest.replica is not None
    quantized = {f.name: f for f in manifest.replica.feeds if f.quantize == "fp8-block"}
    assert (
        quantized["model.layers.1.self_attn.o_proj.weight"].scale == "model.layers.1.self_attn.o_proj.weight_scale_inv"
    )
    assert "model.embed_tokens.weight" not in quantized and "model.layers.1.mlp.gate.weight" not in quantized
    by_name = manifest.by_name()
    assert by_name["model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight"].dtype == "float8_e4m3fn"
    assert by_name["model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight_scale_inv"].dtype == "float32"
    # The KV-cache scales no checkpoint writes stay SGLang's own, as in its own load.
    assert "model.layers.0.self_attn.attn_mqa.k_scale" in manifest.replica.kept
    engine = fp8_group.engines[0].client(timeout=60)
    with fp8_group.clients() as clients:
        for version in (1, 2):
            bf16 = {name: t.to(torch.bfloat16) for name, t in trained_state(tiny_deepseek_v3, version).items()}
            outcomes = publish_all(clients, bf16, version)
            reasons = [getattr(getattr(o, "round", None), "reason", str(o)) for o in outcomes]
            assert all(getattr(o, "ok", False) for o in outcomes), reasons
            assert engine.weight_version() == str(version)
    # Independently of the round's own verification: what SGLang holds is weightsync's quantization of the trainer's
    # last tensors. SGLang's checker hashes an FP8 weight with its scale, dequantized to bfloat16 (the scale gets no
    # checksum of its own); this weight is one SGLang's end of session leaves as loaded.
    _, answer = engine.request("POST", "/weights_checker", body={"action": "checksum"}, timeout=60)
    held = answer["ranks"][0]["checksums"]
    name = "model.layers.1.self_attn.o_proj.weight"
    weight, scale = fp8_block(bf16[name], (16, 16))
    assert held[name] == sglang_cpu_hash(dequantized_bytes(weight, scale))
    assert f"{name}_scale_inv" not in held
