"""A real two-process publish over Mooncake (TCP loopback): source here, target in a child process."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from source_helpers import as_bytes, expected_local, full_state, make_plan

from weightsync_agent.layout.checksums import checksum_ranges
from weightsync_agent.layout.manifest import Region
from weightsync_agent.source.writer import Source

mooncake = pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine is not installed")

from mooncake_peer import TargetProcess, mooncake_transport  # noqa: E402


@pytest.fixture
def target(tmp_path: Path) -> Iterator[TargetProcess]:
    peer = TargetProcess(tmp_path)
    yield peer
    peer.close()


def test_publish_over_mooncake_lands_bit_exact_and_a_bad_address_is_named(target: TargetProcess) -> None:
    plan = make_plan(1, 1, 1)
    transport = mooncake_transport()
    bucket_bytes = 100
    fulls = full_state(31)
    try:
        with Source(transport, plan, 0, {(0, 0): target.manifest}, bucket_bytes, pin=False) as source:
            source.replicas.stage_many(fulls)
            result = source.publish(1, timeout=30)
            assert result.ok, result.summary()
            sums = result.targets[(0, 0)].checksums
            assert target.verify(bucket_bytes) == sums
            # independently: the expected shard bytes, cut into the same buckets, hash the same
            expected = b"".join(bytes(as_bytes(expected_local(e, fulls)).numpy()) for e in target.manifest.tensors)
            holder = bytearray(expected)
            base = ctypes.addressof((ctypes.c_char * len(holder)).from_buffer(holder))
            starts = range(0, len(expected), bucket_bytes)
            assert sums == [checksum_ranges([(base + s, min(bucket_bytes, len(expected) - s))]) for s in starts]

        # The same target, but a manifest pointing 1 TiB away from what it registered: the target refuses.
        shift = 1 << 40
        m = target.manifest
        moved = m.model_copy(
            update={
                "tensors": tuple(t.model_copy(update={"address": t.address + shift}) for t in m.tensors),
                "regions": tuple(Region(address=r.address + shift, nbytes=r.nbytes) for r in m.regions),
            }
        )
        with Source(transport, plan, 0, {(0, 0): moved}, bucket_bytes, pin=False) as source:
            source.replicas.stage_many(fulls)
            began = time.monotonic()
            result = source.publish(2, timeout=20)
            assert time.monotonic() - began < 15
            assert not result.ok
            (failure,) = result.failures
            assert failure.target == (0, 0) and failure.bucket == 0 and failure.session_id == m.session_id
            assert failure.kind in ("transport", "submit") and failure.detail
        assert target.verify(bucket_bytes) == sums  # the target's memory is unharmed
    finally:
        transport.close()
