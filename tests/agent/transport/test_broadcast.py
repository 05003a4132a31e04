"""Broadcast mode over gloo on loopback with real processes: one sender, three receivers, each
rebuilding its own TP shard bit-exactly; a dead or hung sender fails receivers within the timeout."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from weightsync_agent.manifest import ShardPart, TensorEntry
from weightsync_agent.transport.assemble import ShardAssembler
from weightsync_agent.transport.base import TransportError
from weightsync_agent.transport.broadcast import ALIGN, _decode, _encode, plan_buckets

PEER = Path(__file__).with_name("bcast_peer.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_group(world: int, *extra: str, timeout: float = 60.0) -> list[dict[str, object]]:
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(PEER), "--rank", str(r), "--world", str(world), "--init", init, *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for r in range(world)
    ]
    try:
        # Receivers first: a hung sender is only killed once they have given up on it.
        outs = [p.communicate(timeout=timeout)[0] for p in procs[1:]]
        if procs[0].poll() is None and "hang" in extra:
            procs[0].kill()
        outs.insert(0, procs[0].communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def test_one_sender_three_receivers_rebuild_their_shards_bit_exactly() -> None:
    results = run_group(4, "--bucket", str(8 << 10), "--version", "42")
    sender, receivers = results[0], results[1:]
    assert sender["buckets"] == receivers[0]["buckets"] and int(str(sender["buckets"])) >= 4
    for r in receivers:
        assert r == r | {"version": 42, "mismatched": [], "missing": []}, r


def test_a_sender_that_quits_fails_the_receiver_fast() -> None:
    started = time.monotonic()
    _, receiver = run_group(2, "--sender", "quit", "--timeout", "20")
    assert "error" in receiver and time.monotonic() - started < 15


def test_a_hung_sender_fails_the_receiver_within_the_timeout() -> None:
    _, receiver = run_group(2, "--sender", "hang", "--timeout", "3", timeout=30)
    assert "timed out" in str(receiver.get("error")), receiver
    assert 2.5 < float(str(receiver["seconds"])) < 6, receiver


def tensors(*specs: tuple[str, tuple[int, ...], torch.dtype]) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.zeros(shape, dtype=dtype)) for name, shape, dtype in specs]


def test_bucket_plan_packs_in_order_aligned_and_lets_big_tensors_travel_alone() -> None:
    named = tensors(
        ("a", (10,), torch.float32),  # 40 B
        ("b", (3,), torch.bfloat16),  # 6 B at 64
        ("big", (100,), torch.float32),  # 400 B > bucket
        ("c", (2,), torch.int64),
    )
    plans = plan_buckets(named, 128)
    assert [[s.name for s in p.slots] for p in plans] == [["a", "b"], ["big"], ["c"]]
    assert [s.offset for s in plans[0].slots] == [0, ALIGN] and plans[0].nbytes == ALIGN + 6
    assert plans[1].nbytes == 400 and plans[1].slots[0].shape == (100,)
    assert _decode(_encode(plans)) == plans
    with pytest.raises(ValueError):
        plan_buckets(named, 0)
    with pytest.raises(ValueError, match="twice"):
        plan_buckets(named + named[:1], 128)


def entry(name: str, parts: tuple[ShardPart, ...], shape: tuple[int, ...], cat_dim: int = 0) -> TensorEntry:
    return TensorEntry(
        name=name,
        dtype="float32",
        shape=shape,
        address=4096,
        nbytes=4 * shape[0] * shape[1],
        cat_dim=cat_dim,
        parts=parts,
    )


def test_assembler_copies_parts_as_they_arrive_and_names_what_is_missing() -> None:
    q, k = torch.arange(32.0).view(8, 4), torch.arange(100.0, 116.0).view(4, 4)
    fused = entry(
        "qk",
        (
            ShardPart(source="q", full_shape=(8, 4), dim=0, start=4, length=4),
            ShardPart(source="k", full_shape=(4, 4), dim=0, start=2, length=2),
        ),
        (6, 4),
    )
    dest = {"qk": torch.zeros(6, 4)}
    assembler = ShardAssembler([fused], dest)
    assembler([("q", q), ("unrelated", torch.ones(3))])
    assert assembler.missing() == ["qk <- k"]
    assembler([("k", k)])
    assert assembler.missing() == []
    assert torch.equal(dest["qk"], torch.cat([q[4:8], k[2:4]]))
    with pytest.raises(TransportError, match="shape"):
        assembler([("q", torch.zeros(4, 4))])
    with pytest.raises(TransportError, match="destination has shape"):
        ShardAssembler([fused], {"qk": torch.zeros(5, 4)})
