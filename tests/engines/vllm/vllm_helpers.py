"""Shared pieces of the stock-vLLM tier: starting the server as the tier runs it, completions, checkpoint bytes."""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from weightsync_testing.vllm_server import VllmProcess, launch_vllm

API_KEY = "weightsync-test-group-token"
# The tiny models' linear layers, fused as vLLM serves them (qkv_proj = q|k|v, gate_up_proj = gate|up).
LINEAR = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight")


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


def safetensors_bytes(model: Path) -> dict[str, bytes]:
    """Raw bytes of every tensor in ``model.safetensors`` (the format: u64 header size, JSON header, data)."""
    data = (model / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    base = 8 + size
    return {
        name: data[base + meta["data_offsets"][0] : base + meta["data_offsets"][1]]
        for name, meta in header.items()
        if name != "__metadata__"
    }
