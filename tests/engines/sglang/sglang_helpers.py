"""Shared checks for the stock-SGLang tier: expected per-rank parameter sizes, safetensors bytes, hashes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_agent.engine_python import ENV_ENGINE_PYTHON
from weightsync_agent.targets.engine_client import EngineClient
from weightsync_testing.engine_harness import SglangEngines
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.sglang_models import hf_greedy, with_weights
from weightsync_testing.sglang_server import SglangProcess, launch_sglang

GREEDY = {"temperature": 0.0, "ignore_eos": True}
ADMIN_KEY = "weightsync-test-admin"


def start(python: Path, model: Path, log_dir: Path, *, tp: int) -> SglangProcess:
    """A stock SGLang server as the tier runs it: CPU, float32 (as the checkpoint), an admin key."""
    server = launch_sglang(model, tp=tp, python=python, dtype="float32", admin_api_key=ADMIN_KEY, log_dir=log_dir)
    print(f"\nSGLang TP={tp} ready in {server.started_s:.1f} s ({server.log_path})", file=sys.stderr)
    return server


def config(model: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((model / "config.json").read_text())
    return loaded


def expected_numels(model: Path, tp: int) -> dict[str, int]:
    """SGLang's fused parameter names and their per-rank element counts for the tiny Llama/Qwen3 at ``tp``."""
    c = config(model)
    hidden, inter, heads, kv, head_dim = (
        c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
    )  # fmt: skip
    vocab = c["vocab_size"]
    numels = {"model.embed_tokens.weight": vocab // tp * hidden, "model.norm.weight": hidden}
    numels["lm_head.weight"] = vocab // tp * hidden
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        numels[p + "self_attn.qkv_proj.weight"] = (heads + 2 * kv) * head_dim // tp * hidden
        numels[p + "self_attn.o_proj.weight"] = hidden * heads * head_dim // tp
        numels[p + "mlp.gate_up_proj.weight"] = 2 * inter // tp * hidden
        numels[p + "mlp.down_proj.weight"] = hidden * inter // tp
        numels[p + "input_layernorm.weight"] = hidden
        numels[p + "post_attention_layernorm.weight"] = hidden
        if c["model_type"] == "qwen3":
            numels[p + "self_attn.q_norm.weight"] = head_dim
            numels[p + "self_attn.k_norm.weight"] = head_dim
    return numels


def cpu_tensor_hash(raw: bytes) -> str:
    """SGLang's ``tensor_hash`` for a CPU tensor, as ``/weights_checker`` reports it: sha256, first 8 bytes."""
    return hashlib.sha256(raw).hexdigest()[:16]


def per_gpu_checksum(checksums: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name in sorted(checksums):
        digest.update(name.encode())
        digest.update(checksums[name].encode())
    return digest.hexdigest()


def transfer_info(server: SglangProcess, rank: int) -> tuple[str, dict[str, list[int]]]:
    status, body = server.request("GET", f"/remote_instance_transfer_engine_info?rank={rank}")
    assert status == 200, body
    assert body["rank"] == rank
    session, weights = body["remote_instance_transfer_engine_info"]
    return session, weights


def generate(server: SglangProcess, prompts: list[list[int]], max_new_tokens: int) -> list[dict[str, Any]]:
    body = {"input_ids": prompts, "sampling_params": {**GREEDY, "max_new_tokens": max_new_tokens}}
    status, answer = server.request("POST", "/generate", body, admin=False)
    assert status == 200, answer
    assert isinstance(answer, list) and len(answer) == len(prompts)
    return answer


#: Prompts (token ids) and length of the greedy generations the round tests compare with an HF forward.
ROUND_PROMPTS = [[1, 17, 42, 99, 250, 7], [3, 300, 12, 5]]
ROUND_TOKENS = 8


def engine_generate(engine: EngineClient, prompt: list[int]) -> tuple[list[int], str]:
    """Greedy tokens of ``prompt`` (:data:`ROUND_TOKENS` of them) and the weight version the engine labels them with."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": ROUND_TOKENS, "temperature": 0.0}}
    _, answer = engine.request("POST", "/generate", body=body, timeout=60)
    return [int(i) for i in answer["output_ids"]], str(answer["meta_info"]["weight_version"])


def assert_generates_like_hf(
    engine: EngineClient, python: Path, model_dir: Path, weights: dict[str, Any], version: int, scratch: Path
) -> None:
    """The engine, labelled ``version``, decodes :data:`ROUND_PROMPTS` greedily as HF ``transformers`` does with
    ``weights`` in ``model_dir``'s architecture (the reference runs in the engine's venv)."""
    reference = hf_greedy(python, with_weights(model_dir, weights, scratch / f"v{version}"), ROUND_PROMPTS,
                          ROUND_TOKENS)  # fmt: skip
    for prompt, expected in zip(ROUND_PROMPTS, reference, strict=True):
        tokens, label = engine_generate(engine, prompt)
        assert label == str(version)
        assert tokens == expected["output_ids"], (prompt, expected.get("margins"))


@contextlib.contextmanager
def replica_group(
    sglang_py: Path, harness: SglangEngines, spec: WeightSyncGroupSpec, name: str, *, timeout: float = 300
) -> Iterator[LoopbackGroup]:
    """A started loopback group into ``harness``'s servers whose trainer pod's agent runs SGLang's own loader (the
    engine replicas': ``WEIGHTSYNC_ENGINE_PYTHON`` is SGLang's, as in a trainer pod built on the engine's image)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV_ENGINE_PYTHON, str(sglang_py))
        with LoopbackGroup(spec, group=name, engines=harness) as running:
            running.start(timeout=timeout)
            yield running
