"""Can the group's engine adapter do what its ``transfer`` asks? Pure.

A spec the API server accepts can still ask for something its ``inference.adapter`` cannot do (an
adapter this version lacks, a sync mode or staging it does not support, verification it cannot do).
Such a group would get pods whose agents never turn ready; instead it is refused with a fatal
``Problem`` (phase ``Failed``) whose reason is the contract's (``UnknownAdapter``,
``AdapterUnavailable``, ``AdapterLacksCapability``) and whose message names the adapter and the
capability. The contract itself is ``weightsync.api.engines``.
"""

from __future__ import annotations

from weightsync.api.engines import refusal
from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_operator.status import Problem


def capability_problem(spec: WeightSyncGroupSpec) -> Problem | None:
    """None when the adapter can serve the spec; else a fatal problem that says why not."""
    refused = refusal(spec.inference.adapter, spec.transfer.request)
    return Problem(refused.reason, refused.message) if refused is not None else None


__all__ = ["capability_problem"]
