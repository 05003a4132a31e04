"""Hardware constants of the timing model, each with where it comes from.

Two kinds of constants live here:

- **specified**: vendor data sheets or numbers measured in this repository (docs/replica.md);
- **calibrated**: effective costs that nothing published states, fitted once, jointly, to the six
  published Miles/SGLang numbers (shared notes §1.10; see ``docs/simulator.md``). There are three:
  ``engine_rpc_s_per_rank``, ``replica_load_s_per_shape`` and ``nccl_efficiency``.

Bandwidths are in bytes per second (GB = 1e9 bytes), times in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Literal

GB = 1e9

Collective = Literal["ring", "binomial"]


@dataclass(frozen=True)
class Hardware:
    # --- Node ------------------------------------------------------------------------------------
    gpus_per_node: int = 8
    """H100 HGX/DGX: 8 GPUs per host (notes §1.10: "H100 8-GPU hosts")."""
    nics_per_node: int = 8
    """DGX H100: 8 ConnectX-7 for the compute fabric, one per GPU (NVIDIA DGX H100 user guide)."""
    nic_gbps: float = 400.0
    """ConnectX-7 NDR InfiniBand, 400 Gb/s per port (NVIDIA data sheet; notes §3: "400 Gbps peak")."""

    # --- Efficiencies of the fabric --------------------------------------------------------------
    rdma_efficiency: float = 0.475
    """Mooncake Transfer Engine: 190 GB/s on 8x400 Gb/s RoCE = 47.5% of line rate (Mooncake README,
    notes §0 and §5). One-sided writes from the pinned CPU replica."""
    nccl_efficiency: float = 0.92
    """Calibrated (NCCL collectives over IB as a fraction of line rate); 0.9-0.95 is what nccl-tests
    bus bandwidth reaches on 400G IB at GB-sized messages."""

    collective: Collective = "ring"
    """How the broadcast moves a bucket. ``ring``: NCCL's pipelined ring, every member sends and receives the
    bucket once, in chunks. ``binomial``: gloo's ``broadcast`` (gloo/broadcast.cc), a binomial tree of
    whole-message sends, store-and-forward: the sender sends each bucket ``ceil(log2 W)`` times for a group
    of ``W``, one tree round after the other."""

    # --- Intra-node links ------------------------------------------------------------------------
    nvlink_gbs: float = 450.0
    """H100 SXM NVLink 4: 900 GB/s bidirectional, 450 GB/s per direction (NVIDIA H100 data sheet)."""
    d2h_gbs: float = 54.0
    """GPU -> pinned host copy: PCIe Gen5 x16 is 64 GB/s per direction; measured 54 GB/s (docs/replica.md,
    "stage from GPU into the replica (D2H), 1 GiB bf16", H200)."""
    verify_gbs: float = 25.0
    """xxh3-64 over received bytes, one core per rank: about 25 GB/s (docs/replica.md, measured)."""

    # --- NCCL ring pipeline ----------------------------------------------------------------------
    nccl_chunk_bytes: float = 512 * 1024
    """A ring step moves one chunk: NCCL_BUFFSIZE 4 MiB / NCCL_STEPS 8 (NCCL defaults)."""
    ib_hop_latency_s: float = 5e-6
    """Per inter-node ring step: IB latency plus NCCL proxy overhead, a few microseconds (assumed)."""
    nvlink_hop_latency_s: float = 1e-6
    """Per intra-node ring step over NVLink (assumed)."""

    # --- Fixed and per-unit overheads ------------------------------------------------------------
    control_s: float = 0.25
    """Pause, flush_cache, begin/end_weight_update, version, continue: a handful of HTTP round trips to
    every engine (assumed; the Miles docs time the update without the request-abort time, notes §1.2)."""
    engine_rpc_s_per_rank: float = 0.7e-3
    """Calibrated. Broadcast only: every bucket is an ``update_weights_from_distributed`` call on every
    engine, whose ranks receive, run ``load_weights`` over full tensors and step together before the
    trainer may send the next bucket (lock-step, notes §1.3). Cost per bucket per engine rank (TP)."""
    replica_load_s_per_shape: float = 7e-3
    """Calibrated. P2P only: ``load_weights`` of one bucket into one CPU replica shape (HF tensors
    re-sharded by the engine's own loaders, notes §1.4/§1.7), per bucket per shape, on top of the D2H
    copy of the slice."""
    bucket_bytes: float = 1024**3
    """Miles profiling used a 1 GB transfer bucket (notes §1.7: "default 1 GB"), counted on the
    training-dtype tensors before conversion."""

    @property
    def nic_bytes_per_s(self) -> float:
        return self.nic_gbps / 8 * GB

    def with_overrides(self, **changes: Any) -> Hardware:
        """A copy with ``changes`` applied; ``None`` values are ignored (CLI options left unset)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown hardware constants: {', '.join(unknown)}")
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def check(self) -> None:
        positive = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_NUMBERS}
        bad = [name for name, value in positive.items() if value <= 0 and name not in _MAY_BE_ZERO]
        if bad:
            raise ValueError(f"hardware constants must be positive: {', '.join(bad)}")
        if self.rdma_efficiency > 1 or self.nccl_efficiency > 1:
            raise ValueError("efficiencies are fractions of line rate, at most 1")
        if self.collective not in ("ring", "binomial"):
            raise ValueError(f"collective {self.collective!r}: ring or binomial")


_NOT_NUMBERS = frozenset({"collective"})


_MAY_BE_ZERO = frozenset(
    {
        "ib_hop_latency_s",
        "nvlink_hop_latency_s",
        "control_s",
        "engine_rpc_s_per_rank",
        "replica_load_s_per_shape",
    }
)

H100_IB = Hardware()
"""The calibrated constants: H100 8-GPU hosts with 8x400 Gb/s InfiniBand, as in the published runs."""
