"""Which versions the coordinator may adopt: forward only, and never too far forward.

Versions only move forward (docs/agent.md, "Versions only move forward"), so a committed version refuses every
version up to it for good. Without a bound on how far a version may jump, one publish of 2^53 - 1 (a bug, or a
trainer's code gone wrong: a one-rank trainer is its own quorum) would lock the group out of every later version.
So a version is adopted only within ``transfer.maxVersionStep`` of the committed one, or of 0 while nothing is
committed, and the same bound keeps the committed version this coordinator's pod reported (a floor after a restart)
from lifting the engines' own word by more.
"""

from __future__ import annotations


def version_refusal(version: int, committed: int | None, max_step: int) -> str | None:
    """Why a round of ``version`` may not run after ``committed`` (None: nothing committed yet), or None."""
    if committed is not None and version <= committed:
        return f"version {version} is not newer than committed {committed}"
    base = 0 if committed is None else committed
    if version - base > max_step:
        after = f"committed {committed}" if committed is not None else "0 (no version is committed yet)"
        return (
            f"version {version} is more than transfer.maxVersionStep ({max_step}) past {after}: versions only move "
            f"forward, so it would refuse every version up to it; publish at most {base + max_step}, or raise "
            "spec.transfer.maxVersionStep"
        )
    return None


def credible_floor(floor: int, held: int | None, max_step: int) -> bool:
    """Whether ``floor`` (the committed version the coordinator's pod reported) may lift ``held`` (the newest version
    any engine holds; None: none holds one, e.g. all restarted, and the floor is all there is).

    An engine holds a version only after a verified commit, and the floor is a version the coordinator committed, so
    the two differ by the engines that restarted since: a few rounds, not more than one round may jump."""
    return held is None or floor - held <= max_step
