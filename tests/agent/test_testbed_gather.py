"""The emulated gather's sink and link (``weightsync_tools.testbed.gather``) between real processes."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from weightsync_tools.testbed.gather import HEADER, MAX_PULL_BYTES, GatherLink, gathered_bytes


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start(*args: str) -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-m", "weightsync_tools.testbed.gather", *args],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert process.stdout is not None
    assert "gather" in process.stdout.readline()  # listening
    return process


@pytest.fixture
def sink() -> Iterator[tuple[str, int]]:
    """A source and a sink, each its own process, as the testbed runs them (without namespaces)."""
    source_port, sink_port = _free_port(), _free_port()
    source = _start("source", "--host", "127.0.0.1", "--port", str(source_port))
    relay = _start("sink", "--host", "127.0.0.1", "--port", str(sink_port), "--source", f"127.0.0.1:{source_port}")
    yield "127.0.0.1", sink_port
    for process in (relay, source):
        process.kill()
        process.wait()


def test_pull_moves_the_bytes_and_waits_for_them(sink: tuple[str, int]) -> None:
    link = GatherLink(*sink)
    for count in (1, 5 << 20, 3 << 20):  # over and under the chunk size
        link.pull(count)
    link.pull(0)  # nothing to gather: no message
    assert link.pulled == 1 + (8 << 20)
    link.close()


def test_two_ranks_share_one_sink(sink: tuple[str, int]) -> None:
    a, b = GatherLink(*sink), GatherLink(*sink)
    a.pull(1 << 20)
    b.pull(2 << 20)
    a.pull(1 << 20)
    assert (a.pulled, b.pulled) == (2 << 20, 2 << 20)
    a.close()
    b.close()


def test_sink_drops_a_connection_announcing_too_much(sink: tuple[str, int]) -> None:
    with socket.create_connection(sink, timeout=10) as conn:
        conn.sendall(HEADER.pack(MAX_PULL_BYTES + 1))
        assert conn.recv(1) == b""  # closed, nothing read or acknowledged
    GatherLink(*sink).pull(10)  # and it still serves others


def test_a_link_refuses_a_pull_over_the_bound(sink: tuple[str, int]) -> None:
    with pytest.raises(ValueError, match="over"):
        GatherLink(*sink).pull(MAX_PULL_BYTES + 1)


@pytest.mark.parametrize(("size", "shards", "expected"), [(100, 1, 0), (100, 2, 50), (99, 3, 66), (0, 4, 0)])
def test_gathered_bytes(size: int, shards: int, expected: int) -> None:
    assert gathered_bytes(size, shards) == expected


def test_gathered_bytes_needs_a_shard() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        gathered_bytes(10, 0)


def test_a_sink_needs_its_source() -> None:
    done = subprocess.run([sys.executable, "-m", "weightsync_tools.testbed.gather", "sink", "--host", "127.0.0.1",
                           "--port", "1"], capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 2 and "--source HOST:PORT" in done.stderr


def test_requests_asked_ahead_are_answered_in_order(sink: tuple[str, int]) -> None:
    link = GatherLink(*sink)
    for count in (3 << 20, 0, 1, 5 << 20):  # a rank asks for several tensors' gathers before it waits
        link.request(count)
    for expected in (3 << 20, 3 << 20, (3 << 20) + 1, (8 << 20) + 1):
        link.wait()
        assert link.pulled == expected
    link.close()
