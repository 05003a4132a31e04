"""How the suite runs in parallel (``./hack/test.sh``: ``pytest -n 2 --dist loadgroup``; docs/testing.md).

A worker process takes whole *groups*: the tests that share one expensive thing run in one process, once:
- ``cluster``: every test on the session's local cluster (the ``control_plane`` fixture: etcd, kube-apiserver,
  controller manager, scheduler, kwok, the chart and the operator), in file order, because the fault tests stop and
  restart its components;
- ``sglang`` / ``vllm``: a stock engine tier, whose session server (~1 GB, 20-30 s to start) serves its tests;
- any other module: its own group, so its module-scoped fixtures (agents, engines, child processes) start once.

The three long groups go first (collection order, with ``--no-loadscope-reorder``), so one worker starts the
cluster while the other starts an engine tier, and the short modules fill in behind them.

Workers pick ports side by side: they share one ledger (``weightsync.ports``), so no two processes of the run
are ever handed the same port between its pick and its server's bind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from weightsync.ports import ENV_LEDGER

TESTS = Path(__file__).resolve().parent
#: The groups that hold a whole tier, longest first (docs/testing.md has their times).
TIERS = ("cluster", "sglang", "vllm")


def group_of(path: Path, fixturenames: list[str]) -> str:
    """The xdist group of a test in file ``path`` using ``fixturenames``."""
    if "control_plane" in fixturenames:
        return "cluster"
    relative = path.resolve().relative_to(TESTS)
    if relative.parts[0] == "engines" and relative.parts[1] in TIERS:
        return relative.parts[1]  # the engine tier's directory
    return relative.as_posix()


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
    """Mark every test with its group (before xdist reads the marks) and put the tiers' groups first."""
    rank: dict[str, int] = {}
    for item in items:
        group = group_of(Path(item.path), list(getattr(item, "fixturenames", ())))
        item.add_marker(pytest.mark.xdist_group(group))
        rank[item.nodeid] = TIERS.index(group) if group in TIERS else len(TIERS)
    items.sort(key=lambda item: rank[item.nodeid])  # stable: file order within a group
