"""The timing model: one sync of a scenario, as NCCL broadcast, as Miles P2P, and as our pipelined design.

Pure: the only input besides the dataclasses is the real planner (:func:`weightsync.plan.plan_for`),
which decides who writes whom. See ``docs/simulator.md`` for the model, term by term.

Geometry shared by the three modes (PP stages work on disjoint layers):

- the trainer has ``W`` ranks in ``PP`` stages of ``S = W / PP`` ranks; after the TP/EP all-gather every
  rank of a stage holds full tensors of the stage's layers (notes §1.6);
- the inference side has ``E`` engines of ``TP`` ranks; each rank holds ``1/TP`` of the model;
- a stage's weights go out in ``nb`` buckets of ``bucket_bytes`` (counted in the training dtype).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync.plan import Plan, plan_for
from weightsync_tools.simulate.hardware import Hardware
from weightsync_tools.simulate.scenario import Scenario

_TEMPLATE: dict[str, Any] = {"spec": {"containers": [{"name": "trainer", "image": "simulated"}]}}


@dataclass(frozen=True)
class ModeResult:
    seconds: float
    phases: tuple[tuple[str, float], ...]
    """Where the time goes; the phases add up to ``seconds``."""
    total_bytes: float
    """Bytes received by all inference ranks together."""
    busiest_link_bytes: float
    """Bytes through the busiest GPU endpoint (a source's NIC, a target, or a ring member)."""
    bottleneck: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 4),
            "phases": {name: round(value, 4) for name, value in self.phases},
            "total_bytes": self.total_bytes,
            "busiest_link_bytes": self.busiest_link_bytes,
            "bottleneck": self.bottleneck,
        }


@dataclass(frozen=True)
class PlanFacts:
    policy: str
    sources: int
    targets: int
    max_targets_per_source: int
    max_shapes_per_source: int
    bytes_per_source: tuple[float, ...]
    """What each stage source writes in one sync (its targets x its slice of their shards)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "sources_per_stage": self.sources,
            "targets": self.targets,
            "max_targets_per_source": self.max_targets_per_source,
            "max_shapes_per_source": self.max_shapes_per_source,
            "max_bytes_per_source": max(self.bytes_per_source),
        }


@dataclass(frozen=True)
class Geometry:
    trainer_ranks: int
    inference_ranks: int
    engines: int
    stage_sources: int
    buckets_per_stage: int
    shard_bytes: float
    """One inference rank's weights (all layers)."""
    slice_bytes: float
    """What one target receives from one stage in one bucket."""
    bucket_wire_bytes: float
    gather_s: float
    """The TP/EP all-gather of one bucket on a stage's ranks."""


@dataclass(frozen=True)
class Simulation:
    scenario: Scenario
    hardware: Hardware
    geometry: Geometry
    broadcast: ModeResult
    p2p: ModeResult
    ours: ModeResult
    miles_plan: PlanFacts
    our_plan: PlanFacts

    def errors(self) -> dict[str, float] | None:
        """Relative error of the modelled against the published numbers, when there are published ones."""
        published = self.scenario.published
        if published is None:
            return None
        return {
            "broadcast": self.broadcast.seconds / published.broadcast_s - 1,
            "p2p": self.p2p.seconds / published.p2p_s - 1,
        }

    def to_dict(self) -> dict[str, Any]:
        sc, g = self.scenario, self.geometry
        out: dict[str, Any] = {
            "preset": sc.preset,
            "model": sc.model.name,
            "scale": sc.scale,
            "cluster": sc.label(),
            "broadcast_s": round(self.broadcast.seconds, 4),
            "p2p_s": round(self.p2p.seconds, 4),
            "ours_s": round(self.ours.seconds, 4),
            "geometry": {
                "trainer_ranks": g.trainer_ranks,
                "inference_ranks": g.inference_ranks,
                "engines": g.engines,
                "pp_stages": sc.train_pp,
                "sources_per_stage": g.stage_sources,
                "buckets_per_stage": g.buckets_per_stage,
                "shard_bytes": g.shard_bytes,
                "model_wire_bytes": sc.model.wire_bytes,
            },
            "broadcast": self.broadcast.to_dict(),
            "p2p": self.p2p.to_dict(),
            "ours": self.ours.to_dict(),
            "plans": {"miles": self.miles_plan.to_dict(), "ours": self.our_plan.to_dict()},
        }
        if sc.published is not None:
            errors = self.errors() or {}
            out["published"] = {
                "broadcast_s": sc.published.broadcast_s,
                "p2p_s": sc.published.p2p_s,
                "source": sc.published.source,
            }
            out["relative_error"] = {k: round(v, 4) for k, v in errors.items()}
        return out


