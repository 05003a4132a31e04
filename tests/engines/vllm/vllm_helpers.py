"""Shared pieces of the stock-vLLM tier: starting the server as the tier runs it, completions, checkpoint bytes, a
round over the RL routes and the checks of what the server then holds."""

from __future__ import annotations

import contextlib
import hashlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_testing.engine_harness import VllmEngines
from weightsync_testing.http_gate import GatedEngines
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.vllm_server import VllmProcess, launch_vllm

API_KEY = "weightsync-test-group-token"
#: The test-only plugin that keeps the CPU build's linear weights plain tensors (``plain_linears_plugin/``).
PLAIN_LINEARS_PLUGIN = Path(__file__).resolve().parent / "plain_linears_plugin"
#: How ``/weight_checker`` names TP rank 0's parameters (``dp{d}:pp{p}:pcp{c}:tp{t}:<name>``).
KEY_PREFIX = "dp0:pp0:pcp0:tp0:"
# The tiny models' linear layers, fused as vLLM serves them (qkv_proj = q|k|v, gate_up_proj = gate|up).
LINEAR = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight")


class GatedVllmEngines(GatedEngines, VllmEngines):
    """vLLM engines reached through a :class:`~weightsync_testing.http_gate.Gate` each (the same gate across
    restarts): the fault tests hold a route there."""


@contextlib.contextmanager
def gated_group(harness: GatedVllmEngines, spec: WeightSyncGroupSpec, name: str) -> Iterator[LoopbackGroup]:
    """A started loopback group on ``harness``'s engines; its gates closed on the way out."""
    try:
        with LoopbackGroup(spec, group=name, engines=harness) as running:
            running.start(timeout=300)
            yield running
    finally:
        harness.close_gates()


def gated_harness(group: LoopbackGroup) -> GatedVllmEngines:
    harness = group.harness
    assert isinstance(harness, GatedVllmEngines)
    return harness


def start(python: Path, model: Path, log_dir: Path) -> VllmProcess:
    server = launch_vllm(model, python=python, api_key=API_KEY, log_dir=log_dir)
    print(f"\nvLLM ready in {server.started_s:.1f} s ({server.log_path})", file=sys.stderr)
    return server


def complete(server: VllmProcess, prompt: Sequence[int], max_tokens: int, *, timeout: float = 60.0) -> Any:
    """Greedy ``/v1/completions`` of a token-id prompt (no tokenizer, no BOS added), ignoring EOS."""
    body = {
        "model": server.model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    status, answer = server.request("POST", "/v1/completions", body, timeout=timeout)
    assert status == 200, (status, answer)
    return answer


def ok(server: VllmProcess, method: str, path: str, body: Any = None) -> Any:
    """``server``'s answer to a call that must succeed (200)."""
    status, answer = server.request(method, path, body, timeout=120.0)
    assert status == 200, (path, status, answer)
    return answer


def apply_round(server: VllmProcess, update_info: Mapping[str, Any], version: str) -> None:
    """One update round over vLLM's RL routes, each answering as vLLM 0.32 does: pause (wait), start,
    ``/update_weights`` with ``update_info``, finish with ``version``, resume."""
    assert ok(server, "POST", "/pause?mode=wait") == {"status": "paused"}
    assert ok(server, "POST", "/start_weight_update") == {"message": "Weight update started"}
    assert ok(server, "POST", "/update_weights", {"update_info": dict(update_info)}) == {"message": "Weights updated"}
    assert ok(server, "POST", "/finish_weight_update", {"weight_version": version}) == {
        "message": "Weight update finished"
    }
    assert ok(server, "POST", "/resume") == {"status": "resumed"}


def assert_nonlinear_checksums(server: VllmProcess, expected: Mapping[str, bytes]) -> dict[str, str]:
    """``/weight_checker``'s sha256 of every non-linear parameter equals that of its ``expected`` bytes (the linear
    ones, repacked on CPU, hash as empty: docs/engines/vllm.md); returns every checksum."""
    checksums: dict[str, str] = ok(server, "POST", "/weight_checker", {"action": "checksum"})["checksums"]
    for name, data in expected.items():
        if not name.endswith("_proj.weight"):
            assert checksums[KEY_PREFIX + name] == hashlib.sha256(data).hexdigest(), name
    return checksums
