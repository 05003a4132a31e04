"""weightsync's own vLLM backend (``engine/weightsync_engine/vllm``) inside the stock vLLM server: a round's bytes
arrive over Mooncake TCP from another process, straight into the worker's receive buffer, and vLLM applies them.

The plugin is found the way an installed distribution's would be: a ``vllm.general_plugins`` entry point (a
dist-info on the server's ``PYTHONPATH`` declaring ``weightsync_engine.vllm.plugin:register``, what this project's
``pyproject.toml`` declares). The test plays the sources and the engine pod's agent: it writes a second
checkpoint's tensors over Mooncake into the addresses the plugin published, checks the landed bytes through the
buffer's file (as the agent verifies before applying), then drives pause -> start -> update -> finish(version) ->
resume. Greedy tokens then equal HF's on the new checkpoint (the linear layers, repacked by the CPU build, took
the new weights through vLLM's layerwise reload), the non-linear parameters' sha256 equal the new checkpoint's,
and the version is the one finish carried.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from checkpoints import safetensors_bytes
from safetensors.torch import load_file
from vllm_helpers import API_KEY, apply_round, assert_nonlinear_checksums, complete, ok

from weightsync_agent.targets.adapter import AdapterSettings
from weightsync_agent.targets.engine_trace import ENV_ENGINE_PYTHON
from weightsync_agent.targets.registry import make_adapter
from weightsync_agent.targets.vllm.adapter import ENV_RECEIVE_DIR
from weightsync_agent.targets.vllm.live_adapter import VllmLiveAdapter
from weightsync_agent.transport.base import TransferState
from weightsync_agent.transport.mooncake import MooncakeTransport
from weightsync_testing.engine_harness import engine_root_dir
from weightsync_testing.server_process import retire
from weightsync_testing.sglang_models import ensure_tiny_model, hf_greedy
from weightsync_testing.vllm_server import VllmProcess, launch_vllm

ENGINE_DIR = engine_root_dir()
PROMPTS = [[1, 5, 9, 100, 200], [1, 300, 301, 302]]
NEW_TOKENS = 10
TAG = "dp0-pp0-tp0"


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dist-info declaring the plugin's entry point, as ``pip install weightsync`` into the vLLM image makes."""
    site = tmp_path_factory.mktemp("weightsync-vllm-plugin")
    info = site / "weightsync_vllm_plugin-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: weightsync-vllm-plugin\nVersion: 0.0.0\n")
    entry_points = "[vllm.general_plugins]\nweightsync = weightsync_engine.vllm.plugin:register\n"
    (info / "entry_points.txt").write_text(entry_points)
    return site


@pytest.fixture(scope="module")
def server(
    vllm_py: Path, tiny_llama32: Path, plugin_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmProcess]:
    process = launch_vllm(
        tiny_llama32,
        python=vllm_py,
        api_key=API_KEY,
        weight_transfer_backend="weightsync",
        pythonpath=[plugin_path, ENGINE_DIR],
        log_dir=tmp_path_factory.mktemp("vllm-weightsync"),
    )
    print(f"\nvLLM with the weightsync backend ready in {process.started_s:.1f} s ({process.log_path})",
          file=sys.stderr)  # fmt: skip
    try:
        yield process
    finally:
        retire(process.stop)


