"""Long polls on the event loop: waiting for a round's result holds no thread, and the waiters are capped.

Before, each ``GET /v1/rounds/{v}?wait=`` held a thread of the loop's default executor for up to a minute; a
handful of them (six on a two-core node) left no thread for ``/v1/publish``, which then waited behind them.
Now a waiter is a coroutine parked on an :class:`asyncio.Event` that the coordinator pulses when any round
finishes; at most ``limit`` wait at once, one more is refused at once (:class:`TooManyWaitersError`, a 429).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class TooManyWaitersError(RuntimeError):
    """Every long-poll slot is taken: answered 429, the caller retries."""


class Waiters:
    """Parked long polls of one event loop. :meth:`pulse_threadsafe` wakes them all to check again."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit = limit
        self.waiting = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    async def wait(self, check: Callable[[], T | None], seconds: float) -> T | None:
        """``check()``'s first non-None answer, checked now and after every pulse, or None after ``seconds``."""
        if self.waiting >= self.limit:
            raise TooManyWaitersError(f"{self.waiting} long polls are waiting already (the cap); ask again later")
        loop = asyncio.get_running_loop()
        if self._event is None or self._loop is not loop:
            self._loop, self._event = loop, asyncio.Event()
        self.waiting += 1
        try:
            end = loop.time() + seconds
            while True:
                # check() and taking the current event happen in one step of the loop: a pulse from another
                # thread runs on the loop after it, so it sets the event this waiter holds.
                found = check()
                left = end - loop.time()
                if found is not None or left <= 0:
                    return found
                event = self._event
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), left)
        finally:
            self.waiting -= 1

    def pulse_threadsafe(self) -> None:
        """Wake every waiter (from any thread): something they wait for may have happened."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
                loop.call_soon_threadsafe(self._pulse)

    def _pulse(self) -> None:
        old, self._event = self._event, asyncio.Event()
        if old is not None:
            old.set()
