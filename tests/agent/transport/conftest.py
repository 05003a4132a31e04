"""Fixtures that start the transport tests' child processes and always kill and reap them."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from transport_children import Child, close_all


def _spawner() -> Iterator[Callable[..., Child]]:
    children: list[Child] = []

    def start(script: str, *args: str) -> Child:
        child = Child(script, *args)
        children.append(child)  # before the first read, so a child that never answers is still reaped
        child.info = child.read()
        return child

    yield start
    close_all(children)


@pytest.fixture
def spawn() -> Iterator[Callable[..., Child]]:
    """``spawn(script, *args)`` starts a child that is closed (or killed) when the test ends."""
    yield from _spawner()


@pytest.fixture(scope="module")
def spawn_module() -> Iterator[Callable[..., Child]]:
    """``spawn`` for children that live as long as the test module."""
    yield from _spawner()
