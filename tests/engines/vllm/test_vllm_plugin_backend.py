"""A third-party WeightTransferEngine inside the stock vLLM server, driven over its RL routes: what the weightsync
backend plugin (issue 13, not built yet) will rely on, checked with a test-only plugin (``probe_plugin/``) that
reads the new weights from a safetensors file instead of receiving them over Mooncake.

One round (init -> pause -> start -> update -> finish with a version -> resume) replaces every weight of the served
tiny Llama with another seed's: greedy tokens then equal HF on the new checkpoint (so the linear layers, which vLLM
repacks on CPU, took the new weights through vLLM's layerwise reload), the non-linear parameters' checksums equal
the new checkpoint's bytes, and the version is the one finish carried.

The same server runs the plugin's ``--middleware`` (``weightsync_engine.vllm.guard.BearerGuard``) that requires the
group's token on every path but ``/health``: vLLM's stock hook closes what its ``--api-key`` leaves open.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from checkpoints import safetensors_bytes
from vllm_helpers import API_KEY, LINEAR, apply_round, assert_nonlinear_checksums, complete, ok

from weightsync_testing.engine_harness import engine_root_dir
from weightsync_testing.server_process import retire
from weightsync_testing.sglang_models import ensure_tiny_model, hf_greedy
from weightsync_testing.vllm_server import VllmProcess, launch_vllm

PLUGIN_DIR = Path(__file__).resolve().parent / "probe_plugin"
ENGINE_DIR = engine_root_dir()  # weightsync_engine.vllm.guard, as the plugin ships it
BACKEND = "weightsync-probe"
PROMPTS = [[1, 5, 9, 100, 200], [1, 300, 301, 302]]
NEW_TOKENS = 10
SERVING_KEY = "rollout-clients-serving-key"


@pytest.fixture(scope="module")
def probe_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-probe") / "probe.jsonl"


@pytest.fixture(scope="module")
def probe_server(
    vllm_py: Path, tiny_llama32: Path, probe_log: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmProcess]:
    server = launch_vllm(
        tiny_llama32,
        python=vllm_py,
        api_key=API_KEY,
        weight_transfer_backend=BACKEND,
        pythonpath=[PLUGIN_DIR, ENGINE_DIR],
        extra_env={
            "WEIGHTSYNC_VLLM_PROBE_LOG": str(probe_log),
            "WEIGHTSYNC_GROUP_TOKEN": API_KEY,
            "WEIGHTSYNC_SERVING_TOKEN": SERVING_KEY,
        },
        extra_args=["--middleware", "weightsync_engine.vllm.guard.BearerGuard"],
        log_dir=tmp_path_factory.mktemp("vllm-plugin"),
    )
    print(f"\nvLLM with {BACKEND} ready in {server.started_s:.1f} s ({server.log_path})", file=sys.stderr)
    try:
        yield server
    finally:
        retire(server.stop)


def events(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def test_a_plugin_backend_round_replaces_the_served_weights(
    probe_server: VllmProcess, probe_log: Path, vllm_py: Path, tiny_llama32: Path
) -> None:
    new = ensure_tiny_model(vllm_py, "llama", seed=1, dtype="float32", head_dim=32)
    old_tokens = [complete(probe_server, p, NEW_TOKENS)["choices"][0]["token_ids"] for p in PROMPTS]
    expected_old, expected_new = (hf_greedy(vllm_py, m, PROMPTS, NEW_TOKENS) for m in (tiny_llama32, new))
    assert old_tokens == [e["output_ids"] for e in expected_old]
    # The check below means something only if the two checkpoints generate differently.
    assert [e["output_ids"] for e in expected_old] != [e["output_ids"] for e in expected_new]

    assert ok(probe_server, "POST", "/init_weight_transfer_engine", {"init_info": {"tag": "t1"}}) == {
        "message": "Weight transfer initialized"
    }
    apply_round(probe_server, {"path": str(new / "model.safetensors")}, "seed-1")

    assert ok(probe_server, "GET", "/weight_info") == {"weight_version": "seed-1"}
    served = [complete(probe_server, p, NEW_TOKENS)["choices"][0]["token_ids"] for p in PROMPTS]
    assert served == [e["output_ids"] for e in expected_new]
    assert min(min(e["margins"]) for e in expected_new) > 1e-3
    checksums = assert_nonlinear_checksums(probe_server, safetensors_bytes(new))
    assert sum(key.endswith(LINEAR) for key in checksums) == 8

    seen = events(probe_log)
    # vLLM loads general plugins in every process (3 seen at TP=1 on CPU: API server, engine core, worker); the
    # round runs in one of them, the worker that holds the model.
    registered = {e["pid"] for e in seen if e["event"] == "register"}
    assert len(registered) >= 2, seen
    round_events = [e for e in seen if e["event"] != "register"]
    assert [e["event"] for e in round_events] == ["init", "start", "receive", "finish"], seen
    assert len({e["pid"] for e in round_events}) == 1 and round_events[0]["pid"] in registered
    [receive] = [e for e in seen if e["event"] == "receive"]
    assert receive["names"] == len(safetensors_bytes(new))


def test_a_stock_middleware_guards_the_rl_routes(probe_server: VllmProcess) -> None:
    unauthorized = (401, {"error": "Unauthorized"})
    for method, path, body in [
        ("GET", "/is_paused", None),
        ("POST", "/pause?mode=wait", None),
        ("POST", "/resume", None),
        ("GET", "/weight_info", None),
        ("POST", "/weight_checker", {"action": "reset"}),  # would zero every weight if it went through
        ("POST", "/update_weight_version", {"new_version": "forged"}),
        ("POST", "/init_weight_transfer_engine", {"init_info": {}}),
        ("POST", "/collective_rpc", {"method": "reset_weights"}),
        ("GET", "/v1/models", None),
    ]:
        assert probe_server.request(method, path, body, auth=False) == unauthorized, path
        assert probe_server.request(method, path, body, api_key="not-the-token") == unauthorized, path
    assert probe_server.request("GET", "/health", auth=False)[0] == 200
    assert probe_server.request("GET", "/is_paused") == (200, {"is_paused": False})
    # The serving-only key generates (vLLM's own key, the group token here, is checked after the guard) and opens
    # no weight route: rollout clients need not hold the group's credential.
    for method, path, body in [
        ("POST", "/pause?mode=wait", None),
        ("POST", "/weight_checker", {"action": "reset"}),
        ("POST", "/update_weight_version", {"new_version": "forged"}),
        ("POST", "/collective_rpc", {"method": "reset_weights"}),
        ("GET", "/weight_info", None),
    ]:
        assert probe_server.request(method, path, body, api_key=SERVING_KEY) == unauthorized, path
    status, models = probe_server.request("GET", "/v1/models", api_key=SERVING_KEY)
    assert status == 200 and models["data"], models
    status, completion = probe_server.request("POST", "/v1/completions", {"model": models["data"][0]["id"],
                                              "prompt": [1, 5, 9], "max_tokens": 2}, api_key=SERVING_KEY)  # fmt: skip
    assert status == 200 and completion["choices"], completion
    status, info = probe_server.request("GET", "/weight_info")
    assert status == 200 and info["weight_version"] != "forged"
