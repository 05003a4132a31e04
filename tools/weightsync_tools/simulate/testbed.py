"""The timing model applied to the emulated testbed (``weightsync bench``, docs/testbed.md).

The same functions as for the published clusters (:mod:`weightsync_tools.simulate.model`), fed with the
testbed's links, sizes and constants:

- every node is one rank with one full-duplex link capped at ``rate`` bits/s per direction (tc tbf), so
  ``gpus_per_node = nics_per_node = 1``;
- the broadcast is gloo's binomial tree with one member per engine process (``collective = "binomial"``,
  ``broadcast_receivers = "engine"``);
- the reference engine replicates the embedding and LM head on every rank (``replicated_bytes``);
- the Miles-style way stages everything, then runs a round (``miles_schedule = "stage_then_write"``);
- a trainer node in an HSDP shard group of ``gather_shards`` nodes receives ``(S-1)/S`` of every tensor
  over its own inbound link before staging it: the model's cross-node all-gather with ``EP = S`` and one
  rank per node.

:data:`TESTBED` holds the constants fitted to scenario A and the engine sweep only (docs/simulator.md,
"Checked against the testbed"); scenario B is a prediction from them. :func:`predict` is what the bench
calls to print the model next to its measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

from weightsync_tools.simulate.hardware import Hardware
from weightsync_tools.simulate.model import broadcast, geometry, simulate
from weightsync_tools.simulate.models import ModelSpec
from weightsync_tools.simulate.scenario import Scenario

MiB = 1 << 20

TESTBED = Hardware(
    gpus_per_node=1,
    nics_per_node=1,
    nic_gbps=1.0,  # set per run from the cap (predict's rate_bits)
    rdma_efficiency=0.925,
    nccl_efficiency=0.953,
    collective="binomial",
    # No intra-node gather: a rank's own share of its shard group is already in its process's memory.
    nvlink_gbs=1e6,
    d2h_gbs=1.25,
    verify_gbs=25.0,
    control_s=0.04,
    engine_rpc_s_per_rank=0.0,
    replica_load_s_per_shape=0.0,
    bucket_bytes=64 * MiB,
)
"""The testbed's constants (docs/simulator.md, "Checked against the testbed", says where each comes from).

