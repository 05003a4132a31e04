"""The stock SGLang server tier: PyPI ``sglang==0.5.23``, unedited, on CPU (docs/engines/sglang-testing.md).

The SGLang venv comes from ``$WEIGHTSYNC_SGLANG_PYTHON`` (hack/test.sh exports it) or is built here
(``weightsync_testing.sglang_env``, ~2 min and ~6 GB the first time, cached). The tier skips, with the reason,
only when that build is impossible because the package index is unreachable; ``WEIGHTSYNC_REQUIRE_SGLANG=1``
(set by CI) turns that skip into a failure. Any other build failure fails.

One TP=1 server on the tiny Llama serves the whole session (start ~20 s); the TP=2 test starts its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from sglang_helpers import start

from weightsync_testing.sglang_env import SglangEnvError, SglangEnvUnavailable, sglang_python
from weightsync_testing.sglang_models import ensure_tiny_model
from weightsync_testing.sglang_server import SglangProcess

REQUIRE = os.environ.get("WEIGHTSYNC_REQUIRE_SGLANG") == "1"
HERE = Path(__file__).resolve().parent
_session_servers: list[SglangProcess] = []


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the session's servers (~1 GB RSS per process) as soon as the run leaves this directory, rather
    than at the very end of the whole test session."""
    if _session_servers and (nextitem is None or HERE not in Path(nextitem.path).resolve().parents):
        while _session_servers:
            _session_servers.pop().stop()


@pytest.fixture(scope="session")
def sglang_py() -> Path:
    try:
        return sglang_python()
    except SglangEnvUnavailable as error:
        if REQUIRE:
            pytest.fail(f"WEIGHTSYNC_REQUIRE_SGLANG=1 and the SGLang venv cannot be built: {error}")
        pytest.skip(f"stock SGLang venv cannot be built here ({error}); WEIGHTSYNC_REQUIRE_SGLANG=1 fails instead")
    except SglangEnvError as error:
        pytest.fail(str(error))


@pytest.fixture(scope="session")
def tiny_llama(sglang_py: Path) -> Path:
    return ensure_tiny_model(sglang_py, "llama", seed=0, dtype="float32")


@pytest.fixture(scope="session")
def tiny_qwen3(sglang_py: Path) -> Path:
    return ensure_tiny_model(sglang_py, "qwen3", seed=0, dtype="float32")


@pytest.fixture(scope="session")
def server(sglang_py: Path, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SglangProcess]:
    """A TP=1 stock SGLang server on the tiny Llama (float32), with an admin key."""
    proc = start(sglang_py, tiny_llama, tmp_path_factory.mktemp("sglang-tp1"), tp=1)
    _session_servers.append(proc)
    try:
        yield proc
    finally:
        proc.stop()
