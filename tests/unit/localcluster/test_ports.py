"""``free_port`` never hands out the same port twice in one process, even when the OS offers it again, nor one that
another process sharing its ledger (``$WEIGHTSYNC_PORTS_LEDGER``: the suite's parallel workers) handed out."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from weightsync import ports


class _Offered:
    """A socket whose bind(…, 0) is given the next port of a fixed sequence (the OS offering a port again)."""

    def __init__(self, sequence: list[int]) -> None:
        self.sequence = sequence

    def __call__(self, *args: Any, **kwargs: Any) -> _Offered:
        return self

    def __enter__(self) -> _Offered:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def bind(self, address: tuple[str, int]) -> None:
        self.port = self.sequence.pop(0)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


@pytest.fixture(autouse=True)
def _no_shared_ledger(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ports.ENV_LEDGER, raising=False)


def test_a_port_offered_again_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.setattr(ports.socket, "socket", _Offered([40001, 40001, 40001, 40002]))
    assert [ports.free_port(), ports.free_port()] == [40001, 40002]


def test_no_new_port_in_every_try_is_an_error_naming_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_handed_out", {40001})
    monkeypatch.setattr(ports.socket, "socket", _Offered([40001] * ports.ATTEMPTS))
    with pytest.raises(OSError, match=r"127\.0\.0\.1"):
        ports.free_port()


def test_real_picks_are_distinct_and_bindable() -> None:
    picked = [ports.free_port() for _ in range(50)]
    assert len(set(picked)) == len(picked)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", picked[-1]))


def test_real_picks_stay_out_of_the_ephemeral_range_where_outgoing_connections_take_ports() -> None:
    window = ports.pick_window(ports._ephemeral_range())
    if window is None:
        pytest.skip("no ephemeral range below which to pick on this host")
    picked = [ports.free_port() for _ in range(50)]
    assert all(window[0] <= port < window[1] for port in picked), (window, picked)


@pytest.mark.parametrize(
    ("ephemeral", "window"),
    [((32768, 60999), (20000, 32768)), ((15000, 60999), (10000, 15000)), ((10500, 60999), None), (None, None)],
)
def test_the_window_sits_just_below_the_ephemeral_range(
    ephemeral: tuple[int, int] | None, window: tuple[int, int] | None
) -> None:
    assert ports.pick_window(ephemeral) == window


def test_a_port_another_process_recorded_in_the_ledger_is_skipped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ledger = tmp_path / "ports"
    ledger.write_text("40001\n")
    monkeypatch.setenv(ports.ENV_LEDGER, str(ledger))
    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.setattr(ports.socket, "socket", _Offered([40001, 40002, 40003]))
    assert ports.free_port() == 40002
    assert ledger.read_text().split() == ["40001", "40002"]


def test_processes_sharing_a_ledger_never_pick_the_same_port(tmp_path: Path) -> None:
    ledger = tmp_path / "ports"
    pick = "from weightsync.ports import free_port; print(*(free_port() for _ in range(200)))"
    env = {ports.ENV_LEDGER: str(ledger)}
    runs = [
        subprocess.Popen([sys.executable, "-c", pick], stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
        for _ in range(3)
    ]
    picked = [int(port) for run in runs for port in run.communicate(timeout=60)[0].split()]
    assert len(picked) == 600
    assert len(set(picked)) == 600
    assert sorted(map(int, ledger.read_text().split())) == sorted(picked)
