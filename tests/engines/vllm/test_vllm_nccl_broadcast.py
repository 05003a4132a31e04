"""Broadcast mode into stock vLLM through vLLM's own ``nccl`` weight-transfer backend, against the real server.

The server runs as the example tells users to (``VLLM_SERVER_DEV_MODE=1``, ``--weight-transfer-config
'{"backend": "nccl"}'``, no weightsync code in it). vLLM's NCCL group needs an NVIDIA driver, which this CPU build
has not, so what runs here is everything around the group, for real:

- the manifest: the engine pod's adapter reads model, TP size and dtype from ``/server_info`` and traces vLLM's own
  model code; the sha256 the sender would report for each parameter, cut from the checkpoint, equals
  ``/weight_checker``'s for every parameter vLLM keeps as a plain tensor on CPU (the fused linears are repacked
  out of ``layer.weight`` here and hash as empty: they are checked on GPUs, where they are plain);
- the join's payload reaches vLLM's NCCL init (``nccl_unique_id_b64`` decoded, rank and world accepted), which
  then fails for want of a driver: a clear error naming the route, and the server keeps serving;
- a round whose group is missing: begin opens vLLM's update, the chunk is refused ("not initialized"), the abort
  closes the update, and the engine never reports the round's version.

The group itself (minting, joining as rank 0, the warm-up vLLM's members issue, one broadcast per announced tensor,
a dead member) runs on two GPUs in ``tests/agent/transport/test_nccl_uid_group.py``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from checkpoints import safetensors_bytes
from vllm_helpers import API_KEY, KEY_PREFIX, LINEAR, complete, ok

from weightsync_agent.http.client import HttpCallError
from weightsync_agent.modes.broadcast.checksums import tensor_checksums
from weightsync_agent.targets.adapter import AdapterSettings, FullTensor
from weightsync_agent.targets.engine_trace import ENV_ENGINE_PYTHON
from weightsync_agent.targets.registry import make_adapter
from weightsync_agent.targets.vllm.nccl_adapter import VllmNcclAdapter
from weightsync_agent.transport.nccl_uid_group import mint, rendezvous_of
from weightsync_testing.server_process import retire
from weightsync_testing.vllm_server import VllmProcess, launch_vllm

EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
PROMPT = [1, 5, 9, 100, 200]


@pytest.fixture(scope="module")
def nccl_server(vllm_py: Path, tiny_llama32: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProcess]:
    server = launch_vllm(tiny_llama32, python=vllm_py, api_key=API_KEY, weight_transfer_backend="nccl",
                         log_dir=tmp_path_factory.mktemp("vllm-nccl"))  # fmt: skip
    try:
        yield server
    finally:
        retire(server.stop)


@pytest.fixture
def adapter(nccl_server: VllmProcess, vllm_py: Path, monkeypatch: pytest.MonkeyPatch) -> VllmNcclAdapter:
    monkeypatch.setenv(ENV_ENGINE_PYTHON, str(vllm_py))
    settings = AdapterSettings(engine=0, url=nccl_server.url, ranks=1, bucket_bytes=1 << 20, mode="broadcast",
                               staging="live", engine_side=True, api_key=API_KEY)  # fmt: skip
    made = make_adapter("vllm", settings)
    assert isinstance(made, VllmNcclAdapter)  # the registry's choice for vLLM in broadcast mode
    return made


def _checkpoint(model: Path) -> dict[str, torch.Tensor]:
    """The tiny float32 checkpoint's tensors, shaped as its header says."""
    data = (model / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    raw = safetensors_bytes(model)
    return {n: torch.frombuffer(bytearray(raw[n]), dtype=torch.float32).reshape(m["shape"])
            for n, m in header.items() if n != "__metadata__"}  # fmt: skip


def test_the_traced_manifest_predicts_vllms_own_checksums(adapter: VllmNcclAdapter, nccl_server: VllmProcess,
                                                          tiny_llama32: Path) -> None:  # fmt: skip
    readiness = adapter.readiness()
    assert readiness.ready, readiness
    manifest = adapter.manifest(0)
    assert manifest.checksum == "tensor-sha256" and manifest.session_id == "vllm-nccl-broadcast"
    names = [t.name for t in manifest.tensors]
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.embed_tokens.weight" in names
    full = _checkpoint(tiny_llama32)
    expected = dict(zip(names, tensor_checksums(manifest, full), strict=True))
    held = ok(nccl_server, "POST", "/weight_checker", {"action": "checksum"})["checksums"]
    assert set(held) == {KEY_PREFIX + n for n in names}  # one traced entry per parameter vLLM hashes
    linear = [n for n in names if n.endswith(LINEAR)]
    assert linear and all(held[KEY_PREFIX + n] == EMPTY_SHA256 for n in linear)  # repacked on CPU
    plain = [n for n in names if n not in linear]
    assert plain and all(held[KEY_PREFIX + n] == expected[n] for n in plain), [
        n for n in plain if held[KEY_PREFIX + n] != expected[n]
    ]
    # and a verify of that rank says so: every plain parameter matches, exactly the linear ones do not
    adapter._checked = None
    adapter._open_update = False
    verdict = adapter.verify(0, 1, [expected[n] for n in names], 60.0, round_id="r")
    assert not verdict.ok and sorted(names[i] for i in verdict.mismatched) == sorted(linear)


def test_the_join_reaches_vllms_nccl_init_which_needs_a_driver(adapter: VllmNcclAdapter,
                                                                nccl_server: VllmProcess) -> None:  # fmt: skip
    members = [{"group_rank": 1, "ranks": [0]}]
    with pytest.raises(HttpCallError) as refused:
        adapter.join_broadcast(rendezvous_of(mint()), 2, members, "nccl", 30.0, "weightsync-test")
    assert refused.value.status == 500 and refused.value.route == "/init_weight_transfer_engine"
    log = Path(nccl_server.log_path).read_text(errors="replace")
    assert "NVIDIA driver" in log or "CUDA" in log  # vLLM decoded the id and went as far as the device
    # what is not a unique id, or not one member per TP rank, never reaches vLLM
    with pytest.raises(HttpCallError, match="joins by an NCCL unique id") as local:
        adapter.join_broadcast("tcp://127.0.0.1:1", 2, members, "nccl", 5.0, "weightsync-test")
    assert local.value.status is None
    with pytest.raises(HttpCallError, match="one group rank per TP rank"):
        adapter.join_broadcast(rendezvous_of(mint()), 3, [{"group_rank": 1, "ranks": [0, 1]}], "nccl", 5.0, "g")
    assert nccl_server.request("GET", "/health")[0] == 200


def test_a_round_that_fails_before_its_first_chunk_leaves_vllm_serving(adapter: VllmNcclAdapter,
                                                                       nccl_server: VllmProcess) -> None:  # fmt: skip
    before = complete(nccl_server, PROMPT, 8)["choices"][0]["token_ids"]
    held = adapter.held_version()
    version = int(held) + 1 if held and held.isdigit() else 1
    adapter.pause(30.0, round_id="r0")
    adapter.begin(version, 30.0, round_id="r0")  # opens nothing in vLLM yet
    adapter.abort(version, 30.0, round_id="r0", written=False)
    adapter.resume(30.0, round_id="r0")
    assert adapter.held_version() == held
    assert complete(nccl_server, PROMPT, 8)["choices"][0]["token_ids"] == before


def test_a_round_without_its_group_never_relabels_the_engine(adapter: VllmNcclAdapter,
                                                             nccl_server: VllmProcess) -> None:  # fmt: skip
    """Last in the module: vLLM's own reload does not survive a failed chunk (its engine core dies on the next
    request), which is why the round leaves it paused."""
    held = adapter.held_version()
    version = int(held) + 1 if held and held.isdigit() else 1
    adapter.pause(30.0, round_id="r1")
    adapter.begin(version, 30.0, round_id="r1")
    tensor = FullTensor("model.norm.weight", "float32", (64,))
    with pytest.raises(HttpCallError) as refused:
        adapter.receive_broadcast(version, [tensor], "weightsync-test", 30.0)
    assert refused.value.status == 500 and refused.value.route == "/update_weights"
    assert "not initialized" in Path(nccl_server.log_path).read_text(errors="replace")
    adapter.abort(version, 30.0, round_id="r1")
    assert ok(nccl_server, "GET", "/is_paused") == {"is_paused": True}  # the round never resumes it
    assert adapter.held_version() == held  # and it never reports the round's version
    with pytest.raises(HttpCallError, match="not verified"):
        adapter.commit(version, 30.0, round_id="r1")
    assert adapter.held_version() == held
