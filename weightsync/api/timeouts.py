"""Every timeout of a sync, each with one job, derived from ``spec.transfer.timeoutSeconds`` (pure).

| timeout | bounds |
|---|---|
| ``round_budget`` | a whole round: writes, verification, commit (a round over it is aborted) |
| ``peer_stall`` | one transport peer that stops making progress mid-write (Mooncake, memory) |
| ``http_call`` | one HTTP call to an engine or another agent (pause, begin, verify, commit, manifests) |
| ``collective`` | forming the broadcast group, and each collective on it |

docs/architecture.md ("Timeouts") is this table for users.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

#: One HTTP call: long enough for a verify over a big rank, short enough that a hung engine is noticed.
HTTP_CALL_SECONDS: Final = 30.0


@dataclass(frozen=True)
class Timeouts:
    round_budget: float
    peer_stall: float
    http_call: float
    collective: float

    @classmethod
    def of(cls, timeout_seconds: float, *, http_call: float = HTTP_CALL_SECONDS) -> Timeouts:
        budget = float(timeout_seconds)
        # A peer silent for the whole budget cannot finish in it anyway; the collective likewise.
        return cls(round_budget=budget, peer_stall=budget, http_call=http_call, collective=budget)