# --- Geometry and plans ---------------------------------------------------------------------------


def geometry(scenario: Scenario, hw: Hardware) -> Geometry:
    sc, model, gpn = scenario, scenario.model, hw.gpus_per_node
    trainer_ranks = sc.trainer_nodes * gpn
    inference_ranks = sc.inference_nodes * gpn
    if inference_ranks % sc.infer_tp:
        raise ValueError(f"{inference_ranks} inference GPUs do not split into engines of TP{sc.infer_tp}")
    if trainer_ranks % sc.train_pp:
        raise ValueError(f"{trainer_ranks} trainer GPUs do not split into {sc.train_pp} pipeline stages")
    stage_train_bytes = model.train_bytes / sc.train_pp
    buckets = max(1, math.ceil(stage_train_bytes / hw.bucket_bytes))
    bucket_train = stage_train_bytes / buckets
    shard = model.shard_bytes(sc.infer_tp)
    # EP all-gather: the part of the EP group on other nodes comes in over this GPU's share of the NICs
    # (IB, GPUDirect); the rest over NVLink. Non-expert tensors gather over TP inside the node.
    cross = max(0.0, 1 - gpn / sc.train_ep)
    gpu_ib = hw.nic_bytes_per_s * min(1.0, hw.nics_per_node / gpn) * hw.nccl_efficiency
    over_ib = bucket_train * model.expert_fraction * cross / gpu_ib
    over_nvlink = bucket_train * (1 - model.expert_fraction * cross) / (hw.nvlink_gbs * 1e9)
    return Geometry(
        trainer_ranks=trainer_ranks,
        inference_ranks=inference_ranks,
        engines=inference_ranks // sc.infer_tp,
        stage_sources=trainer_ranks // sc.train_pp,
        buckets_per_stage=buckets,
        shard_bytes=shard,
        slice_bytes=shard / sc.train_pp / buckets,
        bucket_wire_bytes=model.wire_bytes / sc.train_pp / buckets,
        gather_s=max(over_ib, over_nvlink),
    )


def stage_spec(scenario: Scenario, hw: Hardware, policy: Literal["balanced", "miles"]) -> WeightSyncGroupSpec:
    """The group one pipeline stage forms: its ranks are the sources, every engine rank a target."""
    g = geometry(scenario, hw)
    gpn = hw.gpus_per_node
    pods, per_pod = (g.stage_sources // gpn, gpn) if g.stage_sources % gpn == 0 else (g.stage_sources, 1)
    tp = scenario.infer_tp
    return WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": pods, "ranksPerPod": per_pod, "template": _TEMPLATE},
            "inference": {
                "engines": g.engines,
                "ranksPerEngine": tp,
                "ranksPerPod": gpn if tp % gpn == 0 else tp,
                "template": _TEMPLATE,
            },
            "transfer": {"planner": policy},
        }
    )


def _facts(plan: Plan, slice_total: float) -> PlanFacts:
    return PlanFacts(
        policy=plan.policy,
        sources=plan.layout.sources,
        targets=plan.layout.targets,
        max_targets_per_source=plan.balance.max_targets_per_source,
        max_shapes_per_source=plan.balance.max_shapes_per_source,
        bytes_per_source=tuple(len(a.targets) * slice_total for a in plan.sources),
    )


def _shape_counts(plan: Plan) -> list[list[int]]:
    """Per source: how many targets each of its replica shapes feeds, in rank order."""
    out: list[list[int]] = []
    for assignment in plan.sources:
        counts: dict[int, int] = {}
        for _, rank in assignment.targets:
            counts[rank] = counts.get(rank, 0) + 1
        out.append([counts[r] for r in sorted(counts)])
    return out


# --- The three modes ------------------------------------------------------------------------------


