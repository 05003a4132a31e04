"""Rounds into an FP8 block target from a BF16 trainer, through the agents: ``weightsync agent`` processes, reference
engine processes holding the DeepSeek-V3 / Kimi-K2 checkpoint format (e4m3 linear weights, float32 scales per
128 x 128 tile, fused qkv and gate_up cut over TP 2), Mooncake TCP.

The trainer stages its BF16 tensors only; each source quantizes the tiles its targets' cuts cover. Checked: every
engine rank holds, byte for byte, an independent cut of the quantized checkpoint (staged and streamed), and computes
with it what the trainer's BF16 weights compute, within FP8's error; and the semantic gate's wrong-scale fault (every
scale twice as large, written consistently so every byte verifies) fails the round at the gate, label kept."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest
import torch
from sync_helpers import TOKENS, group_spec, training_step
from sync_helpers import engines_hold as hold

import weightsync_agent.source.replica as replica_module
from weightsync_agent.layout import quantize
from weightsync_agent.rounds.canary import Canary
from weightsync_testing.engine_harness import ReferenceEngines
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.reference_engine.model import ModelConfig, forward_full, full_state
from weightsync_testing.trainer_ranks import publish_all

MODEL = ModelConfig(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=512,
                    dtype="bfloat16", quantization="fp8-block")  # fmt: skip
#: The gate's bound on a canary token's logprob: the true sync's largest gap is 0.125 nats (the test prints it), every
#: scale twice too large 0.79 (this model's norms absorb much of a uniform scale: a larger one is still a fault).
CANARY_TOLERANCE = 0.4


@pytest.fixture(scope="module")
def group() -> Iterator[LoopbackGroup]:
    spec = group_spec(protocol="tcp", bucketSizeMiB=1, timeoutSeconds=20, targetStaging="live")
    fields = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "dtype", "quantization")
    model_args = ("--layers", str(MODEL.num_layers), "--model-config",
                  json.dumps({k: getattr(MODEL, k) for k in fields}))  # fmt: skip
    with LoopbackGroup(spec, group="t-fp8", engines=ReferenceEngines(model_args=model_args)).start() as running:
        yield running


def canary(full: dict[str, torch.Tensor]) -> Canary:
    """The trainer's own BF16 forward's logprob of each canary token (what an engine computing the trainer's weights
    scores within FP8's error)."""
    logprobs = forward_full(full, TOKENS, MODEL).log_softmax(-1)
    said = [float(logprobs[i, token]) for i, token in enumerate(TOKENS[1:])]
    return Canary.model_validate({"inputIds": TOKENS, "logprobs": said, "tolerance": CANARY_TOLERANCE})


def test_bf16_trainer_tensors_land_in_fp8_block_engines_as_the_checkpoint_holds_them(
    group: LoopbackGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    with group.clients() as clients:
        assert set(clients[0].staging_order()) <= set(full_state(0, MODEL)), "the trainer never stages a scale"
        full = training_step(full_state(seed=5, config=MODEL), 1)
        outcomes = publish_all(clients, full, 1, canary=canary(full))
        assert all(getattr(o, "ok", False) for o in outcomes), outcomes
        hold(group, full, 1, MODEL)
        gap = outcomes[0].round.gate_gap  # type: ignore[attr-defined]
        served = torch.tensor(group.engines[0].client().forward(TOKENS)).log_softmax(-1)
        worst = (served - forward_full(full, TOKENS, MODEL).log_softmax(-1)).abs().max().item()
        print(f"\nFP8 target: canary gap {gap:.3f} nats, worst logprob gap {worst:.3f}")  # docs/reference-engine.md
        assert 0 < worst < 0.5, worst  # FP8's error (0.26 measured), not a wrong tile (one layer's scales x2: 3.07)

        nxt = training_step(full, 2)
        streamed: list[object] = [None, None]

        def stream(index: int) -> None:
            with clients[index].stream(2) as open_stream:
                for name in clients[index].staging_order():
                    open_stream.stage(name, nxt[name])
            streamed[index] = open_stream.outcome

        threads = [threading.Thread(target=stream, args=(i,)) for i in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert all(getattr(o, "ok", False) for o in streamed), streamed
        hold(group, nxt, 2, MODEL)

        # A source whose quantizer writes every scale twice as large, consistently: every byte verifies against
        # what it staged, and only the gate sees the engine compute something else.
        def twice_the_scale(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
            quantized, scale_inv = quantize.fp8_block(weight, block)
            return quantized, scale_inv * 2

        third = training_step(nxt, 3)
        with monkeypatch.context() as patched:
            patched.setattr(replica_module, "fp8_block", twice_the_scale)
            [wrong, _] = publish_all(clients, third, 3, canary=canary(third))
        assert not getattr(wrong, "ok", True), wrong
        reason = wrong.round.reason or ""  # type: ignore[attr-defined]
        assert "the semantic gate failed for version 3: engine 0: token" in reason, reason
        assert {"write", "verify", "gate"} <= set(wrong.round.phases)  # type: ignore[attr-defined]
        assert all(engine.client().weight_version() == "2" for engine in group.engines.values())
        outcomes = publish_all(clients, third, 3, canary=canary(third))  # the true quantizer repairs
        assert all(getattr(o, "ok", False) for o in outcomes), outcomes
        hold(group, third, 3, MODEL)