def test_a_round_over_mooncake_replaces_the_served_weights(
    server: VllmProcess, vllm_py: Path, tiny_llama32: Path, tmp_path: Path
) -> None:
    new = ensure_tiny_model(vllm_py, "llama", seed=1, dtype="float32", head_dim=32)
    expected_old, expected_new = (hf_greedy(vllm_py, m, PROMPTS, NEW_TOKENS) for m in (tiny_llama32, new))
    assert [complete(server, p, NEW_TOKENS)["choices"][0]["token_ids"] for p in PROMPTS] == [
        e["output_ids"] for e in expected_old
    ]
    assert [e["output_ids"] for e in expected_old] != [e["output_ids"] for e in expected_new]

    receive = tmp_path / "receive"
    receive.mkdir()
    answer = ok(server, "POST", "/init_weight_transfer_engine", {"init_info": {"directory": str(receive)}})
    assert answer == {"message": "Weight transfer initialized"}
    layout = json.loads((receive / f"{TAG}.json").read_text())
    tensors = load_file(str(new / "model.safetensors"))
    slots = {slot["name"]: slot for slot in layout["tensors"]}
    assert sorted(slots) == sorted(tensors), "the buffer holds every checkpoint tensor, nothing else"

    # The sources: one packed staging region, written into the worker's buffer over Mooncake TCP.
    staged = torch.zeros(layout["nbytes"], dtype=torch.uint8)
    for name, tensor in tensors.items():
        slot = slots[name]
        assert slot["dtype"] == "float32" and tuple(slot["shape"]) == tuple(tensor.shape)
        staged[slot["offset"] : slot["offset"] + slot["nbytes"]] = tensor.contiguous().view(torch.uint8).flatten()
    with MooncakeTransport() as transport:
        transport.register(staged.data_ptr(), staged.numel())
        transfer = transport.submit_write(layout["session_id"], staged.data_ptr(), layout["address"], staged.numel())
        deadline = time.monotonic() + 60
        while transfer.poll() is TransferState.PENDING and time.monotonic() < deadline:
            time.sleep(0.01)
        assert transfer.poll() is TransferState.DONE, transfer.error()
    # The engine pod's agent: what landed is what was sent, read through the buffer's file.
    landed = Path(layout["path"]).read_bytes()
    assert hashlib.sha256(landed).digest() == hashlib.sha256(staged.numpy().tobytes()).digest()

    apply_round(server, {}, "v1")

    assert ok(server, "GET", "/weight_info") == {"weight_version": "v1"}
    served = [complete(server, p, NEW_TOKENS)["choices"][0]["token_ids"] for p in PROMPTS]
    assert served == [e["output_ids"] for e in expected_new]
    assert min(min(e["margins"]) for e in expected_new) > 1e-3
    assert_nonlinear_checksums(server, safetensors_bytes(new))


def test_the_live_placement_is_refused_on_the_cpu_build_naming_the_repacked_weights(
    server: VllmProcess, vllm_py: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stock vLLM's CPU build repacks its linear weights into oneDNN handles (``layer.weight`` empty): the plugin
    refuses to take writes into the live parameters, names them and says what to use instead, in its answer and in
    the layout it publishes for the request; the live adapter's readiness reports exactly that. (On CUDA they are
    plain tensors: tests/agent/transport/test_vllm_live_cuda.py.)"""
    receive = tmp_path / "receive"
    receive.mkdir()
    init = {"directory": str(receive), "placement": "parameters", "request": "cpu-build"}
    status, answer = server.request("POST", "/init_weight_transfer_engine", {"init_info": init}, timeout=60.0)
    assert status >= 400, answer
    published = json.loads((receive / f"{TAG}.json").read_text())
    assert published["request"] == "cpu-build" and published["placement"] == "parameters", published
    refused = published["refused"]
    assert "cannot be written in place" in refused and "qkv_proj.weight is empty" in refused, refused
    assert "targetStaging: staged" in refused, refused

    monkeypatch.setenv(ENV_RECEIVE_DIR, str(tmp_path / "agent-receive"))
    monkeypatch.setenv(ENV_ENGINE_PYTHON, str(vllm_py))
    settings = AdapterSettings(engine=0, url=server.url, ranks=1, bucket_bytes=1 << 20, mode="p2p", staging="live",
                               engine_side=True, api_key=API_KEY)  # fmt: skip
    adapter = make_adapter("vllm", settings)
    assert isinstance(adapter, VllmLiveAdapter)
    readiness = adapter.readiness()
    assert not readiness.ready and readiness.reason == "ManifestRefused", readiness
    assert "qkv_proj.weight is empty" in readiness.message and "targetStaging: staged" in readiness.message


def test_an_update_naming_a_tensor_the_buffer_lacks_is_refused_and_the_weights_stay(
    server: VllmProcess, tmp_path: Path
) -> None:
    receive = tmp_path / "receive"
    receive.mkdir()
    ok(server, "POST", "/init_weight_transfer_engine", {"init_info": {"directory": str(receive)}})
    before = ok(server, "GET", "/weight_info")
    ok(server, "POST", "/start_weight_update")
    status, answer = server.request(
        "POST", "/update_weights", {"update_info": {"names": ["model.layers.99.nonexistent.weight"]}}, timeout=120.0
    )
    assert status >= 400, answer
    assert "not in the receive buffer" in json.dumps(answer), answer
    assert ok(server, "GET", "/weight_info") == before


def test_init_without_a_directory_is_refused_with_the_reason(server: VllmProcess) -> None:
    status, answer = server.request("POST", "/init_weight_transfer_engine", {"init_info": {}}, timeout=60.0)
    assert status >= 400 and "directory is required" in json.dumps(answer), (status, answer)
