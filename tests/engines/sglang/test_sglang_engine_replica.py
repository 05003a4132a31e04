"""Live rounds into the STOCK SGLang server serving a DeepSeek-V3-shaped model (Kimi-K2's architecture, tiny), synced
through an engine replica: SGLang's own model class on the source, filled by its own ``load_weights``.

The trace refuses this model (MLA's ``fused_qkv_a_proj_with_mqa`` is ``q_a_proj`` and ``kv_a_proj_with_mqa`` fused on
load, and ``w_kc``/``w_vc`` are derived from ``kv_b_proj`` after it), so the engine's agent publishes an
engine-replica manifest; the source's agent runs SGLang's loader over what the trainer staged and writes the result
into SGLang's live weights over Mooncake. Checked: the manifest's path per parameter, SGLang's own
``/weights_checker`` (the round's verification), the version, and greedy generation against an HF ``transformers``
forward of the trainer's weights (which is right only if SGLang's end of session re-derived ``w_kc``/``w_vc``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_agent.engine_python import ENV_ENGINE_PYTHON
from weightsync_agent.rounds.remote import AgentClient
from weightsync_agent.targets.engine_client import EngineClient
from weightsync_testing import sglang_cpu
from weightsync_testing.engine_harness import SglangEngines
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.sglang_models import hf_greedy, trained_state, with_weights
from weightsync_testing.trainer_ranks import publish_all

pytest.importorskip("safetensors.torch")

TEMPLATE: dict[str, Any] = {"spec": {"containers": [{"name": "main", "image": "x"}]}}
PROMPTS = [[1, 17, 42, 99, 250, 7], [3, 300, 12, 5]]
NEW_TOKENS = 8


def spec() -> WeightSyncGroupSpec:
    return WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": 1, "template": TEMPLATE},
            "inference": {
                "engines": 1,
                "ranksPerEngine": 1,
                "ranksPerPod": 1,
                "adapter": "sglang",
                "template": TEMPLATE,
            },
            "transfer": {"protocol": "tcp", "bucketSizeMiB": 1, "timeoutSeconds": 120},
        }
    )


@pytest.fixture(scope="module")
def harness(sglang_py: Path, tiny_deepseek_v3: Path, tmp_path_factory: pytest.TempPathFactory) -> SglangEngines:
    logs = tmp_path_factory.mktemp("sglang-dsv3")
    return SglangEngines(tiny_deepseek_v3, python=str(sglang_py), dtype="float32", log_dir=logs)


@pytest.fixture(scope="module")
def group(sglang_py: Path, harness: SglangEngines) -> Iterator[LoopbackGroup]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV_ENGINE_PYTHON, str(sglang_py))  # the trainer pod's agent runs SGLang's loader too
        with LoopbackGroup(spec(), group="sg-dsv3", engines=harness) as running:
            running.start(timeout=300)
            yield running


def generate(client: EngineClient, prompt: list[int]) -> tuple[list[int], str]:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}}
    _, answer = client.request("POST", "/generate", body=body, timeout=60)
    return [int(i) for i in answer["output_ids"]], str(answer["meta_info"]["weight_version"])


def test_deepseek_v3_rounds_through_an_engine_replica_verify_and_generate_like_hf(
    group: LoopbackGroup, harness: SglangEngines, sglang_py: Path, tiny_deepseek_v3: Path, tmp_path: Path
) -> None:
    manifest = group.manifest(0)
    assert {t.path for t in manifest.tensors} == {"engine-replica"}
    names = {t.name for t in manifest.tensors}
    assert "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight" in names  # the loader's fused pair
    assert manifest.replica is not None and manifest.replica.engine == "sglang"
    assert {f.name for f in manifest.replica.feeds} >= {"model.layers.0.self_attn.q_a_proj.weight"}
    engine = group.engines[0].client(timeout=60)
    with group.clients() as clients:
        for version in (1, 2):
            full = trained_state(tiny_deepseek_v3, version)
            outcomes = publish_all(clients, full, version)
            assert all(getattr(o, "ok", False) for o in outcomes), [str(o) for o in outcomes]
            assert engine.weight_version() == str(version)
            [loader] = AgentClient(group.agents[0].url, token=group.token).state()["sources"]["engineReplicas"]["0"]
            assert "(sglang rank 0)" in loader["loader"]
            assert loader["loaded"] is False  # the version is committed: the next one loads again
            if version == 2:
                continue  # the first round proved the engine re-derives MLA's w_kc/w_vc; this one the reload
            reference = hf_greedy(sglang_py, with_weights(tiny_deepseek_v3, full, tmp_path / f"v{version}"),
                                  PROMPTS, NEW_TOKENS)  # fmt: skip
            for prompt, expected in zip(PROMPTS, reference, strict=True):
                tokens, label = generate(engine, prompt)
                assert label == str(version)
                assert tokens == expected["output_ids"], (prompt, expected.get("margins"))
    # The CPU server attended in SGLang's absorbed MLA form (a gated workaround: docs/engines/sglang-testing.md).
    server = harness.servers[0]
    assert sglang_cpu.ABSORBED_MLA in server.workarounds
    used = {e["workaround"] for e in server.workaround_events() if e["event"] == "used"}
    assert sglang_cpu.ABSORBED_MLA in used
