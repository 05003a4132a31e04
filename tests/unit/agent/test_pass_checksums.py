"""One engine checksum call per verify pass, never an earlier pass's answer for a retry (targets/pass_checksums.py)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from hypothesis import given
from hypothesis import strategies as st

from weightsync_agent.targets.pass_checksums import PassChecksums


def counting() -> tuple[PassChecksums[int], Callable[[], int], list[int]]:
    """A fresh cache, an engine call answering 1, 2, 3, ... and the answers it gave."""
    asked: list[int] = []
    counter = itertools.count(1)

    def ask() -> int:
        asked.append(next(counter))
        return asked[-1]

    return PassChecksums(), ask, asked


def test_every_rank_of_a_pass_reads_one_answer_and_a_retry_asks_again() -> None:
    sums, ask, asked = counting()
    assert [sums.for_rank(7, rank, ask) for rank in (0, 1, 2)] == [1, 1, 1]  # one pass, one call
    assert [sums.for_rank(7, rank, ask) for rank in (0, 1, 2)] == [2, 2, 2]  # the retry's pass: a new call
    assert sums.for_rank(8, 0, ask) == 3  # another version
    assert asked == [1, 2, 3]


def test_holds_only_the_version_last_asked_and_forget_drops_it() -> None:
    sums, ask, _ = counting()
    assert not sums.holds(1)
    sums.for_rank(1, 0, ask)
    assert sums.holds(1) and not sums.holds(2)
    sums.forget()
    assert not sums.holds(1)


@given(st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_a_rank_never_reads_the_same_answer_twice(ranks: list[int]) -> None:
    sums, ask, asked = counting()
    read: dict[int, set[int]] = {}
    for rank in ranks:
        answer = sums.for_rank(1, rank, ask)
        assert answer not in read.setdefault(rank, set())
        read[rank].add(answer)
    # and no more calls than needed: a new one only when a rank comes back within the current pass
    passes, seen = 1, set()
    for rank in ranks:
        if rank in seen:
            passes, seen = passes + 1, set()
        seen.add(rank)
    assert len(asked) == passes
