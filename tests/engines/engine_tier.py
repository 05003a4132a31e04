"""Helpers of the stock-engine tiers' conftests (``tests/engines/conftest.py`` stops their session servers)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, TypeVar

import pytest

from weightsync_testing.engine_env import EngineEnv, EngineEnvError, EngineEnvUnavailable
from weightsync_testing.server_process import SHARED_SERVER, retire


class Stoppable(Protocol):
    def stop(self) -> None: ...


S = TypeVar("S", bound=Stoppable)
F = TypeVar("F", bound=Callable[..., object])

#: Per tier directory, the session servers to stop once the run leaves it.
SESSION_SERVERS: dict[Path, list[Stoppable]] = {}


def engine_python(env: EngineEnv) -> Path:
    """The tier's engine venv's python. Skips when the venv cannot be built because the package index is
    unreachable, unless ``WEIGHTSYNC_REQUIRE_<ENGINE>=1`` (CI) turns that into a failure; any other build failure
    fails."""
    require = f"WEIGHTSYNC_REQUIRE_{env.name.upper()}"
    try:
        return env.python()
    except EngineEnvUnavailable as error:
        if os.environ.get(require) == "1":
            pytest.fail(f"{require}=1 and the {env.name} venv cannot be built: {error}")
        pytest.skip(f"stock {env.name} venv cannot be built here ({error}); {require}=1 fails instead")
    except EngineEnvError as error:
        pytest.fail(str(error))


def session_server(tier: Path, server: S) -> Iterator[S]:
    """Yield ``server`` for the session, stopped (in the background: ``retire``) when the run leaves ``tier`` or at
    the end, whichever is first."""
    servers = SESSION_SERVERS.setdefault(tier.resolve(), [])
    servers.append(server)
    try:
        yield server
    finally:
        if server in servers:
            servers.remove(server)
            retire(server.stop)


def leave_tier(tier: Path) -> None:
    """Stop (in the background) the session servers of ``tier``: the run has left it."""
    servers = SESSION_SERVERS.get(tier, [])
    retire(*(server.stop for server in servers))
    servers.clear()


def shared_server(fixture: F) -> F:
    """Mark a tier's session-server fixture function (under ``@pytest.fixture``): the modules using it run in one
    worker (tests/conftest.py), so the server starts once."""
    fixture.__dict__[SHARED_SERVER] = True
    return fixture
