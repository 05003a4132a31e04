"""A streamed version's feed window: staging into an engine replica's feed waits while the feed holds more than a
window of layers the loader has not taken yet.

A source loads a layerwise feed a decoder layer at a time as the trainer stages it and gives each loaded layer back
(``SourceAgent._load_groups``, ``Replica.release``), so the feed holds what is staged and not yet loaded. A trainer
that stages faster than the engine's ``load_weights`` runs (measured: about 2x a plain staging of the same bytes)
would still fill it towards the whole model. So, streamed, the trainer's staging of a feed tensor waits while the
feed holds more than its window: twice its largest layer group by default, room to stage one layer while the one
before it loads. It never waits for nothing: a loader that takes no layer for :data:`STALL_SECONDS` (staged out of
layer order, so no layer completes; a loader gone) lets staging go on past the window, said once in the log, and a
stream whose version already ended stops waiting at once.

What the feed holds is what the kernel says its file holds (``Replica.held_bytes``: its allocated blocks), read in
the trainer's process: nothing else is shared or counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from weightsync_agent.source.replica import Replica, ReplicaSet

log = logging.getLogger("weightsync.client.feed_window")

#: How long staging waits without the loader taking any layer before it goes on past the window.
STALL_SECONDS = 5.0
#: How often a waiting stage looks at the feed again.
POLL_SECONDS = 0.005


def feed_windows(replicas: ReplicaSet) -> dict[str, int]:
    """Per layerwise feed (its fingerprint): its window, twice its largest layer group's bytes. Feeds loaded in one
    go (no layer groups) have none: their loader runs once everything is staged, so waiting would never end."""
    windows: dict[str, int] = {}
    for replica in replicas.replicas.values():
        spec = replica.layout.replica
        if not spec or not spec.get("layer_groups"):
            continue
        feed = replicas.feed_for(replica)
        sizes = [feed.layout.by_name[str(f["name"])].nbytes for f in spec["feeds"]]
        largest = max(sum(sizes[i] for i in group) for group in spec["layer_groups"])
        windows[feed.fingerprint] = max(windows.get(feed.fingerprint, 0), 2 * largest)
    return windows


class FeedWindow:
    """The waits of one stream's staging (module doc); ``windows``: :func:`feed_windows`, or the caller's own."""

    def __init__(
        self,
        replicas: ReplicaSet,
        windows: Mapping[str, int] | None = None,
        *,
        stall_seconds: float = STALL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replicas = replicas
        self.windows = dict(feed_windows(replicas) if windows is None else windows)
        self.stall_seconds = stall_seconds
        self.clock = clock
        self.waited = 0.0  # seconds this stream's staging waited in all
        self._said = False

    def room(self, name: str, ended: Callable[[], bool] = lambda: False) -> float:
        """Wait until every windowed feed that takes tensor ``name`` has room for it; the seconds waited."""
        began = self.clock()
        for fingerprint, window in self.windows.items():
            feed = self.replicas.feeds[fingerprint]
            quantized = feed.layout.quantized.get(name)  # a quantized feed's scale comes with its weight
            names = (name,) if quantized is None else (name, quantized.scale)
            needed = sum(s.tensor.nbytes for n in names for s in feed.layout.by_source.get(n, ()))
            if needed:
                self._wait(feed, needed, window, ended)
        waited = self.clock() - began
        self.waited += waited
        return waited

    @staticmethod
    def _held(feed: Replica) -> int:
        """The feed's tensor bytes held now: its file's allocated bytes but the header before its data."""
        return max(0, feed.held_bytes() - feed.data_offset)

    def _wait(self, feed: Replica, needed: int, window: int, ended: Callable[[], bool]) -> None:
        held = self._held(feed)
        last_change = self.clock()
        while held + needed > window and not ended():
            if self.clock() - last_change >= self.stall_seconds:
                if not self._said:
                    self._said = True
                    log.warning(
                        "the engine replica's loader took no layer for %.0f s while its feed holds %d bytes (window "
                        "%d): staging goes on past the window (are layers staged out of order, so none completes?)",
                        self.stall_seconds, held, window,
                    )  # fmt: skip
                return
            time.sleep(POLL_SECONDS)
            now = self._held(feed)
            if now < held:
                last_change = self.clock()
            held = now