def _source_write_bw(hw: Hardware) -> float:
    """RDMA bandwidth one source rank gets from its node's NICs (all GPUs of a node are sources)."""
    return hw.nic_bytes_per_s * min(1.0, hw.nics_per_node / hw.gpus_per_node) * hw.rdma_efficiency


def _ingress_per_bucket(scenario: Scenario, hw: Hardware, g: Geometry) -> float:
    """An inference node receives, per bucket period, one slice per local rank from every stage."""
    node_bw = hw.nic_bytes_per_s * hw.nics_per_node * hw.rdma_efficiency
    return hw.gpus_per_node * scenario.train_pp * g.slice_bytes / node_bw


def broadcast(scenario: Scenario, hw: Hardware, g: Geometry) -> ModeResult:
    """Miles/slime ``UpdateWeightFromDistributed``: each stage's head rank broadcasts full tensors to
    every member (every inference rank, or one per engine: ``Scenario.broadcast_receivers``); a global lock
    serialises the stages' buckets (the engines take one update at a time), and each bucket is a lock-step
    ``update_weights_from_distributed`` call on every engine. The collective is NCCL's ring or gloo's
    binomial tree (``Hardware.collective``)."""
    sc = scenario
    members = g.engines if sc.broadcast_receivers == "engine" else g.inference_ranks
    if hw.collective == "binomial":
        # gloo: the sender's link carries every bucket once per child, back to back (period); the last
        # bucket then still has to travel the tree's critical path (binomial_critical_path), spread over
        # the buckets as a per-bucket fill so that the total is (nb - 1) periods + one critical path.
        unit = g.bucket_wire_bytes / (hw.nic_bytes_per_s * hw.nics_per_node * hw.nccl_efficiency)
        children = binomial_children(members + 1)
        sends = len(children[0])
        wire = sends * unit
        last = (binomial_critical_path(children) - sends) * unit
        fill = last / (g.buckets_per_stage * sc.train_pp)
        fill_name, busiest_link = "tree fill", sends * sc.model.wire_bytes
    else:
        ring_bw = min(hw.nic_bytes_per_s * hw.nics_per_node * hw.nccl_efficiency, hw.nvlink_gbs * 1e9)
        gpu_ib = hw.nic_bytes_per_s * min(1.0, hw.nics_per_node / hw.gpus_per_node) * hw.nccl_efficiency
        # One hop per member; a node's first member is reached over IB, its others over NVLink.
        ib_hops = min(sc.inference_nodes, members)
        nvlink_hops = members - ib_hops
        fill = ib_hops * (hw.nccl_chunk_bytes / gpu_ib + hw.ib_hop_latency_s) + nvlink_hops * (
            hw.nccl_chunk_bytes / (hw.nvlink_gbs * 1e9) + hw.nvlink_hop_latency_s
        )
        wire = g.bucket_wire_bytes / ring_bw
        fill_name, busiest_link = "ring fill", sc.model.wire_bytes
    rpc = hw.engine_rpc_s_per_rank * sc.infer_tp
    per_bucket = wire + fill + rpc
    total_buckets = g.buckets_per_stage * sc.train_pp
    serial = total_buckets * per_bucket
    # Other stages gather while one broadcasts; only a stage's own chain can be longer.
    transfer = max(serial + g.gather_s, g.buckets_per_stage * (g.gather_s + per_bucket))
    phases = (
        ("control", hw.control_s),
        ("gather (exposed)", transfer - serial),
        ("wire", total_buckets * wire),
        (fill_name, total_buckets * fill),
        ("engine lock-step", total_buckets * rpc),
    )
    return ModeResult(
        seconds=sum(v for _, v in phases),
        phases=phases,
        total_bytes=sc.model.wire_bytes * members,
        busiest_link_bytes=busiest_link,
        bottleneck="engine lock-step" if rpc >= wire + fill else hw.collective,
    )


