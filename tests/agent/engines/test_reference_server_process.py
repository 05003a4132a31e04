"""The reference engine as a real process: ready line, Mooncake (TCP loopback) writes from this process,
verify / commit across processes, staged serving, clean exit on SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from refsync import write_version

from weightsync_agent.http.client import HttpCallError
from weightsync_agent.targets.engine_client import EngineClient
from weightsync_agent.transport.base import Transport
from weightsync_agent.transport.mooncake import MooncakeTransport
from weightsync_testing.reference_engine.launch import launch_engine
from weightsync_testing.reference_engine.model import forward_full, forward_tp, full_state, shard

TP = 2
BUCKET = 16384
TOKENS = [4, 8, 15, 16, 23, 42]
REPO = Path(__file__).resolve().parents[3]


def mooncake_transport() -> Transport:
    return MooncakeTransport("127.0.0.1", "tcp", "", force_tcp=True, timeout_seconds=10)


def start_engine(*extra: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    started = launch_engine(2, TP, seed=0, extra=extra, timeout=30)
    return started.process, started.ready


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[subprocess.Popen[str], dict[str, Any], EngineClient]]:
    proc, ready = start_engine("--weight-version", "0")
    try:
        yield proc, ready, EngineClient(ready["url"], timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def source() -> Iterator[Transport]:
    transport = mooncake_transport()
    yield transport
    transport.close()


def expected(seed: int) -> torch.Tensor:
    full = full_state(seed)
    return forward_tp([shard(full, TP, r) for r in range(TP)], TOKENS)


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to float summation order (another thread count or process may sum differently)."""
    return torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def logits(client: EngineClient) -> torch.Tensor:
    return torch.tensor(client.forward(TOKENS))


def write_all(client: EngineClient, source: Transport, seed: int, **kw: Any) -> dict[int, list[str]]:
    out = {}
    for rank in range(TP):
        written = write_version(source, client.manifest(rank), full_state(seed), BUCKET, **kw)
        assert not written.failed, [t.error() for t in written.failed]
        out[rank] = written.checksums
    return out


def test_ready_line_and_info_routes(engine: tuple[subprocess.Popen[str], dict[str, Any], EngineClient]) -> None:
    _, ready, client = engine
    assert (ready["engine"], ready["tp"], ready["transport"], ready["weight_version"]) == (2, TP, "mooncake", "0")
    assert client.health() and client.weight_version() == "0"
    for rank in range(TP):
        manifest = client.manifest(rank)
        assert manifest.session_id == ready["sessions"][rank]
        assert manifest.session_id.startswith("127.0.0.1:")
        assert (manifest.engine, manifest.rank) == (2, rank)
    assert same(logits(client), expected(0))


def test_live_round_over_mooncake(
    engine: tuple[subprocess.Popen[str], dict[str, Any], EngineClient], source: Transport
) -> None:
    _, _, client = engine
    client.pause_generation("abort")
    client.begin("1")
    sums = write_all(client, source, seed=1)
    assert client.weight_version() == "0"
    for rank in range(TP):
        assert client.verify(rank, "1", BUCKET, sums[rank]).ok
    client.update_weight_version("1")  # SGLang's route commits the verified version
    client.continue_generation()
    got = logits(client)
    assert same(got, expected(1))
    torch.testing.assert_close(got, forward_full(full_state(1), TOKENS), rtol=1e-4, atol=1e-5)


def test_corrupted_bucket_is_caught_across_processes(
    engine: tuple[subprocess.Popen[str], dict[str, Any], EngineClient], source: Transport
) -> None:
    _, _, client = engine
    version = client.weight_version()
    client.pause_generation()
    client.begin("bad")
    sums = write_all(client, source, seed=11, corrupt_bucket=2)
    report = client.verify(0, "bad", BUCKET, sums[0])
    assert not report.ok and report.mismatched == (2,)
    with pytest.raises(HttpCallError) as err:
        client.commit("bad")
    assert err.value.status == 409
    client.abort("bad")
    assert client.weight_version() == version
    # the live weights were touched: generation stays off until a verified version lands
    with pytest.raises(HttpCallError):
        client.continue_generation()
    client.begin("12")
    sums = write_all(client, source, seed=12)
    for rank in range(TP):
        assert client.verify(rank, "12", BUCKET, sums[rank]).ok
    client.commit("12")
    client.continue_generation()
    assert same(logits(client), expected(12))


def test_staged_round_serves_old_weights_until_commit(
    engine: tuple[subprocess.Popen[str], dict[str, Any], EngineClient], source: Transport
) -> None:
    _, _, client = engine
    before, version = logits(client), client.weight_version()
    client.stage(True)
    try:
        client.begin("20")
        sums = write_all(client, source, seed=20)
        assert torch.equal(logits(client), before) and client.weight_version() == version
        for rank in range(TP):
            assert client.verify(rank, "20", BUCKET, sums[rank]).ok
        client.commit("20")
        assert client.weight_version() == "20" and same(logits(client), expected(20))
    finally:
        client.stage(False)


def test_sigterm_stops_cleanly() -> None:
    proc, ready = start_engine()
    client = EngineClient(ready["url"], timeout=5)
    assert client.health()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0  # 15 s was not always enough while the suite's other worker loaded both cores
    assert proc.stdout is not None
    lines = [json.loads(line) for line in proc.stdout.read().splitlines() if line.startswith("{")]
    assert {"event": "stopped", "engine": 2} in lines
