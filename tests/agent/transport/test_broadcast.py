"""Broadcast mode over gloo on loopback with real processes: one sender, three receivers, each
rebuilding its own TP shard bit-exactly; a dead or hung sender fails receivers within the timeout.
Then the round-level pieces: version checks, draining, deadlines and teardown (two ranks as threads),
the group layout, the driver's plan view and the sender's checksums."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync.plan import Plan, plan_for
from weightsync.ports import free_port
from weightsync_agent.layout.buckets import plan_buckets
from weightsync_agent.layout.checksums import target_checksum
from weightsync_agent.layout.manifest import ShardPart, TensorEntry
from weightsync_agent.modes.broadcast.checksums import layout_checksums, local_bytes
from weightsync_agent.modes.broadcast.layout import BroadcastLayout, Member, broadcast_round_plan
from weightsync_agent.transport.base import TransportError
from weightsync_agent.transport.collective import ALIGN, BroadcastGroup, _decode, _digest, _encode, cut
from weightsync_agent.transport.collective import plan_buckets as plan_broadcast_buckets
from weightsync_testing.reference_engine.assemble import ShardAssembler
from weightsync_testing.reference_engine.model import RankWeights, full_state, shard

PEER = Path(__file__).with_name("bcast_peer.py")


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


@pytest.mark.parametrize("direct", [0, 1024], ids=["packed", "direct-segments"])
def test_one_sender_three_receivers_rebuild_their_shards_bit_exactly(direct: int) -> None:
    results = run_group(4, "--bucket", str(8 << 10), "--version", "42", "--direct", str(direct))
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
    plans = plan_broadcast_buckets(named, 128)
    assert [[s.name for s in p.slots] for p in plans] == [["a", "b"], ["big"], ["c"]]
    assert [s.offset for s in plans[0].slots] == [0, ALIGN] and plans[0].nbytes == ALIGN + 6
    assert plans[1].nbytes == 400 and plans[1].slots[0].shape == (100,)
    assert _decode(_encode(plans)) == (plans, [[(0, p.nbytes)] for p in plans])
    cuts = [[(0, 64), (64, p.nbytes)] if p.nbytes > 64 else [(0, p.nbytes)] for p in plans]
    assert _decode(_encode(plans, cuts)) == (plans, cuts)
    with pytest.raises(TransportError, match="do not fit"):
        _decode(_encode(plans, [[(0, p.nbytes + 1)] for p in plans]))
    with pytest.raises(ValueError):
        plan_broadcast_buckets(named, 0)
    with pytest.raises(ValueError, match="twice"):
        plan_broadcast_buckets(named + named[:1], 128)


@given(
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=12),
    bucket=st.integers(64, 20000),
    direct=st.integers(0, 6000),
    apart=st.sets(st.integers(0, 11), max_size=4),
)
def test_cut_sends_what_lies_in_place_from_there_and_packs_the_rest(
    sizes: list[int], bucket: int, direct: int, apart: set[int]
) -> None:
    """Tensors laid out as the buckets go zero-copy (bytes identical to packing); the others (``apart``:
    separate allocations) go alone from their own memory or are packed; every byte travels once, in order."""
    names = [f"t{i}" for i in range(len(sizes))]
    plans = plan_broadcast_buckets(
        [(n, torch.zeros(k, dtype=torch.uint8)) for n, k in zip(names, sizes, strict=True)], bucket
    )
    flat = torch.randint(0, 256, (sum(p.nbytes for p in plans),), dtype=torch.uint8)
    tensors, bases, base = {}, [], 0
    for plan in plans:
        bases.append(base)
        for slot in plan.slots:
            region = flat[base + slot.offset : base + slot.offset + slot.nbytes]
            tensors[slot.name] = region.clone() if int(slot.name[1:]) in apart else region
        base += plan.nbytes
    for plan, base in zip(plans, bases, strict=True):
        segments = cut(plan, tensors, torch.device("cpu"), direct)
        assert all(a.end <= b.start for a, b in pairwise(segments))
        for slot in plan.slots:
            if slot.nbytes:
                holders = [g for g in segments if g.start <= slot.offset and slot.offset + slot.nbytes <= g.end]
                assert len(holders) == 1  # every byte of every tensor travels exactly once
                if int(slot.name[1:]) in apart and holders[0].source is not None:  # alone, from its own memory
                    assert (holders[0].start, holders[0].end) == (slot.offset, slot.offset + slot.nbytes)
        for segment in segments:
            if segment.source is not None:
                assert direct and segment.end - segment.start >= direct
                assert torch.equal(segment.source, flat[base + segment.start : base + segment.end])
        if not direct:
            assert [(g.start, g.end, g.source) for g in segments] == ([(0, plan.nbytes, None)] if plan.nbytes else [])


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


# --- Round-level behaviour, two ranks as threads of this process (gloo over loopback) ----------------


def thread_pair(timeout: float = 10.0) -> tuple[BroadcastGroup, BroadcastGroup]:
    init = f"tcp://127.0.0.1:{free_port()}"
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(BroadcastGroup, rank, 2, init, "gloo", timeout) for rank in (0, 1)]
    return futures[0].result(), futures[1].result()


def test_a_receiver_drains_a_round_it_refuses_and_stays_in_step() -> None:
    sender, receiver = thread_pair()
    named = [("a", torch.arange(300.0)), ("b", torch.ones(7, 9, dtype=torch.bfloat16))]
    got: list[str] = []

    def failing(views: list[tuple[str, torch.Tensor]]) -> None:
        got.extend(name for name, _ in views)
        raise TransportError("destination refused")

    with ThreadPoolExecutor(1) as pool:
        # Wrong version: drained without a callback, then refused.
        sending = pool.submit(sender.broadcast_buckets, named, 512, version=4)
        with pytest.raises(TransportError, match="expected version 3, the sender sent 4"):
            receiver.receive_buckets(failing, version=3)
        sending.result()
        assert got == []
        # The callback fails on the first bucket: the rest is still received, then the error re-raised.
        sending = pool.submit(sender.broadcast_buckets, named, 512, version=5)
        with pytest.raises(TransportError, match="destination refused"):
            receiver.receive_buckets(failing, version=5)
        assert sending.result().buckets == 2 and got == ["a"]
        # Still in step: the next round arrives whole.
        sending = pool.submit(sender.broadcast_buckets, named, 512, version=6)
        received: dict[str, torch.Tensor] = {}
        stats = receiver.receive_buckets(lambda views: received.update((n, v.clone()) for n, v in views), version=6)
        sending.result()
    assert stats.version == 6 and set(received) == {"a", "b"} and torch.equal(received["a"], named[0][1])
    sender.close()
    receiver.close()


def test_a_sender_past_its_deadline_breaks_the_group_and_closing_frees_the_receiver_at_once() -> None:
    sender, receiver = thread_pair(timeout=20.0)
    progress: list[tuple[int, int]] = []
    named = [("a", torch.zeros(64))]
    with ThreadPoolExecutor(1) as pool:
        receiving = pool.submit(receiver.receive_buckets, lambda views: None)
        with pytest.raises(TransportError, match="deadline passed before bucket 0"):
            sender.broadcast_buckets(named, 1024, deadline=0.0, progress=lambda *p: progress.append(p))
        assert sender.broken and not progress
        with pytest.raises(TransportError, match="broken"):  # refused at once, nothing sent
            sender.broadcast_buckets(named, 1024)
        started = time.monotonic()
        sender.close()
        with pytest.raises(TransportError):
            receiving.result(timeout=15)
    assert time.monotonic() - started < 5, "the receiver waited for the timeout instead of failing at once"
    assert receiver.broken
    receiver.close()


# --- Broadcast mode in the round: layout, the driver's plan view, the sender's checksums -------------


def broadcast_plan(mode: str = "broadcast", engines: int = 2, tp: int = 2, trainers: int = 2) -> Plan:
    template = {"spec": {"containers": [{"name": "main"}]}}
    spec = WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": trainers, "template": template},
            "inference": {"engines": engines, "ranksPerEngine": tp, "ranksPerPod": tp, "template": template},
            "transfer": {"mode": mode},
        }
    )
    return plan_for(spec, group="g", namespace="ns")


def test_members_are_one_per_engine_or_one_per_rank_after_the_sender() -> None:
    plan = broadcast_plan(engines=2, tp=2)
    per_engine = BroadcastLayout.of(plan.layout)
    assert per_engine.world_size == 3 and per_engine.receivers == 2
    assert per_engine.members == {0: (Member(1, (0, 1)),), 1: (Member(2, (0, 1)),)}
    per_rank = BroadcastLayout.of(plan.layout, "rank")
    assert per_rank.world_size == 5
    assert per_rank.members[1] == (Member(3, (0,)), Member(4, (1,)))
    assert per_rank.engine_of(4) == 1 and per_rank.engine_of(0) is None


def test_the_round_plan_gives_rank_0_every_target_and_refuses_p2p_plans() -> None:
    plan = broadcast_plan(trainers=3)
    view = broadcast_round_plan(plan)
    assert view.sources[0].targets == tuple(plan.layout.all_targets())
    assert [a.targets for a in view.sources[1:]] == [(), ()]
    assert view.hash == view.compute_hash() and view.layout == plan.layout and view.transfer == plan.transfer
    with pytest.raises(ValueError, match="p2p mode"):
        broadcast_round_plan(broadcast_plan("p2p"))


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 4096, 1000])
def test_sender_checksums_equal_those_of_the_model_own_resharding(bucket_bytes: int) -> None:
    full = full_state(seed=3)
    for rank in range(2):
        weights = RankWeights(2, rank)
        weights.load(shard(full, 2, rank))
        manifest = weights.manifest(engine=0, session_id="local:0")
        expected = [target_checksum(b) for b in plan_buckets(manifest, bucket_bytes)]
        assert layout_checksums(manifest, full, bucket_bytes) == expected
    other = dict(full, **{"lm_head.weight": full["lm_head.weight"] + 1})
    assert layout_checksums(manifest, other, 1 << 20) != expected


def test_fused_experts_and_padding_are_placed_alike_by_receiver_and_sender_checksums() -> None:
    """``at`` (expert e's gate/up rows in ``w13[e]``) and ``padding`` (trailing zero rows): the receiver's assembler
    and the sender's cut (its checksums) agree with a hand-built tensor."""
    gen = torch.Generator().manual_seed(3)
    full = {f"{e}.{w}": torch.randn(4, 3, generator=gen) for e in range(2) for w in ("gate", "up")}
    full["vocab"] = torch.randn(5, 3, generator=gen)
    w13 = TensorEntry(
        name="w13",
        dtype="float32",
        shape=(2, 4, 3),
        address=4096,
        nbytes=4 * 24,
        cat_dim=1,
        parts=tuple(
            ShardPart(source=f"{e}.{w}", full_shape=(4, 3), dim=0, start=2, length=2, at=(e,))
            for e in range(2)
            for w in ("gate", "up")
        ),
    )
    vocab = TensorEntry(
        name="vocab",
        dtype="float32",
        shape=(3, 3),
        address=8192,
        nbytes=4 * 9,
        padding=2,
        parts=(ShardPart(source="vocab", full_shape=(5, 3), dim=0, start=4, length=1),),
    )
    want = {
        "w13": torch.stack([torch.cat([full[f"{e}.gate"][2:], full[f"{e}.up"][2:]]) for e in range(2)]),
        "vocab": torch.cat([full["vocab"][4:], torch.zeros(2, 3)]),
    }
    dest = {"w13": torch.full((2, 4, 3), float("nan")), "vocab": torch.zeros(3, 3)}
    assembler = ShardAssembler([w13, vocab], dest)
    assembler(list(full.items()))
    assert assembler.missing() == []
    for name, tensor in want.items():
        assert torch.equal(dest[name], tensor), name
    for entry_, tensor in ((w13, want["w13"]), (vocab, want["vocab"])):
        assert bytes(local_bytes(entry_, full)) == tensor.numpy().tobytes()


def test_a_round_with_the_previous_rounds_layout_sends_no_metadata_and_arrives_whole() -> None:
    sender, receiver = thread_pair()
    layouts = {
        "same": [("a", torch.arange(300.0)), ("b", torch.ones(7, 9, dtype=torch.bfloat16))],
        "other": [("a", torch.arange(300.0)), ("c", torch.full((5,), 3, dtype=torch.int32))],
    }
    sent: list[int] = []
    with ThreadPoolExecutor(1) as pool:
        for version, layout in enumerate(("same", "same", "other", "same"), start=1):
            named = [(n, t + version) for n, t in layouts[layout]]  # new bytes every round
            sending = pool.submit(sender.broadcast_buckets, named, 512, version=version)
            received: dict[str, torch.Tensor] = {}

            def keep(views: list[tuple[str, torch.Tensor]], into: dict[str, torch.Tensor] = received) -> None:
                into.update((n, v.clone()) for n, v in views)

            stats = receiver.receive_buckets(keep)
            out = sending.result()
            assert stats.version == version and stats.metadata_bytes == out.metadata_bytes
            assert received.keys() == dict(named).keys()
            assert all(torch.equal(received[n], t) for n, t in named)
            sent.append(out.metadata_bytes)
    # The metadata travels when the layout is new to the group, and only then.
    assert sent[0] > 0 and sent[1] == 0 and sent[2] > 0 and sent[3] > 0
    sender.close()
    receiver.close()


def test_a_receiver_that_missed_the_metadata_fails_the_round_and_marks_the_group_broken() -> None:
    sender, receiver = thread_pair(timeout=5.0)
    named = [("a", torch.arange(64.0))]
    with ThreadPoolExecutor(1) as pool:
        sending = pool.submit(sender.broadcast_buckets, named, 512, version=1)
        receiver.receive_buckets(lambda views: None)
        sending.result()
        receiver._received = None  # as if this rank had never seen the layout
        sending = pool.submit(sender.broadcast_buckets, named, 512, version=2)
        with pytest.raises(TransportError, match="reused bucket metadata this rank never received"):
            receiver.receive_buckets(lambda views: None)
        assert receiver.broken
        receiver.close()  # frees the sender, which waits for its bucket
        with pytest.raises(TransportError):
            sending.result(timeout=15)
    sender.close()


def test_the_metadata_digest_tells_layouts_apart() -> None:
    payload = _encode(plan_broadcast_buckets([("a", torch.zeros(4))], 512))
    assert _digest(payload) != _digest(payload.replace(b'"a"', b'"b"'))
    assert isinstance(_digest(payload), int) and -(1 << 63) <= _digest(payload) < (1 << 63)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (random bits include NaNs, which ``torch.equal`` calls unequal to themselves)."""
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def test_a_sender_reuses_its_layout_while_its_tensors_stay_put_and_sends_their_current_bytes() -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(BroadcastGroup, rank, 2, init, "gloo", 10.0, direct_bytes=64) for rank in (0, 1)]
    sender, receiver = futures[0].result(), futures[1].result()
    flat = torch.zeros(4096, dtype=torch.uint8)  # two tensors laid out as the bucket lays them: zero-copy
    named = [("a", flat[:1024].view(torch.float32)), ("b", flat[1024:3072].view(torch.float16))]

    def round_trip(tensors: list[tuple[str, torch.Tensor]], version: int) -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}

        def keep(views: list[tuple[str, torch.Tensor]]) -> None:
            got.update((n, v.clone()) for n, v in views)

        with ThreadPoolExecutor(1) as pool:
            sending = pool.submit(sender.broadcast_buckets, tensors, 4096, version=version)
            receiver.receive_buckets(keep)
            sending.result()
        return got

    flat.random_(0, 256, generator=torch.Generator().manual_seed(1))
    first = round_trip(named, 1)
    layout = sender._layout
    assert layout is not None and any(g.holder for bucket in layout.segments for g in bucket), "no zero-copy run"
    flat.random_(0, 256, generator=torch.Generator().manual_seed(2))  # new bytes, same places
    second = round_trip(named, 2)
    assert sender._layout is layout, "the layout was planned again for tensors that did not move"
    assert all(same_bytes(second[n], t) for n, t in named) and not same_bytes(first["a"], second["a"])
    moved = [(n, t.clone() + 1) for n, t in named]  # same shapes, new addresses
    third = round_trip(moved, 3)
    assert sender._layout is not layout
    assert all(same_bytes(third[n], t) for n, t in moved)
    sender.close()
    receiver.close()
