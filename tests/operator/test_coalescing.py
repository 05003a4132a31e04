"""How the handlers schedule reconciles of one group: a storm of pod events costs about one reconcile per status
interval, the last event is always followed by a reconcile (so the final state is written), and a change of the
group itself is reconciled at once, without waiting for the pods. The reconciler is a stand-in that records when
it ran: this is scheduling logic only; the real reconciler runs in test_handlers_kmock.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from weightsync_operator.apply import Result
from weightsync_operator.config import OperatorConfig
from weightsync_operator.handlers import Operator

KEY = ("ml", "g")
BODY = {"metadata": {"name": "g", "namespace": "ml", "uid": "u"}}


class Recorder:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.runs: list[tuple[float, float]] = []

    async def reconcile(self, body: Any) -> Result:
        started = time.monotonic()
        await asyncio.sleep(self.seconds)
        self.runs.append((started, time.monotonic()))
        return Result(phase="Provisioning")

    def forget(self, uid: str) -> None:
        pass


def operator(interval: float, reconcile_seconds: float) -> tuple[Operator, Recorder]:
    op = Operator()
    op.config = OperatorConfig(status_interval=interval)
    op.index = {KEY: [BODY]}
    recorder = Recorder(reconcile_seconds)
    op.reconciler = recorder  # type: ignore[assignment]
    return op, recorder


async def test_a_storm_of_pod_events_costs_one_reconcile_per_interval_and_the_last_is_never_lost() -> None:
    op, recorder = operator(interval=0.2, reconcile_seconds=0.02)
    started = time.monotonic()
    last_event = started
    while time.monotonic() - started < 1.0:  # 1 s of pod events, up to 500 per second
        op.request(KEY)
        last_event = time.monotonic()
        await asyncio.sleep(0.002)
    await asyncio.sleep(0.5)
    assert 3 <= len(recorder.runs) <= 7  # ~1 s / 0.2 s, not hundreds
    gaps = [b[0] - a[1] for a, b in zip(recorder.runs, recorder.runs[1:], strict=False)]
    assert all(gap >= 0.19 for gap in gaps), gaps
    assert recorder.runs[-1][0] >= last_event  # a reconcile started after the last event: it saw its state


async def test_a_change_of_the_group_is_reconciled_at_once_and_does_not_wait_for_the_pods() -> None:
    op, recorder = operator(interval=0.3, reconcile_seconds=0.05)

    async def events() -> None:
        for _ in range(50):
            op.request(KEY)
            await asyncio.sleep(0.005)

    storm = asyncio.create_task(events())
    await asyncio.sleep(0.01)
    asked = time.monotonic()
    await op.reconcile_now(KEY, BODY)
    returned = time.monotonic() - asked
    # It waited at most for the reconcile in flight (and its own), not for the pod events' follow-ups.
    assert returned < 0.3, returned
    await storm
    await asyncio.sleep(0.8)
    assert recorder.runs[-1][0] > asked  # the events' follow-up still ran
    assert not op.pending
