"""The unique-id NCCL group (vLLM's ``nccl_unique_id_b64`` rendezvous), trainer side.

Everywhere: the id is minted by the real ``libnccl`` (no GPU needed), told to engines as ``nccl-uid:<base64>`` in
standard base64 that decodes back to the same 128 bytes, and anything else is refused; without CUDA the sender
refuses with a clear error. Where two GPUs are visible: the sender on GPU 0 and receiver processes doing exactly
what a vLLM worker does (``nccl_uid_peer.py``) form the group, answer the warm-up, and every announced tensor
arrives bit-exact, in order, whatever its dtype; a receiver that is gone makes the sender fail within its timeout.
Where vLLM's own code is importable too: vLLM's ``NCCLWeightTransferEngine`` (``vllm_nccl_member.py``), given the
adapter's exact payloads, receives a round from the sender (docs/engines/vllm.md, "What ran where", says how it was
run on the GPU machine).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import pytest
import torch

from weightsync_agent.targets.adapter import FullTensor
from weightsync_agent.targets.vllm.nccl_adapter import init_info_payload, update_info_payload
from weightsync_agent.transport.base import TransportError
from weightsync_agent.transport.nccl_library import NcclLibrary, library_path
from weightsync_agent.transport.nccl_uid_group import UniqueIdGroupSender, mint, rendezvous_of, unique_id_of

PEER = Path(__file__).with_name("nccl_uid_peer.py")
VLLM_MEMBER = Path(__file__).with_name("vllm_nccl_member.py")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
HAS_VLLM = importlib.util.find_spec("vllm") is not None
AGENT = str(Path(__file__).parents[3] / "agent")


def test_a_minted_id_travels_as_standard_base64_and_back() -> None:
    unique_id = mint()
    assert len(unique_id) == 128 and unique_id != mint()
    told = rendezvous_of(unique_id)
    assert told.startswith("nccl-uid:") and base64.b64decode(told.removeprefix("nccl-uid:")) == unique_id
    assert unique_id_of(told) == unique_id
    assert NcclLibrary().version() >= 21800  # torch's wheel ships NCCL 2.x; vLLM needs >= 2.18 for this path


@pytest.mark.parametrize(
    ("told", "why"),
    [
        ("tcp://127.0.0.1:1234", "starts with 'nccl-uid:'"),
        ("nccl-uid:" + base64.b64encode(b"short").decode(), "128 bytes, got 5"),
        ("nccl-uid:not base64!", "standard base64"),
    ],
)
def test_anything_but_a_unique_id_is_refused(told: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        unique_id_of(told)


def test_a_missing_library_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTSYNC_NCCL_LIBRARY", "/nonexistent/libnccl.so.2")
    assert library_path() == "/nonexistent/libnccl.so.2"
    with pytest.raises(TransportError, match=r"cannot load the NCCL library /nonexistent/libnccl\.so\.2"):
        mint()


@pytest.mark.skipif(GPUS > 0, reason="checks the refusal on a machine without CUDA")
def test_without_cuda_the_sender_refuses_before_joining() -> None:
    with pytest.raises(TransportError, match="no CUDA device"):
        UniqueIdGroupSender(2, mint(), "weightsync-test")


TENSORS = [
    ("model.embed_tokens.weight", "bfloat16", [4096, 256]),
    ("model.layers.0.self_attn.q_proj.weight", "float16", [512, 256]),
    ("model.norm.weight", "float32", [256]),
    ("lm_head.weight", "bfloat16", [4096, 256]),
    ("model.layers.0.mlp.experts.ids", "int64", [3, 5]),
]


def _peers(told: str, world: int, tensors: list[tuple[str, str, list[int]]]) -> list[subprocess.Popen[str]]:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [AGENT, os.environ.get("PYTHONPATH")]))}
    spec = json.dumps(tensors)
    return [
        subprocess.Popen(
            [sys.executable, str(PEER), "--rank", str(r), "--world", str(world), "--uid", told, "--tensors", spec],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(1, world)
    ]


def _full_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    full = {}
    for name, dtype, shape in TENSORS:
        if dtype == "int64":
            full[name] = torch.randint(0, 1 << 40, shape, generator=generator)
        else:
            full[name] = torch.randn(shape, generator=generator).to(getattr(torch, dtype))
    return full


def _sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_every_announced_tensor_arrives_bit_exact_at_every_receiver() -> None:
    full = _full_tensors()
    world = min(GPUS, 4)
    unique_id = mint()
    peers = _peers(rendezvous_of(unique_id), world, TENSORS)
    torch.cuda.set_device(0)
    try:
        sender = UniqueIdGroupSender(world, unique_id, "weightsync-test", timeout_seconds=60)
        sent = sender.broadcast(((name, full[name]) for name, _, _ in TENSORS), deadline=time.monotonic() + 60)
        sender.close()
        outs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in peers]
    finally:
        for p in peers:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert sent == sum(t.numel() * t.element_size() for t in full.values())
    want = {n: _sha256(t) for n, t in full.items()}
    assert sorted(o["rank"] for o in outs) == list(range(1, world))
    for out in outs:
        assert out["warm_up"] == 0.0 and out["sha256"] == want, out


@pytest.mark.skipif(GPUS < 1, reason="needs a GPU")
def test_a_member_that_never_joins_fails_the_join_within_its_timeout_and_the_next_group_forms() -> None:
    torch.cuda.set_device(0)
    started = time.monotonic()
    with pytest.raises(TransportError, match="joining did not complete in time"):
        UniqueIdGroupSender(2, mint(), "weightsync-test", timeout_seconds=3)
    assert time.monotonic() - started < 15  # aborted, not left waiting in NCCL's init
    if GPUS >= 2:  # and this process still forms groups
        test_every_announced_tensor_arrives_bit_exact_at_every_receiver()


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_a_receiver_that_dies_fails_the_sender_within_its_timeout() -> None:
    unique_id = mint()
    tensors = [("a", "float32", [1024]), ("b", "float32", [64 << 20])]
    peers = _peers(rendezvous_of(unique_id), 2, tensors[:1])  # it takes the first tensor only, then leaves
    torch.cuda.set_device(0)
    try:
        sender = UniqueIdGroupSender(2, unique_id, "weightsync-test", timeout_seconds=10)
        started = time.monotonic()
        with pytest.raises(TransportError, match="broadcast of b"):
            sender.broadcast([(n, torch.ones(s, dtype=torch.float32)) for n, _, s in tensors])
        assert time.monotonic() - started < 30
        assert sender.broken is not None
        with pytest.raises(TransportError, match="broken"):
            sender.broadcast([("a", torch.ones(1024))])
    finally:
        for p in peers:
            p.communicate(timeout=60)


@pytest.mark.skipif(GPUS < 2 or not HAS_VLLM, reason="needs two GPUs and vLLM's own code")
def test_vllms_own_nccl_engine_receives_a_round_from_the_sender() -> None:
    """vLLM's NCCLWeightTransferEngine (``vllm_nccl_member.py``) per member, given the adapter's exact payloads."""
    full = _full_tensors()
    world = min(GPUS, 4)
    unique_id = mint()
    told = rendezvous_of(unique_id)
    announced = [FullTensor(name, dtype, tuple(shape)) for name, dtype, shape in TENSORS]
    chunks = [announced[:2], announced[2:]]  # two /update_weights calls, as the sender splits by bucket size
    updates = json.dumps([update_info_payload(chunk) for chunk in chunks])
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [AGENT, os.environ.get("PYTHONPATH")]))}
    members = []
    for rank in range(1, world):
        init_info = init_info_payload(told, world, [{"group_rank": rank, "ranks": [0]}], ranks=1)
        command = [sys.executable, str(VLLM_MEMBER), "--init-info", json.dumps(init_info), "--chunks", updates,
                   "--device", str(rank)]  # fmt: skip
        members.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    torch.cuda.set_device(0)
    joining = ThreadPoolExecutor(1)  # NCCL's init has no timeout: a member that never joins must fail the test
    try:
        try:
            sender = joining.submit(UniqueIdGroupSender, world, unique_id, "weightsync-test", 120).result(timeout=90)
        except FutureTimeout:
            for p in members:
                p.kill()
            errors = [p.communicate()[1][-3000:] for p in members]
            pytest.fail(f"no member joined within 90 s: {errors}")
        for chunk in chunks:
            sender.broadcast([(t.name, full[t.name]) for t in chunk], deadline=time.monotonic() + 120)
        sender.close()
        answers = [p.communicate(timeout=180) for p in members]
        assert all(p.returncode == 0 for p in members), [err[-3000:] for _, err in answers]
        outs = [json.loads(out.strip().splitlines()[-1]) for out, _ in answers]
    finally:
        joining.shutdown(wait=False)
        for p in members:
            if p.poll() is None:
                p.kill()
            p.wait()
    want = {n: _sha256(t) for n, t in full.items()}
    for out in outs:
        assert out["order"] == [name for name, _, _ in TENSORS] and out["sha256"] == want, out
