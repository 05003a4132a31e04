"""How a stock SGLang server splits its weights over its ranks, from its ``/server_info``: which way a rank's
manifest is built.

The trace (``weightsync_engine/sglang/trace_model.py``) follows tensor parallelism only. With expert parallelism
(``--ep-size``) the experts are split by expert, not by row, and with DP attention (``--enable-dp-attention
--dp-size``) the attention weights are split over ``tp / dp`` ranks: a TP-only cut would then put other bytes at the
same sizes (Qwen3-MoE's experts at TP 2 and EP 2 hold as many elements either way), which SGLang's checker would hash
as sent and pass. Those ranks go through the engine replica, which builds SGLang's own model with the server's
parallelism.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightsync_agent.layout.manifest import ManifestError

#: The most ranks of any kind a server may report (a bound on what /server_info says).
MAX_RANKS = 4096


@dataclass(frozen=True)
class Parallelism:
    """A server's TP size, EP size and DP attention's DP size (1: none)."""

    tp: int = 1
    ep: int = 1
    dp: int = 1

    @classmethod
    def of(cls, server_info: Mapping[str, Any], who: str) -> Parallelism:
        """From SGLang's ``/server_info`` (its server args); ManifestError for what weightsync cannot sync."""
        tp, ep, replicas = (_size(server_info, key, who) for key in ("tp_size", "ep_size", "dp_size"))
        attention = bool(server_info.get("enable_dp_attention"))
        # SGLang 0.5.23 reports DP attention's size as attn_dp_size (dp_size stays 1); earlier versions as dp_size.
        if "attn_dp_size" in server_info:
            dp = _size(server_info, "attn_dp_size", who) if attention else 1
        else:
            dp, replicas = (replicas, 1) if attention else (1, replicas)
        if replicas > 1:
            raise ManifestError(
                f"{who}: SGLang serves {replicas} data-parallel replicas in one server (--dp-size {replicas} without "
                "--enable-dp-attention); weightsync syncs one TP group per engine: run one engine per replica"
            )
        if tp % dp:
            raise ManifestError(f"{who}: DP attention's DP size {dp} does not divide the TP size {tp}")
        if tp % ep:
            raise ManifestError(f"{who}: the EP size {ep} does not divide the TP size {tp}")
        return cls(tp=tp, ep=ep, dp=dp)

    @property
    def traced(self) -> bool:
        """Whether the trace's TP-only shard map describes the ranks (else: the engine replica)."""
        return self.ep == 1 and self.dp == 1

    def __str__(self) -> str:
        extra = [f"EP {self.ep}"] * (self.ep > 1) + [f"DP attention {self.dp}"] * (self.dp > 1)
        return ", ".join([f"TP {self.tp}", *extra])


def _size(server_info: Mapping[str, Any], key: str, who: str) -> int:
    value = server_info.get(key)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RANKS:
        raise ManifestError(f"{who}: /server_info's {key} is {value!r}, not a size from 1 to {MAX_RANKS}")
    return value
