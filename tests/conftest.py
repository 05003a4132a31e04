"""How the suite runs in parallel (``./hack/test.sh``: ``pytest -n 3 --dist loadgroup``; docs/testing.md).

A worker process takes whole *groups*: the tests that share one expensive thing run in one process, once:
- ``cluster``: every test on the session's local cluster (the ``control_plane`` fixture: etcd, kube-apiserver,
  controller manager, scheduler, kwok, the chart and the operator), in file order, because the fault tests stop and
  restart its components;
- ``sglang`` / ``vllm``: the modules of a stock engine tier that use its session server (~1 GB, 20-30 s to start);
- any other module: its own group, so its module-scoped fixtures (agents, engines, child processes) start once.
  The engine modules that start servers of their own are such groups, so the two tiers spread over the workers.

The cluster and the tiers go first, then the engine modules (collection order, with ``--no-loadscope-reorder``),
so the long groups start early and the short modules fill in behind them.

Workers pick ports side by side: they share one ledger (``weightsync.ports``), so no two processes of the run
are ever handed the same port between its pick and its server's bind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from weightsync.ports import ENV_LEDGER
from weightsync_testing.server_process import SHARED_SERVER, join_retired

TESTS = Path(__file__).resolve().parent
#: The groups that go first, longest first (docs/testing.md has their times): the cluster, then each stock engine
#: tier's modules that share its session server.
TIERS = ("cluster", "sglang", "vllm")


def uses_a_shared_server(item: pytest.Item) -> bool:
    """Whether ``item`` uses a fixture marked ``SHARED_SERVER`` (an engine tier's session server:
    ``engine_tier.shared_server``)."""
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        definitions = info.name2fixturedefs.get(name, ()) if info is not None else ()
        if definitions and getattr(definitions[-1].func, SHARED_SERVER, False):
            return True
    return False


def group_of(path: Path, fixturenames: list[str], shares_server: bool) -> str:
    """The xdist group of a test in file ``path`` using ``fixturenames``; ``shares_server``: its module uses its
    engine tier's session server."""
    if "control_plane" in fixturenames:
        return "cluster"
    relative = path.resolve().relative_to(TESTS)
    if relative.parts[0] == "engines" and relative.parts[1] in TIERS and shares_server:
        return relative.parts[1]  # the engine tier's directory
    return relative.as_posix()


def rank_of(group: str) -> int:
    """The tiers first, then the engine modules (each starts servers of its own: minutes), then the rest."""
    if group in TIERS:
        return TIERS.index(group)
    return len(TIERS) + (0 if group.startswith("engines/") else 1)


_own_ledger: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("dist", default="no") == "loadgroup" and not hasattr(pytest.Item, "_nodeid"):
        # xdist groups by rewriting each item's ``_nodeid``; where pytest no longer reads it, every tier would be
        # spread over the workers, each starting its own cluster and engine servers.
        raise pytest.UsageError("pytest-xdist cannot group tests under this pytest (pyproject.toml pins pytest<9.2)")
    # Made by the first process (the controller under xdist), inherited by the workers and what they spawn.
    if ENV_LEDGER not in os.environ:
        handle, path = tempfile.mkstemp(prefix="weightsync-ports-")
        os.close(handle)
        os.environ[ENV_LEDGER] = path
        _own_ledger.append(path)


def pytest_unconfigure(config: pytest.Config) -> None:
    while _own_ledger:
        Path(_own_ledger.pop()).unlink(missing_ok=True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its group (before xdist reads the marks) and put the long groups first."""
    sharing = {Path(item.path) for item in items if uses_a_shared_server(item)}
    rank: dict[str, int] = {}
    for item in items:
        path = Path(item.path)
        group = group_of(path, list(getattr(item, "fixturenames", ())), path in sharing)
        item.add_marker(pytest.mark.xdist_group(group))
        rank[item.nodeid] = rank_of(group)
    items.sort(key=lambda item: rank[item.nodeid])  # stable: file order within a group


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    join_retired()  # the servers whose shutdown a teardown left running (server_process.retire)
