"""Long polls parked on the event loop (sidecar/waiters.py): woken by a pulse from any thread, capped in number."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from weightsync_agent.sidecar.waiters import TooManyWaitersError, Waiters


def test_a_pulse_from_another_thread_wakes_a_waiter_at_once() -> None:
    async def main() -> tuple[object, float]:
        waiters = Waiters(4)
        found: list[str] = []
        start = time.monotonic()

        def finish_later() -> None:
            time.sleep(0.2)
            found.append("done")
            waiters.pulse_threadsafe()

        waiter = asyncio.ensure_future(waiters.wait(lambda: found[0] if found else None, 30))
        await asyncio.sleep(0.05)  # parked, so the waiters know their loop
        threading.Thread(target=finish_later).start()
        return await waiter, time.monotonic() - start

    result, seconds = asyncio.run(main())
    assert result == "done" and seconds < 2


def test_a_waiter_gives_up_after_its_seconds_and_frees_its_slot() -> None:
    async def main() -> tuple[object, float, int]:
        waiters = Waiters(1)
        start = time.monotonic()
        result = await waiters.wait(lambda: None, 0.2)
        return result, time.monotonic() - start, waiters.waiting

    result, seconds, waiting = asyncio.run(main())
    assert result is None and 0.2 <= seconds < 2 and waiting == 0


def test_one_waiter_over_the_cap_is_refused_at_once() -> None:
    async def main() -> None:
        waiters = Waiters(3)
        parked = [asyncio.ensure_future(waiters.wait(lambda: None, 30)) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert waiters.waiting == 3
        with pytest.raises(TooManyWaitersError, match="3 long polls"):
            await waiters.wait(lambda: None, 30)
        for task in parked:
            task.cancel()
        await asyncio.gather(*parked, return_exceptions=True)
        assert waiters.waiting == 0  # cancelled waiters give their slots back
        assert await waiters.wait(lambda: "now", 30) == "now"

    asyncio.run(main())
