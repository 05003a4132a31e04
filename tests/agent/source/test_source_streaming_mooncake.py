"""Streaming over real Mooncake (TCP loopback): the source here, the target in a child process.

The trainer stages one tensor at a time; each bucket must land (and hash, in the target's own process, to
what the source reports) while the rest is still being staged, and a stream the trainer abandons
mid-way must fail naming the first bucket it never completed, with the earlier ones landed and settled.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from source_helpers import make_plan

from weightsync_agent.client.trainer import WeightSyncClient
from weightsync_agent.source.writer import PublishResult

mooncake = pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine is not installed")

from mooncake_peer import TargetProcess, bench_model, mooncake_transport  # noqa: E402

MIB = 1 << 20


def fulls(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f.name: torch.randn(f.shape, generator=gen).to(torch.bfloat16) for _, g in bench_model(4) for f in g}


@pytest.fixture
def target(tmp_path: Path) -> Iterator[TargetProcess]:
    peer = TargetProcess(tmp_path, mib=4)  # four 1 MiB tensors
    yield peer
    peer.close()


def test_a_stream_lands_bucket_by_bucket_and_an_abandoned_one_fails_at_its_first_missing_bucket(
    target: TargetProcess,
) -> None:
    plan = make_plan(1, 1, 1, timeout=30)  # 1 MiB buckets: bucket i is tensor w{i}
    transport = mooncake_transport()
    client = WeightSyncClient.in_process(transport, plan, 0, {(0, 0): target.manifest}, pin=False)
    try:
        with client:
            state = fulls(1)
            with client.stream(1) as stream:
                for name, tensor in state.items():
                    stream.stage(name, tensor)
            result = stream.outcome
            assert isinstance(result, PublishResult) and result.ok, result
            sums = result.targets[(0, 0)].checksums
            assert len(sums) == 4 and result.digests_reused == 4  # hashed while staged, not re-read
            assert target.verify(MIB) == sums  # the target's own process hashes what landed

            nxt = fulls(2)
            with pytest.raises(RuntimeError, match="trainer crashed"), client.stream(2) as stream:
                stream.stage("w0", nxt["w0"])
                stream.stage("w1", nxt["w1"])
                raise RuntimeError("trainer crashed")
            failed = stream.outcome
            assert isinstance(failed, PublishResult) and not failed.ok
            (failure,) = failed.failures
            assert failure.kind == "stream" and failure.bucket <= 2  # after an abort nothing more is submitted
            assert "the trainer aborted the stream: RuntimeError: trainer crashed" in failure.detail
            assert failed.unsettled == 0  # every submitted write settled before the failure was reported
            landed = target.verify(MIB)
            assert landed[2:] == sums[2:]  # the buckets it never staged were never sent
            assert client.committed == 1
    finally:
        transport.close()