Fitted (:func:`p2p_fit_error`, :func:`broadcast_fit_error`): ``rdma_efficiency`` and ``control_s`` jointly to
the p2p rounds of scenario A and the sweep (Mooncake's TCP share of a capped link, per-bucket costs
folded in; a live round's HTTP around the writes), then ``nccl_efficiency`` to scenario A's broadcast
(gloo's share, also used for the emulated gather's plain TCP). Measured: ``d2h_gbs``, the staging
``memcpy`` into ``/dev/shm`` per rank with 8 ranks on 2 cores; ``verify_gbs``, xxh3 on one core here."""

#: The staged commit's copy, staging area over live weights (``rank_memory.promote``): torch ``copy_`` of one TP-2
#: rank of the 512 MiB model (272 MiB) on one core here, 10.0 GB/s (measured, not fitted). Each engine process
#: copies its ranks one after the other; the engines share the machine's cores.
PROMOTE_GBS = 10.0
TESTBED_CORES = 2

#: The two reference-model sizes the bench uses: ``model_shape(512)`` and ``model_shape(152)`` (the sweep);
#: 32 MiB of each is the embedding and LM head (vocab 4096 x hidden 1024 x 4 bytes, twice).
REPLICATED_BYTES = 32 * MiB


Way = Literal[
    "broadcast_s",
    "p2p_s",
    "miles_style_staging_s",
    "miles_style_s",
    "ours_s",
    "miles_pause_s",
    "minimal_pause_s",
    "overlap_pause_s",
    "staged_pause_s",
]
WAYS: tuple[Way, ...] = get_args(Way)
"""What the testbed times: broadcast's round (the sender's), a p2p round over staged replicas (scenario A),
the Miles-style way's staging and its stage-to-commit, and ours' stage-to-commit (scenario B); and how long each
way of scenario B keeps the engines paused (``transfer.pause``: Miles-style's round, ours ``minimal`` and
``overlap``, and a staged-target round's commit)."""


BENCH_WAYS: dict[str, Way] = {"broadcast": "broadcast_s", "p2p": "p2p_s", "miles": "miles_style_s", "ours": "ours_s"}
#: The bench's ways whose ``pause_s`` a pause prediction models.
BENCH_PAUSES: dict[str, Way] = {
    "miles": "miles_pause_s",
    "ours_minimal": "minimal_pause_s",
    "ours": "overlap_pause_s",
    "ours_staged": "staged_pause_s",
}


def replicated_from_shard(model_bytes: float, shard_bytes: float, tp: int) -> float:
    """The replicated part, from one rank's shard (its manifest's bytes): ``shard = (model - r) / tp + r``,
    so the bench passes what its engines hold instead of re-deriving which tensors the engine replicates."""
    if tp < 2:
        return 0.0
    replicated = (shard_bytes - model_bytes / tp) * tp / (tp - 1)
    if not -1 <= replicated <= model_bytes + 1:  # a byte of float slack
        raise ValueError(f"a TP{tp} shard of {shard_bytes} bytes does not fit a {model_bytes}-byte model")
    return min(max(replicated, 0.0), float(model_bytes))


@dataclass(frozen=True)
class Measured:
    """A run's documented medians (docs/testbed.md); ``None`` where the way was not run."""

    broadcast_s: float | None = None
    p2p_s: float | None = None
    miles_style_staging_s: float | None = None
    miles_style_s: float | None = None
    ours_s: float | None = None
    miles_pause_s: float | None = None
    minimal_pause_s: float | None = None
    overlap_pause_s: float | None = None
    staged_pause_s: float | None = None
    source: str = "docs/testbed.md"

    def seconds(self, way: Way) -> float | None:
        value: float | None = getattr(self, way)
        return value


@dataclass(frozen=True)
class Prediction:
    """The model's times for one testbed run (:func:`predict`), with where each way's time goes."""

    broadcast_s: float
    """The sender's round. It holds full tensors, so it gathers nothing."""
    p2p_s: float
    """A p2p round over staged replicas (the Miles plan's targets), as scenario A times it."""
    miles_style_staging_s: float
    """Gather and copy everything into the replicas, before the round."""
    miles_style_s: float
    """Staging, then the round."""
    ours_s: float
    """Gather, copy and write as one pipeline (balanced plan, streaming)."""
    miles_pause_s: float
    """Miles-style pauses the engines for its round alone (the staging went before, while they served)."""
    minimal_pause_s: float
    """``pause: minimal``: the same, for ours: stage while the engines serve, pause for the writes."""
    overlap_pause_s: float
    """``pause: overlap``: from the first streamed write (once one bucket is gathered and copied) to the commit."""
    staged_pause_s: float
    """A staged-target round: only its commit, which copies each rank's staging area over its live weights."""
    ours_bottleneck: str
    phases: dict[str, dict[str, float]]

    def seconds(self, way: Way) -> float:
        value: float = getattr(self, way)
        return value

    def pauses_by_bench_way(self) -> dict[str, float]:
        """The pause predictions, keyed by the bench's way whose ``pause_s`` each models."""
        return {bench: round(self.seconds(way), 4) for bench, way in BENCH_PAUSES.items()}

    def by_bench_way(self) -> dict[str, float]:
        """Keyed as the bench's reports name their ways: scenario A's ``p2p`` and ``broadcast``, scenario B's
        ``broadcast``, ``miles`` and ``ours`` (``weightsync_tools.testbed.three_ways.WAYS``)."""
        return {bench: round(self.seconds(way), 4) for bench, way in BENCH_WAYS.items()}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {way: round(self.seconds(way), 4) for way in WAYS}
        out["ours_bottleneck"] = self.ours_bottleneck
        out["phases"] = {way: {k: round(v, 4) for k, v in p.items()} for way, p in self.phases.items()}
        return out


@dataclass(frozen=True)
class BenchRun:
    """One testbed configuration: what :func:`predict` takes, plus what was measured, if documented."""

    name: str
    trainers: int
    engines: int
    tp: int
    model_bytes: int
    rate_bits: int
    gather_shards: int = 1
    replicated_bytes: int = REPLICATED_BYTES
    bucket_bytes: int = 64 * MiB
    p2p_bucket_bytes: int | None = None
    """The p2p ways' bucket where it differs (scenario B: 16 MiB, docs/testbed.md)."""
    measured: Measured | None = None
    fitted: bool = False
    """Whether :data:`TESTBED`'s constants were fitted to this run (else its numbers are a prediction)."""

    def predict(self, hw: Hardware = TESTBED) -> Prediction:
        return predict(
            layout=(self.trainers, self.engines, self.tp),
            model_bytes=self.model_bytes,
            replicated_bytes=self.replicated_bytes,
            rate_bits=self.rate_bits,
            bucket_bytes=self.bucket_bytes,
            gather_shards=self.gather_shards,
            hw=hw,
            p2p_bucket_bytes=self.p2p_bucket_bytes,
        )


def scenario(layout: tuple[int, int, int], model_bytes: float, replicated_bytes: float, gather_shards: int) -> Scenario:
    """The testbed as a :class:`Scenario`: one rank per node, float32 everywhere, no pipeline stages."""
    trainers, engines, tp = layout
    if gather_shards < 1:
        raise ValueError(f"gather shards must be at least 1, got {gather_shards}")
    model = ModelSpec(
        name=f"reference model {model_bytes / MiB:.0f} MiB (float32)",
        params=model_bytes / 4,
        wire_bytes=model_bytes,
        train_bytes_per_param=4.0,
        expert_fraction=1.0,  # HSDP shards every tensor, so every tensor is gathered
        layers=0,
        experts=0,
        dtype="float32",
        replicated_bytes=replicated_bytes,
        source="weightsync_testing.reference_engine.model (full_shapes)",
    )
    return Scenario(
        preset=f"testbed {trainers}->{engines}xTP{tp}",
        model=model,
        trainer_nodes=trainers,
        inference_nodes=engines * tp,
        train_tp=1,
        train_pp=1,
        train_cp=1,
        train_ep=gather_shards,
        infer_tp=tp,
        broadcast_receivers="engine",
        miles_schedule="stage_then_write",
    )


def predict(
    *,
    layout: tuple[int, int, int],
    model_bytes: float,
    replicated_bytes: float,
    rate_bits: float,
    bucket_bytes: float = 64 * MiB,
    gather_shards: int = 1,
    hw: Hardware = TESTBED,
    p2p_bucket_bytes: float | None = None,
) -> Prediction:
    """The model's times for one testbed run: ``layout = (trainer nodes, engines, TP)``, the reference
    model's bytes and the part of them every rank holds whole, the link cap in bits/s, the bucket size (the
    p2p ways' own where ``p2p_bucket_bytes`` is given, as scenario B runs them), and the trainer's shard group
    (1: no gather)."""
    tb = hw.with_overrides(nic_gbps=rate_bits / 1e9, bucket_bytes=p2p_bucket_bytes or bucket_bytes)
    sim = simulate(scenario(layout, model_bytes, replicated_bytes, gather_shards), tb)
    sender = scenario(layout, model_bytes, replicated_bytes, 1)
    tb_broadcast = hw.with_overrides(nic_gbps=rate_bits / 1e9, bucket_bytes=bucket_bytes)
    bcast = broadcast(sender, tb_broadcast, geometry(sender, tb_broadcast))
    miles = dict(sim.p2p.phases)
    # stage_then_write's phases: staging (gather, replica load), then the round (control, round: ...).
    staging = miles["gather"] + miles["replica load"]
    round_s = sum(v for k, v in miles.items() if k not in ("gather", "replica load"))
    _trainers, engines, tp = layout
    first_bucket = p2p_bucket_bytes or bucket_bytes
    # One bucket gathered from the shard group over the node's link, then copied into the replica.
    first_write = first_bucket * (gather_shards - 1) / gather_shards * 8 / rate_bits + first_bucket / (hw.d2h_gbs * 1e9)
    shard = (model_bytes - replicated_bytes) / tp + replicated_bytes
    promote = engines * tp * shard / (PROMOTE_GBS * 1e9 * min(TESTBED_CORES, engines))
    return Prediction(
        broadcast_s=bcast.seconds,
        p2p_s=round_s,
        miles_style_staging_s=staging,
        miles_style_s=sim.p2p.seconds,
        ours_s=sim.ours.seconds,
        miles_pause_s=round_s,
        minimal_pause_s=round_s,
        overlap_pause_s=sim.ours.seconds - first_write,
        staged_pause_s=hw.control_s + promote,
        ours_bottleneck=sim.ours.bottleneck,
        phases={"broadcast": dict(bcast.phases), "miles_style": miles, "ours": dict(sim.ours.phases)},
    )


@dataclass(frozen=True)
class Row:
    way: Way
    modelled: float
    measured: float | None

    @property
    def error(self) -> float | None:
        return None if self.measured is None else self.modelled / self.measured - 1


def compare(run: BenchRun, hw: Hardware = TESTBED) -> list[Row]:
    """Modelled against measured, for every way the model gives."""
    modelled = run.predict(hw)
    return [Row(way, modelled.seconds(way), run.measured.seconds(way) if run.measured else None) for way in WAYS]


_A = BenchRun(
    "A",
    trainers=4,
    engines=2,
    tp=2,
    model_bytes=512 * MiB,
    rate_bits=10**9,
    # One run of 5 rounds; three others gave p2p 2.47-2.50 s and broadcast 9.05-9.09 s.
    measured=Measured(broadcast_s=9.053, p2p_s=2.473),
    fitted=True,
)
_B = BenchRun("B", trainers=8, engines=4, tp=2, model_bytes=512 * MiB, rate_bits=500 * 10**6, gather_shards=2)
#: Scenario B with the trainer's gather (shard groups of 2) and 8 MiB p2p buckets: the medians of 3 runs of 5 rounds
#: per way (``weightsync bench --scenario B``, docs/testbed.md), each way's time and how long it paused the engines.
_B_MEASURED = Measured(
    broadcast_s=27.485,
    miles_style_s=9.111,
    miles_style_staging_s=4.333,
    ours_s=5.106,
    miles_pause_s=4.714,
    minimal_pause_s=4.698,
    overlap_pause_s=4.932,
    staged_pause_s=0.1456,
)
TESTBED_RUNS: dict[str, BenchRun] = {
    "A": _A,
    # Scenario B as measured before the gather was emulated (streaming wired in, a quiet machine).
    "B-no-gather": replace(
        _B,
        name="B-no-gather",
        gather_shards=1,
        measured=Measured(
            broadcast_s=28.532, p2p_s=4.874, miles_style_s=5.140, miles_style_staging_s=0.229, ours_s=4.978
        ),
    ),
    # Scenario B with the trainer's gather (shard groups of 2), as the bench runs it now.
    "B": replace(_B, p2p_bucket_bytes=8 * MiB, measured=_B_MEASURED),
}

#: The engine sweep of docs/testbed.md (152 MiB model, 4 trainer nodes, N engines x TP2, 1 Gbit/s, one round
#: per mode and point): ``N -> (p2p round s, broadcast s)``.
SWEEP_MEASURED: dict[int, tuple[float, float]] = {
    1: (0.86, 1.60),
    2: (0.89, 2.77),
    3: (1.69, 3.52),
    4: (1.71, 4.58),
    5: (2.54, 5.67),
    6: (2.56, 5.39),
    7: (3.37, 5.66),
    8: (3.44, 7.11),
}


def sweep_run(engines: int) -> BenchRun:
    p2p, bcast = SWEEP_MEASURED[engines]
    return BenchRun(
        f"sweep {engines}",
        trainers=4,
        engines=engines,
        tp=2,
        model_bytes=152 * MiB,
        rate_bits=10**9,
        measured=Measured(broadcast_s=bcast, p2p_s=p2p),
        fitted=True,
    )


def fit_runs() -> tuple[BenchRun, ...]:
    """What :data:`TESTBED` was fitted to: scenario A and the sweep, never scenario B."""
    return (TESTBED_RUNS["A"], *(sweep_run(n) for n in sorted(SWEEP_MEASURED)))


def _errors(runs: tuple[BenchRun, ...], way: Way, hw: Hardware) -> list[float]:
    return [abs(row.error) for run in runs for row in compare(run, hw) if row.way == way and row.error is not None]


def p2p_fit_error(hw: Hardware = TESTBED) -> float:
    """The worst relative error of the modelled p2p round over :func:`fit_runs`: what ``rdma_efficiency``
    and ``control_s`` minimise (a grid search, steps 0.005 and 0.01 s)."""
    return max(_errors(fit_runs(), "p2p_s", hw))


def broadcast_fit_error(hw: Hardware = TESTBED) -> float:
    """The relative error of scenario A's modelled broadcast: what ``nccl_efficiency`` zeroes (step 0.001).
    The sweep's broadcast is not fitted: beyond 2 engines the 2 cores, not the links, bound it."""
    return max(_errors((TESTBED_RUNS["A"],), "broadcast_s", hw))
