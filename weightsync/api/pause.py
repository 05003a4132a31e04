"""When a round pauses its engines (``transfer.pause``): the round scheduler's decision, spelled once. Pure.

For RL the engines' pause is the cost users see: while an engine is paused, rollouts stall. A streamed version
(``WeightSyncClient.stream``) can have its buckets written while the trainer still stages (gathers, copies) the
rest; into **live** targets that means the engines are paused from the first write, so they also wait through the
staging. Two ways to run such a round:

- ``overlap``: write while staging. The shortest stage-to-commit time; the engines pause for staging and writing.
- ``minimal``: stage while the engines serve, pause only for the write (and its verify and commit). Stage-to-commit
  is staging plus writing, as for a version staged first and then published.

**Staged** targets (a staging area: the reference engine in staged mode, vLLM's receive buffer) get both whatever
the policy: sources write the staging area while the engines serve, streaming as the trainer stages, and the engines
pause only to apply. A version that is staged first and then published (no stream) pauses for the write alone under
either policy. Both the coordinator (what it records) and every source (when it says it can write) read this from
the same plan, whose hash they compare.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, get_args

from weightsync.api.engines import Staging

PausePolicy = Literal["minimal", "overlap"]
PAUSE_POLICIES: Final[tuple[PausePolicy, ...]] = get_args(PausePolicy)


@dataclass(frozen=True)
class RoundSchedule:
    """How one round runs, for its engines' staging and the spec's policy."""

    #: What the round's record says ran: ``minimal`` when the engines are paused for no staging time.
    policy: PausePolicy
    #: The engines are paused around the writes (live targets: sources write into the served weights).
    pause_engines: bool
    #: A streamed source says it can write once each target's first bucket is staged and writes the rest as it is
    #: staged; otherwise only once every bucket of its targets is staged.
    write_while_staging: bool


def round_schedule(staging: Staging, policy: PausePolicy) -> RoundSchedule:
    """The schedule of a round into ``staging`` targets under ``transfer.pause: policy``."""
    if staging == "staged":  # the writes land in a staging area: overlap costs no pause, so have both
        return RoundSchedule(policy="minimal", pause_engines=False, write_while_staging=True)
    if policy == "overlap":
        return RoundSchedule(policy="overlap", pause_engines=True, write_while_staging=True)
    return RoundSchedule(policy="minimal", pause_engines=True, write_while_staging=False)
