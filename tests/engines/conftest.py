"""What the two stock-engine tiers (``sglang/``, ``vllm/``) share: each runs its engine from its own pinned venv,
skips only when that venv cannot be built for want of the package index (unless CI requires the tier), and stops
its session servers (~1 GB RSS each) as soon as the run leaves the tier's directory, not at the end of the run."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_tier import SESSION_SERVERS, leave_tier


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    for tier, servers in SESSION_SERVERS.items():
        if servers and (nextitem is None or tier not in Path(nextitem.path).resolve().parents):
            leave_tier(tier)
