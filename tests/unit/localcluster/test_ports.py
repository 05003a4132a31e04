"""``free_port`` never hands out the same port twice in one process, even when the OS offers it again."""

from __future__ import annotations

import socket
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