def binomial_children(world: int) -> list[list[int]]:
    """Per virtual rank (the root is 0), the ranks it sends to in one ``gloo::broadcast`` (gloo/broadcast.cc):
    in iteration ``i`` every rank with no bit set above ``i`` and bit ``i`` clear sends to ``rank | 2^i``."""
    if world < 1:
        raise ValueError(f"a broadcast group has at least one member, not {world}")
    dim = math.ceil(math.log2(world)) if world > 1 else 0
    children: list[list[int]] = [[] for _ in range(world)]
    for i in range(dim):
        for vrank in range(world):
            if vrank >> (i + 1) or vrank & (1 << i):
                continue
            if (peer := vrank | (1 << i)) < world:
                children[vrank].append(peer)
    return children


def binomial_critical_path(children: list[list[int]]) -> int:
    """When the last member holds one bucket, in whole-bucket transfers over one link. gloo blocks on the
    receive before it queues any send, then queues all its sends at once: a rank forwards only a complete
    bucket, and its children share its link, so they all finish ``len(children)`` transfers after it
    received. Children have higher ranks than their parent, so one pass in rank order suffices."""
    done = [0] * len(children)
    for vrank, kids in enumerate(children):
        for child in kids:
            done[child] = done[vrank] + len(kids)
    return max(done)


def miles_p2p(scenario: Scenario, hw: Hardware, g: Geometry, plan: Plan) -> ModeResult:
    """Miles ``UpdateWeightP2P``: per bucket, gather, then for each replica shape ``load_weights`` into the
    one shared pinned buffer and RDMA-write it to that shape's targets. Non-last shapes wait for their
    writes (the buffer is reused); the last shape's writes overlap the next bucket (notes §1.7).
    With ``Scenario.miles_schedule == "stage_then_write"``: :func:`stage_then_write` instead."""
    if scenario.miles_schedule == "stage_then_write":
        return stage_then_write(scenario, hw, g, plan)
    sc = scenario
    bw = _source_write_bw(hw)
    ingress = _ingress_per_bucket(sc, hw, g)
    load_one = _load_one(hw, g)
    nb = g.buckets_per_stage
    worst = (-1.0, 0.0, 0.0, 0.0, 0.0)  # total, period, load, blocking writes, last write
    for counts in _shape_counts(plan):
        if not counts:
            continue
        load = len(counts) * load_one
        writes = [n * g.slice_bytes / bw for n in counts]
        blocking, last = sum(writes[:-1]), writes[-1]
        # The last shape's writes overlap the next bucket's gather and load, but share the source's NIC with
        # its blocking writes: a period is never shorter than all of a bucket's writes.
        period = max(g.gather_s + load + blocking, blocking + last, ingress)
        if nb * period + last > worst[0]:
            worst = (nb * period + last, period, load, blocking, last)
    _, period, load, blocking, last = worst
    busy = g.gather_s + load + blocking
    phases = (
        ("control", hw.control_s),
        ("gather", nb * g.gather_s),
        ("replica load", nb * load),
        ("blocking writes", nb * blocking),
        ("write overrun", nb * (period - busy) + last),
        ("post-process", sc.model.post_process_s),
    )
    return _p2p_result(sc, g, plan, phases, bottleneck="serial bucket loop")


def stage_then_write(scenario: Scenario, hw: Hardware, g: Geometry, plan: Plan) -> ModeResult:
    """Stage everything, then write: every source gathers and stages all its buckets, and only then runs a
    round, whose buckets are written, received and verified as a pipeline (:func:`_round_stages`). This is
    the testbed's Miles-style way (the Miles planner's targets, our round protocol); the phases ``gather``
    and ``replica load`` are its staging, the ``round: ...`` phases and ``control`` its round."""
    sc = scenario
    load_one = _load_one(hw, g)
    nb = g.buckets_per_stage
    worst: tuple[float, float, float, dict[str, float]] = (-1.0, 0.0, 0.0, {})
    for counts in _shape_counts(plan):
        staging = nb * (g.gather_s + len(counts) * load_one)
        stages = _round_stages(sc, hw, g, counts)
        round_s = (nb - 1) * max(stages.values()) + sum(stages.values())
        if staging + round_s > worst[0]:
            worst = (staging + round_s, staging, round_s, stages)
    _, staging, round_s, stages = worst
    bottleneck = max(stages, key=lambda k: stages[k])
    period = stages[bottleneck]
    phases = (
        ("control", hw.control_s),
        ("gather", nb * g.gather_s),
        ("replica load", staging - nb * g.gather_s),
        (f"round: {bottleneck}", nb * period),
        ("round: fill", round_s - nb * period),
        ("post-process", sc.model.post_process_s),
    )
    return _p2p_result(sc, g, plan, phases, bottleneck=f"staging, then {bottleneck}")


