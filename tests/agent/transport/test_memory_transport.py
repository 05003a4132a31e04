"""MemoryTransport: writes between sessions of one process, refused exactly where Mooncake's target
refuses them, with switchable faults (stall, dead, partial) for the layers above."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync_agent.transport.base import TransferState, TransportError, wait_all
from weightsync_agent.transport.memory import Fault, MemoryTransport, session
from weightsync_agent.transport.regions import RegionTable

N = 1 << 16


@pytest.fixture
def pair() -> Iterator[tuple[MemoryTransport, torch.Tensor, MemoryTransport, torch.Tensor]]:
    source, target = MemoryTransport(timeout_seconds=0.3), MemoryTransport()
    src = torch.arange(N, dtype=torch.int64).to(torch.uint8)
    dst = torch.zeros(N, dtype=torch.uint8)
    source.register(src.data_ptr(), N)
    target.register(dst.data_ptr(), N)
    yield source, src, target, dst
    source.close()
    target.close()


def test_write_lands(pair: tuple[MemoryTransport, torch.Tensor, MemoryTransport, torch.Tensor]) -> None:
    source, src, target, dst = pair
    transfer = source.submit_write(target.session_id, src.data_ptr() + 10, dst.data_ptr() + 100, 1000)
    assert transfer.poll() is TransferState.DONE and transfer.error() is None
    assert transfer.peer == target.session_id and transfer.nbytes == 1000
    assert torch.equal(dst[100:1100], src[10:1010])
    assert dst[:100].count_nonzero() == 0 and dst[1100:].count_nonzero() == 0


@pytest.mark.parametrize(
    "offset, nbytes",
    [(N - 10, 11), (N, 1), (-1, 2), (-(1 << 20), 64)],
    ids=["overruns", "past the end", "starts before", "far before"],
)
def test_out_of_range_write_is_refused_and_nothing_lands(
    pair: tuple[MemoryTransport, torch.Tensor, MemoryTransport, torch.Tensor], offset: int, nbytes: int
) -> None:
    source, src, target, dst = pair
    transfer = source.submit_write(target.session_id, src.data_ptr(), dst.data_ptr() + offset, nbytes)
    assert transfer.poll() is TransferState.FAILED
    assert "refused" in (transfer.error() or "")
    assert dst.count_nonzero() == 0


def test_a_write_spanning_two_adjacent_regions_is_refused() -> None:
    with MemoryTransport() as source, MemoryTransport() as target:
        src, dst = torch.ones(N, dtype=torch.uint8), torch.zeros(N, dtype=torch.uint8)
        source.register(src.data_ptr(), N)
        target.register(dst.data_ptr(), N // 2)
        target.register(dst.data_ptr() + N // 2, N // 2)
        across = source.submit_write(target.session_id, src.data_ptr(), dst.data_ptr() + N // 2 - 8, 16)
        assert across.poll() is TransferState.FAILED and dst.count_nonzero() == 0
        inside = source.submit_write(target.session_id, src.data_ptr(), dst.data_ptr() + N // 2, 16)
        assert inside.poll() is TransferState.DONE
        target.unregister(dst.data_ptr() + N // 2)  # checked against current registrations
        gone = source.submit_write(target.session_id, src.data_ptr(), dst.data_ptr() + N // 2, 16)
        assert gone.poll() is TransferState.FAILED


def test_a_chunked_overrun_lands_its_in_range_chunks_as_mooncake_does() -> None:
    with MemoryTransport(chunk_bytes=1024) as source, MemoryTransport() as target:
        src, dst = torch.ones(N, dtype=torch.uint8), torch.zeros(N, dtype=torch.uint8)
        source.register(src.data_ptr(), N)
        target.register(dst.data_ptr(), N)
        start = N - 3 * 1024 - 512
        transfer = source.submit_write(target.session_id, src.data_ptr(), dst.data_ptr() + start, 4 * 1024)
        assert transfer.poll() is TransferState.FAILED and "chunk at +3072" in (transfer.error() or "")
        assert dst[start : start + 3 * 1024].eq(1).all() and dst[:start].count_nonzero() == 0


def test_unknown_or_closed_peer_fails_without_raising(
    pair: tuple[MemoryTransport, torch.Tensor, MemoryTransport, torch.Tensor],
) -> None:
    source, src, target, dst = pair
    assert source.submit_write("memory:nobody", src.data_ptr(), dst.data_ptr(), 8).poll() is TransferState.FAILED
    assert source.probe(target.session_id, 1.0)
    target.close()
    assert session(target.session_id) is None and not source.probe(target.session_id, 1.0)
    failed = source.submit_write(target.session_id, src.data_ptr(), dst.data_ptr(), 8)
    assert failed.poll() is TransferState.FAILED and "no session" in (failed.error() or "")


def test_programming_errors_raise(pair: tuple[MemoryTransport, torch.Tensor, MemoryTransport, torch.Tensor]) -> None:
    source, src, target, dst = pair
    with pytest.raises(TransportError, match="overlaps"):
        source.register(src.data_ptr() + 8, 8)
    with pytest.raises(TransportError, match="not the start"):
        source.unregister(src.data_ptr() + 8)
    with pytest.raises(TransportError, match="local range"):
        source.submit_write(target.session_id, dst.data_ptr(), src.data_ptr(), 8)  # dst is not ours
    with pytest.raises(ValueError):
        source.submit_write(target.session_id, src.data_ptr(), dst.data_ptr(), -1)
    assert source.submit_write(target.session_id, 0, 0, 0).poll() is TransferState.DONE
    with pytest.raises(TransportError, match="already exists"):
        MemoryTransport(name=source.session_id.removeprefix("memory:"))


def test_stalled_peer_times_out_and_the_write_still_lands_on_release(
    pair: tuple[MemoryTransport, torch.Tensor, MemoryTransport, torch.Tensor],
) -> None:
    source, src, target, dst = pair
    target.stall()
    assert not source.probe(target.session_id, 0.1)
    transfer = source.submit_write(target.session_id, src.data_ptr(), dst.data_ptr(), 64)
    assert transfer.poll() is TransferState.PENDING
    assert wait_all([transfer], time.monotonic() + 5) == [transfer]
    assert transfer.poll() is TransferState.FAILED and "may still land" in (transfer.error() or "")
    assert dst.count_nonzero() == 0
    target.release()
    assert torch.equal(dst[:64], src[:64])  # late, as a resumed Mooncake peer can
    assert transfer.poll() is TransferState.FAILED  # a reported failure stays a failure


def test_release_applies_held_writes_that_have_not_timed_out(
    pair: tuple[MemoryTransport, torch.Tensor, MemoryTransport, torch.Tensor],
) -> None:
    source, src, target, dst = pair
    target.stall()
    transfer = source.submit_write(target.session_id, src.data_ptr(), dst.data_ptr(), 64)
    target.release()
    assert transfer.poll() is TransferState.DONE and torch.equal(dst[:64], src[:64])


def test_closing_the_source_drops_its_held_writes(
    pair: tuple[MemoryTransport, torch.Tensor, MemoryTransport, torch.Tensor],
) -> None:
    source, src, target, dst = pair
    target.stall()
    transfer = source.submit_write(target.session_id, src.data_ptr(), dst.data_ptr(), 64)
    source.close()
    target.release()
    assert transfer.poll() is TransferState.FAILED and dst.count_nonzero() == 0


def test_dead_and_partial_faults(pair: tuple[MemoryTransport, torch.Tensor, MemoryTransport, torch.Tensor]) -> None:
    source, src, target, dst = pair
    target.fault = Fault.DEAD
    dead = source.submit_write(target.session_id, src.data_ptr(), dst.data_ptr(), 64)
    assert dead.poll() is TransferState.FAILED and dst.count_nonzero() == 0
    target.fault = Fault.PARTIAL
    partial = source.submit_write(target.session_id, src.data_ptr() + 1, dst.data_ptr(), 64)
    assert partial.poll() is TransferState.FAILED
    assert torch.equal(dst[:32], src[1:33]) and dst[32:].count_nonzero() == 0  # a failure can still write


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 200), st.integers(1, 40)), max_size=12),
    st.lists(st.tuples(st.integers(0, 260), st.integers(0, 60)), max_size=30),
)
def test_region_table_matches_a_brute_force_model(adds: list[tuple[int, int]], queries: list[tuple[int, int]]) -> None:
    table, model = RegionTable("t"), list[tuple[int, int]]()
    for address, nbytes in adds:
        overlaps = any(a < address + nbytes and address < a + n for a, n in model)
        if overlaps:
            with pytest.raises(TransportError):
                table.add(address, nbytes)
        else:
            table.add(address, nbytes)
            model.append((address, nbytes))
    assert table.items() == sorted(model)
    for address, nbytes in queries:
        expected = any(a <= address and address + nbytes <= a + n for a, n in model)
        assert table.covers(address, nbytes) is expected, (address, nbytes, model)
