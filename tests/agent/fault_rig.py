"""Shared pieces of the round-level fault tests: real engine processes, Mooncake sources, fault triggers.

Used by ``test_faults.py`` and by ``fault_coordinator.py`` (the coordinator run as a child process so it
can be killed with SIGKILL). The plan, the training step and the independent resharding come from
``sync_helpers`` and ``test_sync_p2p`` so every fault test checks exactly what the happy path checks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from sync_helpers import ENGINES, TOKENS, expected_checksums, training_step
from test_sync_p2p import group_plan

from weightsync.plan import Plan
from weightsync_agent.rounds.driver import RoundDriver
from weightsync_agent.source.control import SourceControl
from weightsync_agent.source.writer import InProcessSourceControl, Source
from weightsync_agent.targets.engine_client import EngineClient
from weightsync_agent.targets.reference.adapter import reference_adapter
from weightsync_agent.transport.base import Transfer, Transport
from weightsync_agent.transport.mooncake import MooncakeTransport
from weightsync_testing.reference_engine.model import forward_full, full_state

__all__ = ["ENGINES", "TOKENS", "expected_checksums", "group_plan", "training_step"]

BUCKET_BYTES = 16 << 10  # small buckets: about 11 per target, so a fault can strike between buckets
TRANSFER_TIMEOUT = 2.0  # the sources' Mooncake timeout: a hung peer is detected after this long


def engine_seed(engine: int) -> int:
    return 7 + engine


def version_state(version: int) -> dict[str, torch.Tensor]:
    """The trainer's full weights of ``version`` (a fixed walk of training steps from one seed)."""
    return training_step(full_state(seed=1), version)


class PassThroughTransport:
    """Delegates everything to ``inner``; subclasses intercept ``submit_write``."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    @property
    def timeout_seconds(self) -> float:
        return self.inner.timeout_seconds

    def register(self, address: int, nbytes: int) -> None:
        self.inner.register(address, nbytes)

    def unregister(self, address: int) -> None:
        self.inner.unregister(address)

    def probe(self, peer: str, timeout: float) -> bool:
        return self.inner.probe(peer, timeout)

    def submit_write(self, peer: str, local_address: int, remote_address: int, nbytes: int) -> Transfer:
        return self.inner.submit_write(peer, local_address, remote_address, nbytes)

    def close(self) -> None:
        self.inner.close()


class TriggeredTransport(PassThroughTransport):
    """A MooncakeTransport whose ``after``-th write to one of ``watched`` first runs ``trigger``.

    Counting is shared between the wrappers given the same ``counter`` (both sources of a round), so the
    fault strikes once, at a known point: with a window of 2 buckets per target, the third write to a
    target is submitted only after its first bucket was confirmed, so some bytes have landed by then.
    """

    def __init__(
        self,
        inner: MooncakeTransport,
        watched: set[str],
        counter: dict[str, int],
        after: int,
        trigger: Callable[[], None],
    ) -> None:
        super().__init__(inner)
        self.watched = watched
        self.counter = counter
        self.after = after
        self.trigger = trigger
        self.lock = threading.Lock()

    def submit_write(self, peer: str, local_address: int, remote_address: int, nbytes: int) -> Transfer:
        if peer in self.watched:
            with self.lock:
                self.counter["writes"] = self.counter.get("writes", 0) + 1
                fire = self.counter["writes"] == self.after
            if fire:
                self.trigger()
        return self.inner.submit_write(peer, local_address, remote_address, nbytes)


def build_sources(
    plan: Plan,
    clients: Sequence[EngineClient],
    wrap: Callable[[MooncakeTransport], Any] | None = None,
) -> list[Source]:
    """One Source per trainer rank, each with its own Mooncake session, manifests fetched from the engines."""
    sources: list[Source] = []
    try:
        for assignment in plan.sources:
            manifests = {t: clients[t[0]].manifest(t[1]) for t in assignment.targets}
            transport = MooncakeTransport("127.0.0.1", "tcp", force_tcp=True, timeout_seconds=TRANSFER_TIMEOUT)
            sender = transport if wrap is None else wrap(transport)
            try:
                sources.append(Source(sender, plan, assignment.source, manifests, BUCKET_BYTES, pin=False))
            except BaseException:
                transport.close()
                raise
    except BaseException:
        close_sources(sources)
        raise
    return sources


def close_sources(sources: Sequence[Source]) -> None:
    for source in sources:
        source.close()
        source.transport.close()


def make_driver(
    plan: Plan,
    clients: Sequence[EngineClient],
    sources: Mapping[int, SourceControl] | Sequence[Source],
    *,
    timeout: float,
    call_timeout: float,
    retries: int,
) -> RoundDriver:
    controls = {e: reference_adapter(e, clients[e].base_url, bucket_bytes=BUCKET_BYTES) for e in range(len(clients))}
    if not isinstance(sources, Mapping):
        sources = {s.source: InProcessSourceControl(s) for s in sources}
    return RoundDriver(
        plan,
        controls,
        sources,
        staging=plan.transfer.target_staging,
        timeout_seconds=timeout,
        call_timeout=call_timeout,
        retries=retries,
    )


def assert_no_engine_claims_what_it_does_not_hold(
    clients: Sequence[EngineClient], states: Mapping[str, Callable[[int], dict[str, torch.Tensor]]]
) -> None:
    """Every engine that serves answers with exactly the weights of the version it reports.

    ``states[version](engine)`` is that version's full weights. An engine whose live weights were
    written by an unfinished round (live mode) must refuse to serve instead: it is paused and dirty.
    """
    for engine, client in enumerate(clients):
        status = client.status()
        version = str(status["weight_version"])
        if status["live_dirty"]:
            assert status["paused"], f"engine {engine} serves dirty live weights while reporting {version}"
            continue
        assert not status["paused"], f"engine {engine} is paused with clean weights: {status}"
        assert version in states, f"engine {engine} reports version {version}, which no round committed"
        logits = torch.tensor(client.forward(TOKENS))
        want = forward_full(states[version](engine), TOKENS)
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5, msg=f"engine {engine} v{version}: logits differ")


def assert_engines_hold_bit_exactly(clients: Sequence[EngineClient], sources: Sequence[Source], version: int) -> None:
    """After a successful round: the checksums every target verified equal an independent resharding."""
    full = version_state(version)
    for source in sources:
        result = source.last_result
        assert result is not None and result.ok, None if result is None else result.summary()
        for (engine, rank), report in result.targets.items():
            assert list(report.checksums) == expected_checksums(full, rank, BUCKET_BYTES), (engine, rank)
    for engine, client in enumerate(clients):
        assert client.weight_version() == str(version), engine
