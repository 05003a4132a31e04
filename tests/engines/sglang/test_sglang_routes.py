"""Every weight-update route of stock SGLang 0.5.23 answers as the stock-engines note (§1.2, §5b) describes,
on the session's TP=1 server (tiny Llama, float32, admin key set)."""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from checkpoints import safetensors_bytes
from sglang_helpers import GREEDY, cpu_tensor_hash, expected_numels, generate, per_gpu_checksum, transfer_info

from weightsync_testing.sglang_server import SglangProcess

PROMPT = [1, 17, 42, 300, 7]
NEW_TOKENS = 500  # ~0.8 s at ~600 tokens/s: still running when the pause lands on a loaded machine (128 was not); the
# tiny model holds 512 positions


def test_transfer_engine_info_publishes_every_parameter(server: SglangProcess, tiny_llama: Path) -> None:
    session, weights = transfer_info(server, 0)
    host, port = session.rsplit(":", 1)
    assert host and int(port) > 0
    assert {name: numel for name, (_ptr, numel, _size) in weights.items()} == expected_numels(tiny_llama, 1)
    assert {size for _ptr, _numel, size in weights.values()} == {4}  # float32
    spans = sorted((ptr, ptr + numel * size) for ptr, numel, size in weights.values())
    assert all(start > 0 for start, _end in spans)
    assert all(end <= nxt for (_s, end), (nxt, _e) in itertools.pairwise(spans)), "overlapping weights"


def test_transfer_engine_info_refuses_bad_ranks(server: SglangProcess) -> None:
    status, body = server.request("GET", "/remote_instance_transfer_engine_info?rank=1")
    assert status == 400
    assert body["error"]["message"] == "Failed to get transfer engine info for rank 1"
    for query in ("", "?rank=-1"):
        status, body = server.request("GET", f"/remote_instance_transfer_engine_info{query}")
        assert status == 400
        assert body["error"]["message"] == "Missing or invalid rank parameter"


def test_control_routes_need_the_admin_key(server: SglangProcess) -> None:
    for method, path in [
        ("POST", "/pause_generation"),
        ("POST", "/begin_weight_update"),
        ("POST", "/update_weight_version"),
        ("GET", "/remote_instance_transfer_engine_info?rank=0"),
    ]:
        status, _ = server.request(method, path, {} if method == "POST" else None, admin=False)
        assert status == 401, path
    status, body = server.request("GET", "/model_info", admin=False)
    assert status == 200 and "weight_version" in body


