"""An engine's own checksums of every rank, asked once per verify pass.

Stock engines hash all their ranks in one call (SGLang's ``/weights_checker``, vLLM's ``/weight_checker``), while the
driver verifies rank by rank. So one answer serves every rank of a pass, but a pass must never be answered from an
earlier one: a live round that failed its verification writes again and verifies again (the driver's retries), and
an answer kept from before those writes would fail every retry. Each rank is answered once from a snapshot; a rank
asking again starts the next pass, which asks the engine anew.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

Answer = TypeVar("Answer")


class PassChecksums(Generic[Answer]):
    """The latest answer of an engine's checksum call, and which ranks of the version have read it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._version: int | None = None
        self._answer: Answer | None = None
        self._read: set[int] = set()

    def for_rank(self, version: int, rank: int, ask: Callable[[], Answer]) -> Answer:
        """The checksums rank ``rank`` verifies ``version`` against: the current pass's, or ``ask()``'s when this
        is a new version or the rank already read the current pass (a retry)."""
        with self._lock:
            if self._answer is None or self._version != version or rank in self._read:
                self._answer, self._version, self._read = ask(), version, set()
            self._read.add(rank)
            return self._answer

    def holds(self, version: int) -> bool:
        """Whether the latest answer is one of ``version``'s."""
        with self._lock:
            return self._answer is not None and self._version == version

    def latest(self) -> Answer | None:
        """The latest answer (the pass the last verify read), or None."""
        with self._lock:
            return self._answer

    def forget(self) -> None:
        with self._lock:
            self._version, self._answer, self._read = None, None, set()
