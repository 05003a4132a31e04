"""Publishing: bucket checksums agree on both sides, targets end bit-exact, failures are named."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from source_helpers import (
    MODEL,
    Full,
    TargetMemory,
    as_bytes,
    expected_local,
    full_state,
    make_plan,
    tp_layout,
)
from transports import Party, new_transport

from weightsync.plan import Plan, Target
from weightsync_agent.layout.buckets import plan_buckets
from weightsync_agent.layout.checksums import checksum_ranges, source_checksum, target_checksum
from weightsync_agent.source.replica import IncompleteReplicaError, ReplicaBusyError
from weightsync_agent.source.writer import InProcessSourceControl, Source, SourceConfigError


class Cluster:
    """One source rank and every target of the plan, each with its own transport."""

    def __init__(self, plan: Plan, tp: int, *, gap: int = 0, regions: str = "one", kind: str = "") -> None:
        self.plan = plan
        self.parties: list[Party] = []
        self.source_party = self._party(kind, counting=True)
        self.memory: dict[Target, TargetMemory] = {}
        self.target_party: dict[Target, Party] = {}
        for target in plan.sources[0].targets:
            party = self._party(kind)
            engine, rank = target
            mem = TargetMemory(
                tp_layout(MODEL, tp, rank),
                engine=engine,
                rank=rank,
                session_id=party.transport.session_id,
                gap=gap,
                regions=regions,
            )
            for region in mem.manifest.regions:
                party.transport.register(region.address, region.nbytes)
            self.memory[target] = mem
            self.target_party[target] = party

    def _party(self, kind: str, *, counting: bool = False) -> Party:
        party = new_transport(kind, counting=counting)
        self.parties.append(party)
        return party

    @property
    def manifests(self) -> dict[Target, object]:
        return {t: m.manifest for t, m in self.memory.items()}

    def source(self, bucket_bytes: int = 64, **kw: object) -> Source:
        return Source(self.source_party.transport, self.plan, 0, self.manifests, bucket_bytes, pin=False, **kw)  # type: ignore[arg-type]

    def close(self) -> None:
        for party in reversed(self.parties):
            party.close()


@pytest.fixture
def cluster_of() -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(engines: int, tp: int, **kw: object) -> Cluster:
        cluster = Cluster(make_plan(1, engines, tp), tp, **kw)  # type: ignore[arg-type]
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()


def assert_targets_hold(cluster: Cluster, fulls: dict[str, torch.Tensor], targets: list[Target] | None = None) -> None:
    for target in targets or list(cluster.memory):
        mem = cluster.memory[target]
        for entry in mem.manifest.tensors:
            assert torch.equal(mem.raw(entry.name), as_bytes(expected_local(entry, fulls))), (target, entry.name)


def test_two_targets_same_layout_share_one_replica_and_end_bit_exact(cluster_of: Callable[..., Cluster]) -> None:
    cluster = cluster_of(engines=2, tp=1, gap=24)
    with cluster.source(bucket_bytes=100) as source:
        assert len(source.replicas) == 1
        fulls = full_state(1)
        source.replicas.stage_many(fulls)
        result = source.publish(1, timeout=10)
        assert result.ok, result.summary()
        assert result.bytes == 2 * cluster.memory[(0, 0)].manifest.total_bytes
        assert result.gbps > 0
        assert_targets_hold(cluster, fulls)
        # checksums: one per bucket, the same on both sides, the same for both targets (shared bytes)
        for target, report in result.targets.items():
            buckets = plan_buckets(cluster.memory[target].manifest, 100)
            assert report.buckets == len(buckets) == len(report.checksums) == report.written
            assert report.checksums == [target_checksum(b) for b in buckets]
        assert result.targets[(0, 0)].checksums == result.targets[(1, 0)].checksums


def test_targets_of_different_ranks_get_their_own_shard(cluster_of: Callable[..., Cluster]) -> None:
    cluster = cluster_of(engines=2, tp=2)
    with cluster.source(bucket_bytes=128) as source:
        assert len(source.replicas) == 2
        assert source.replicas.nbytes == sum(cluster.memory[(0, r)].manifest.total_bytes for r in range(2))
        fulls = full_state(2)
        source.replicas.stage_many(fulls)
        result = source.publish(7, timeout=10)
        assert result.ok, result.summary()
        assert_targets_hold(cluster, fulls)
        # a second version over the same registered replica
        source.replicas.reset()
        fulls = full_state(3)
        source.replicas.stage_many(fulls)
        assert source.publish(8, timeout=10).ok
        assert_targets_hold(cluster, fulls)


@settings(max_examples=15, deadline=None)
@given(bucket_bytes=st.integers(1, 700), gap=st.sampled_from([0, 8]), regions=st.sampled_from(["one", "each"]))
def test_bucket_boundaries_and_checksums_agree_on_both_sides(bucket_bytes: int, gap: int, regions: str) -> None:
    cluster = Cluster(make_plan(1, 1, 2), 2, gap=gap, regions=regions)
    try:
        with cluster.source(bucket_bytes=bucket_bytes, max_inflight=3) as source:
            fulls = full_state(bucket_bytes)
            source.replicas.stage_many(fulls)
            result = source.publish(1, timeout=20)
            assert result.ok, result.summary()
            for target, report in result.targets.items():
                manifest = cluster.memory[target].manifest
                buckets = plan_buckets(manifest, bucket_bytes)
                replica = source.replica_for(target)
                assert sum(b.nbytes for b in buckets) == manifest.total_bytes
                assert all(b.nbytes <= bucket_bytes for b in buckets)
                cursor = 0
                for bucket, digest in zip(buckets, report.checksums, strict=True):
                    # a bucket is one contiguous run of the replica, so its digest is that run's
                    assert bucket.pieces[0].replica_offset == cursor
                    assert digest == checksum_ranges([(replica.address + cursor, bucket.nbytes)])
                    assert digest == source_checksum(bucket, replica.address) == target_checksum(bucket)
                    cursor += bucket.nbytes
            assert_targets_hold(cluster, fulls)
    finally:
        cluster.close()


def test_missing_tensor_refused_before_any_write(cluster_of: Callable[..., Cluster]) -> None:
    cluster = cluster_of(engines=2, tp=1)
    with cluster.source() as source:
        fulls = full_state()
        del fulls["k"]
        source.replicas.stage_many(fulls)
        with pytest.raises(IncompleteReplicaError, match=r"missing from the replica: t1\.fused \(from k\)"):
            source.publish(1, timeout=5)
        assert cluster.source_party.submitted() == 0
        assert all(int(m.buffer.count_nonzero()) == 0 for m in cluster.memory.values())
        # the publish lock was released: staging the rest and publishing works
        source.replicas.stage("k", full_state()["k"])
        assert source.publish(1, timeout=5).ok


@pytest.mark.parametrize("how", ["unregistered", "dead"])
def test_rejecting_target_is_named_and_the_other_completes(cluster_of: Callable[..., Cluster], how: str) -> None:
    cluster = cluster_of(engines=2, tp=1)
    bad: Target = (1, 0)
    mem = cluster.memory[bad]
    peer = cluster.target_party[bad].transport
    if how == "unregistered":
        peer.unregister(mem.manifest.regions[0].address)
    elif hasattr(peer, "fault"):  # MemoryTransport's injected fault: every write fails, nothing lands
        from weightsync_agent.transport.memory import Fault

        peer.fault = Fault.DEAD
    else:
        pytest.skip("this transport has no fault injection")
    with cluster.source(bucket_bytes=100) as source:
        fulls = full_state(4)
        source.replicas.stage_many(fulls)
        kept = [r.buffer.clone() for r in source.replicas]
        result = source.publish(1, timeout=10)
        assert not result.ok and not result.aborted
        (failure,) = result.failures
        assert failure.target == bad and failure.bucket == 0 and failure.kind == "transport"
        assert failure.session_id == mem.manifest.session_id
        text = str(failure)
        assert "target engine 1 rank 0" in text and "bucket 0 of" in text
        assert ("registered" if how == "unregistered" else "dead") in text, text
        assert result.targets[(0, 0)].ok
        assert_targets_hold(cluster, fulls, [(0, 0)])
        assert int(mem.buffer.count_nonzero()) == 0
        assert all(torch.equal(k, r.buffer) for k, r in zip(kept, source.replicas, strict=True))
        assert source.replicas.missing() == []  # untouched: a retry resends the same version
        with pytest.raises(Exception, match="target engine 1 rank 0"):
            result.raise_for_failure()


@pytest.mark.parametrize("kind", ["", "fake"], ids=["memory", "fake"])
def test_deadline_aborts_a_stalled_target_without_holding_back_the_other(
    cluster_of: Callable[..., Cluster], kind: str
) -> None:
    cluster = cluster_of(engines=2, tp=1, kind=kind)
    stalled: Target = (0, 0)
    if not cluster.target_party[stalled].stall():
        pytest.skip("this transport cannot stall a peer")
    with cluster.source(bucket_bytes=100) as source:
        fulls = full_state(5)
        source.replicas.stage_many(fulls)
        began = time.monotonic()
        resume = threading.Timer(1.0, cluster.target_party[stalled].release)  # the peer wakes after the deadline
        resume.start()
        result = source.publish(1, deadline=began + 0.5)
        took = time.monotonic() - began
        resume.join()
        # The fence: the stalled peer's writes were still moving at the deadline, so the failure is reported
        # only once they settled (here: landed on release), never while they could still land.
        assert 1.0 <= took < 5.0, took
        assert result.settle_seconds > 0 and result.unsettled == 0
        assert result.aborted and not result.ok
        (failure,) = result.failures
        assert failure.kind == "deadline" and failure.target == stalled and failure.bucket == 0
        assert "pending at the deadline" in failure.detail
        assert result.targets[(1, 0)].ok  # its own window kept going
        assert_targets_hold(cluster, fulls, [(1, 0)])
        cluster.target_party[stalled].release()


def test_concurrent_publish_is_refused(cluster_of: Callable[..., Cluster]) -> None:
    cluster = cluster_of(engines=1, tp=1)
    with cluster.source() as source:
        source.replicas.stage_many(full_state())
        with source.replicas.publishing(), pytest.raises(ReplicaBusyError):
            source.publish(1, timeout=5)


# --- Validation before any write ---------------------------------------------------------------


def test_manifests_must_cover_exactly_the_planned_targets(cluster_of: Callable[..., Cluster]) -> None:
    cluster = cluster_of(engines=2, tp=1)
    transport = cluster.source_party.transport
    manifests = cluster.manifests
    with pytest.raises(SourceConfigError, match=r"no manifest for planned target\(s\) \[\(1, 0\)\]"):
        Source(transport, cluster.plan, 0, {(0, 0): manifests[(0, 0)]}, 64, pin=False)  # type: ignore[dict-item]
    with pytest.raises(SourceConfigError, match=r"\(5, 0\) \(not in the plan\)"):
        Source(transport, cluster.plan, 0, {**manifests, (5, 0): manifests[(0, 0)]}, 64, pin=False)  # type: ignore[dict-item]
    with pytest.raises(SourceConfigError, match="plan has 1 trainer ranks; this source is rank 3"):
        Source(transport, cluster.plan, 3, manifests, 64, pin=False)  # type: ignore[arg-type]
    swapped = {(0, 0): manifests[(1, 0)], (1, 0): manifests[(0, 0)]}
    with pytest.raises(SourceConfigError, match=r"filed under target \(0, 0\) describes engine 1 rank 0"):
        Source(transport, cluster.plan, 0, swapped, 64, pin=False)  # type: ignore[arg-type]
    assert cluster.source_party.submitted() == 0


def test_same_rank_must_have_the_same_layout(cluster_of: Callable[..., Cluster]) -> None:
    cluster = cluster_of(engines=2, tp=1)
    other = TargetMemory(
        tp_layout(MODEL[:2], 1, 0), engine=1, rank=0, session_id=cluster.memory[(1, 0)].manifest.session_id
    )
    manifests = {**cluster.manifests, (1, 0): other.manifest}
    with pytest.raises(SourceConfigError, match=r"rank 0: target \(0, 0\) and target \(1, 0\) publish different"):
        Source(cluster.source_party.transport, cluster.plan, 0, manifests, 64, pin=False)  # type: ignore[arg-type]


def test_full_tensor_expected_with_two_shapes_is_refused(cluster_of: Callable[..., Cluster]) -> None:
    plan = make_plan(1, 1, 2)
    cluster = cluster_of(engines=1, tp=2)
    bigger = [(kind, [Full(f.name, (f.shape[0] * 2, *f.shape[1:]), f.dtype) for f in fulls]) for kind, fulls in MODEL]
    rank1 = TargetMemory(tp_layout(bigger, 2, 1), engine=0, rank=1, session_id="x")
    manifests = {**cluster.manifests, (0, 1): rank1.manifest}
    with pytest.raises(SourceConfigError, match="full tensor 'embed' is expected as"):
        Source(cluster.source_party.transport, plan, 0, manifests, 64, pin=False)  # type: ignore[arg-type]


def test_targets_sharing_a_session_must_not_overlap(cluster_of: Callable[..., Cluster]) -> None:
    cluster = cluster_of(engines=1, tp=2)
    m0 = cluster.memory[(0, 0)].manifest
    m1 = cluster.memory[(0, 1)].manifest
    clash = m1.model_copy(update={"session_id": m0.session_id, "tensors": m1.tensors, "regions": m1.regions})
    # point rank 1's first tensor into rank 0's memory
    first = clash.tensors[0].model_copy(update={"address": m0.tensors[0].address})
    clash = clash.model_copy(update={"tensors": (first, *clash.tensors[1:]), "regions": (*m1.regions, *m0.regions)})
    with pytest.raises(SourceConfigError, match=r"share session .* overlap"):
        Source(cluster.source_party.transport, cluster.plan, 0, {(0, 0): m0, (0, 1): clash}, 64, pin=False)


def test_round_report_names_the_failed_target_and_refusals_become_reports(cluster_of: Callable[..., Cluster]) -> None:
    cluster = cluster_of(engines=2, tp=1)
    bad: Target = (1, 0)
    cluster.target_party[bad].transport.unregister(cluster.memory[bad].manifest.regions[0].address)
    with cluster.source(bucket_bytes=100) as source:
        control = InProcessSourceControl(source)
        report = control.publish(1, time.monotonic() + 5)  # nothing staged yet
        assert not report.ok and report.error and "missing from the replica" in report.error
        source.replicas.stage_many(full_state())
        report = control.publish(1, time.monotonic() + 5)
        assert not report.ok and report.failed_target == bad and report.failed_bucket == 0
        assert set(report.checksums) == {(0, 0)}  # only what landed is offered for verification
        assert report.bytes == cluster.memory[(0, 0)].manifest.total_bytes