def _load_one(hw: Hardware, g: Geometry) -> float:
    """Staging one bucket's slice into one replica shape: ``load_weights`` plus the copy into host memory."""
    return hw.replica_load_s_per_shape + g.slice_bytes / (hw.d2h_gbs * 1e9)


def _round_stages(sc: Scenario, hw: Hardware, g: Geometry, counts: list[int]) -> dict[str, float]:
    """Per bucket, the stages of our round for a source whose replica shapes feed ``counts`` targets each:
    the transfer, and the target's xxh3 verify. The transfer is one stage, named after its slower end: the
    source's writes (NIC out) or the busiest target node's ingress. They are the same bytes in flight, so
    they bound the period together but the ingress adds no pipeline step of its own."""
    write = sum(counts) * g.slice_bytes / _source_write_bw(hw)
    ingress = _ingress_per_bucket(sc, hw, g)
    return {
        "write" if write >= ingress else "target ingress": max(write, ingress),
        "verify": sc.train_pp * g.slice_bytes / (hw.verify_gbs * 1e9),
    }


def ours(scenario: Scenario, hw: Hardware, g: Geometry, plan: Plan) -> ModeResult:
    """Our pipelined design: one replica per shape (no shared buffer), and the four stages of a bucket —
    all-gather (NIC in / NVLink), staging into the replicas (D2H), RDMA writes (NIC out from host memory)
    and target verification (xxh3) — run on different resources, so bucket ``i+1`` is gathered while
    bucket ``i`` is staged and ``i-1`` written. InfiniBand is full duplex, so the gather (inbound) and
    the writes (outbound) share a NIC without contention."""
    sc = scenario
    load_one = _load_one(hw, g)
    nb = g.buckets_per_stage
    stages: dict[str, float] = {}
    worst = -1.0
    for counts in _shape_counts(plan):
        candidate = {"gather": g.gather_s, "stage": len(counts) * load_one, **_round_stages(sc, hw, g, counts)}
        # This source's time: nb periods of its slowest stage plus one pass through the others.
        own = (nb - 1) * max(candidate.values()) + sum(candidate.values())
        if own > worst:
            stages, worst = candidate, own
    bottleneck = max(stages, key=lambda k: stages[k])
    period = stages[bottleneck]
    phases = (
        ("control", hw.control_s),
        (f"pipeline ({bottleneck}-bound)", nb * period),
        ("pipeline fill", sum(stages.values()) - period),
        ("post-process", sc.model.post_process_s),
    )
    return _p2p_result(sc, g, plan, phases, bottleneck=bottleneck)


def _p2p_result(
    sc: Scenario, g: Geometry, plan: Plan, phases: tuple[tuple[str, float], ...], *, bottleneck: str
) -> ModeResult:
    stage_slice = g.shard_bytes / sc.train_pp
    source_bytes = max(len(a.targets) for a in plan.sources) * stage_slice
    return ModeResult(
        seconds=sum(v for _, v in phases),
        phases=phases,
        total_bytes=sum(len(a.targets) for a in plan.sources) * stage_slice * sc.train_pp,
        busiest_link_bytes=max(source_bytes, g.shard_bytes),
        bottleneck=bottleneck,
    )


def simulate(scenario: Scenario, hw: Hardware) -> Simulation:
    """Model one sync of ``scenario`` on ``hw`` in all three modes."""
    hw.check()
    g = geometry(scenario, hw)
    miles_plan = plan_for(stage_spec(scenario, hw, "miles"))
    our_plan = plan_for(stage_spec(scenario, hw, "balanced"))
    stage_slice = g.shard_bytes / scenario.train_pp
    return Simulation(
        scenario=scenario,
        hardware=hw,
        geometry=g,
        broadcast=broadcast(scenario, hw, g),
        p2p=miles_p2p(scenario, hw, g, miles_plan),
        ours=ours(scenario, hw, g, our_plan),
        miles_plan=_facts(miles_plan, stage_slice),
        our_plan=_facts(our_plan, stage_slice),
    )