def _stream(server: SglangProcess, body: dict[str, Any], first_chunk: threading.Event, out: list[Any]) -> None:
    request = urllib.request.Request(
        server.url + "/generate",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        for raw in answer:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            out.append(json.loads(line[len("data:") :]))
            first_chunk.set()
    first_chunk.set()


def test_pause_retract_holds_running_requests_until_continue(server: SglangProcess) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": NEW_TOKENS}}
    [reference] = generate(server, [PROMPT], NEW_TOKENS)
    first_chunk, chunks = threading.Event(), list[Any]()
    streamer = threading.Thread(target=_stream, args=(server, body, first_chunk, chunks), daemon=True)
    streamer.start()
    assert first_chunk.wait(60), "no streamed token"
    status, answer = server.request("POST", "/pause_generation", {"mode": "retract"})
    try:
        assert (status, answer) == (200, {"message": "Generation paused successfully.", "status": "ok"})
        assert streamer.is_alive(), "the request finished before the pause; raise max_new_tokens"
        # The retracted request waits in the queue, so a flush cannot find the engine idle.
        status, answer = server.request("GET", "/flush_cache?timeout=0.5")
        assert status == 400, answer
        count = len(chunks)
        time.sleep(0.5)
        assert len(chunks) == count, "tokens were generated while paused"
    finally:
        status, answer = server.request("POST", "/continue_generation", {})
    assert (status, answer) == (200, {"message": "Generation continued successfully.", "status": "ok"})
    streamer.join(120)
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert final["meta_info"]["completion_tokens"] == NEW_TOKENS
    assert final["meta_info"]["num_retractions"] >= 1
    # Recomputed after the retraction, greedy decoding ends where an uninterrupted run does.
    assert final["output_ids"] == reference["output_ids"]
    assert final["text"] == reference["text"]


def test_flush_cache_when_idle(server: SglangProcess) -> None:
    status, answer = server.request("GET", "/flush_cache")
    assert status == 200 and isinstance(answer, str) and answer.startswith("Cache flushed")
    status, answer = server.request("POST", "/flush_cache?timeout=1")
    assert status == 200 and answer.startswith("Cache flushed")


def test_begin_and_end_weight_update(server: SglangProcess) -> None:
    status, answer = server.request("POST", "/begin_weight_update", {"selector": "all"})
    assert (status, answer["success"]) == (200, True), answer
    try:
        status, answer = server.request("POST", "/begin_weight_update", {})
        assert status == 400
        assert answer == {
            "success": False,
            "message": "a weight-update session is already open; call end_weight_update() first",
        }
    finally:
        status, answer = server.request("POST", "/end_weight_update", {})
    assert (status, answer["success"]) == (200, True), answer
    status, answer = server.request("POST", "/end_weight_update", {})
    assert status == 400
    assert answer == {"success": False, "message": "no weight-update session is open; call begin_weight_update() first"}


def test_update_weight_version_relabels_model_info_and_generate(server: SglangProcess) -> None:
    status, before = server.request("GET", "/model_info")
    assert status == 200
    try:
        status, answer = server.request(
            "POST", "/update_weight_version", {"new_version": "ws-test-7", "abort_all_requests": False}
        )
        assert status == 200
        assert answer == {"success": True, "message": "Weight version updated to ws-test-7", "new_version": "ws-test-7"}
        assert server.request("GET", "/model_info")[1]["weight_version"] == "ws-test-7"
        [answer] = generate(server, [PROMPT], 2)
        assert answer["meta_info"]["weight_version"] == "ws-test-7"
    finally:
        restore = {"new_version": before["weight_version"], "abort_all_requests": False}
        assert server.request("POST", "/update_weight_version", restore)[0] == 200


def test_old_version_routes_are_gone(server: SglangProcess) -> None:
    for path in ("/weight_version", "/get_weight_version"):
        assert server.request("GET", path)[0] == 404, path


def test_weights_checker_checksums(server: SglangProcess, tiny_llama: Path) -> None:
    status, answer = server.request("POST", "/weights_checker", {"action": "checksum"})
    assert status == 200 and answer["success"] is True, answer
    [rank] = answer["ranks"]
    checksums = rank["checksums"]
    _session, weights = transfer_info(server, 0)
    assert set(checksums) == set(weights)  # every parameter, fused names; no buffers in this model
    assert all(len(value) == 16 and int(value, 16) >= 0 for value in checksums.values())
    # On CPU a tensor's checksum is sha256(bytes)[:8]: unfused tensors equal the checkpoint's bytes.
    tensors = safetensors_bytes(tiny_llama)
    unfused = [name for name in checksums if name in tensors]
    assert len(unfused) == 11  # embed, lm_head, final norm; per layer o_proj, down_proj and two norms
    assert {n: checksums[n] for n in unfused} == {n: cpu_tensor_hash(tensors[n]) for n in unfused}
    # Fused parameters hold their parts' rows one after another: q ‖ k ‖ v and gate ‖ up.
    for layer in (0, 1):
        p = f"model.layers.{layer}."
        qkv = b"".join(tensors[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
        gate_up = tensors[p + "mlp.gate_proj.weight"] + tensors[p + "mlp.up_proj.weight"]
        assert checksums[p + "self_attn.qkv_proj.weight"] == cpu_tensor_hash(qkv)
        assert checksums[p + "mlp.gate_up_proj.weight"] == cpu_tensor_hash(gate_up)
    assert rank["per_gpu_checksum"] == per_gpu_checksum(checksums)
    assert answer["per_engine_checksum"] == hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()
    [info] = rank["parallelism_info"]
    assert (info["role"], info["tp_rank"], info["tp_size"]) == ("target", 0, 1)
