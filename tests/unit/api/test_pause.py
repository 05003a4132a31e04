"""The round scheduler's decision (``weightsync.api.pause``): when a round pauses its engines, for every staging and
policy."""

from __future__ import annotations

import itertools

import pytest

from weightsync.api.engines import STAGINGS
from weightsync.api.pause import PAUSE_POLICIES, RoundSchedule, round_schedule
from weightsync.api.v1alpha1 import TransferSpec


def test_live_targets_pause_for_the_writes_alone_under_minimal_and_from_the_first_write_under_overlap() -> None:
    assert round_schedule("live", "minimal") == RoundSchedule("minimal", pause_engines=True, write_while_staging=False)
    assert round_schedule("live", "overlap") == RoundSchedule("overlap", pause_engines=True, write_while_staging=True)


@pytest.mark.parametrize("policy", PAUSE_POLICIES)
def test_staged_targets_have_both_whatever_the_policy(policy: str) -> None:
    """A staging area takes writes while the engines serve: stream into it, never pause for it."""
    schedule = round_schedule("staged", policy)  # type: ignore[arg-type]
    assert schedule == RoundSchedule("minimal", pause_engines=False, write_while_staging=True)


@pytest.mark.parametrize(("staging", "policy"), list(itertools.product(STAGINGS, PAUSE_POLICIES)))
def test_engines_wait_through_staging_only_when_the_round_records_overlap(staging: str, policy: str) -> None:
    """The record never hides a pause that overlapped staging: engines paused while a streamed source still stages
    exactly when the round records overlap."""
    schedule = round_schedule(staging, policy)  # type: ignore[arg-type]
    assert (schedule.pause_engines and schedule.write_while_staging) == (schedule.policy == "overlap")


def test_the_spec_defaults_to_minimal_and_refuses_other_policies() -> None:
    assert TransferSpec().pause == "minimal"
    assert TransferSpec.model_validate({"pause": "overlap"}).pause == "overlap"
    with pytest.raises(ValueError, match="pause"):
        TransferSpec.model_validate({"pause": "never"})
