"""The stock SGLang server tier: PyPI ``sglang==0.5.23``, unedited, on CPU (docs/engines/sglang-testing.md).

The SGLang venv comes from ``$WEIGHTSYNC_SGLANG_PYTHON`` (hack/test.sh exports it) or is built here
(``weightsync_testing.sglang_env``, ~2 min and ~6 GB the first time, cached). The tier skips, with the reason,
only when that build is impossible because the package index is unreachable; ``WEIGHTSYNC_REQUIRE_SGLANG=1``
(set by CI) turns that skip into a failure. Any other build failure fails.

One TP=1 server on the tiny Llama serves the whole session (start ~20 s); the TP=2 test starts its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_tier import engine_python, session_server, shared_server
from sglang_helpers import start

from weightsync_testing.sglang_env import SGLANG
from weightsync_testing.sglang_models import ensure_tiny_model
from weightsync_testing.sglang_server import SglangProcess

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def sglang_py() -> Path:
    return engine_python(SGLANG)


@pytest.fixture(scope="session")
def tiny_llama(sglang_py: Path) -> Path:
    return ensure_tiny_model(sglang_py, "llama", seed=0, dtype="float32")


@pytest.fixture(scope="session")
def tiny_qwen3(sglang_py: Path) -> Path:
    return ensure_tiny_model(sglang_py, "qwen3", seed=0, dtype="float32")


@pytest.fixture(scope="session")
@shared_server
def server(sglang_py: Path, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SglangProcess]:
    """A TP=1 stock SGLang server on the tiny Llama (float32), with an admin key."""
    yield from session_server(HERE, start(sglang_py, tiny_llama, tmp_path_factory.mktemp("sglang-tp1"), tp=1))


@pytest.fixture(scope="session")
def tiny_qwen3_moe(sglang_py: Path) -> Path:
    return ensure_tiny_model(sglang_py, "qwen3_moe", seed=0, dtype="float32")


@pytest.fixture(scope="session")
def tiny_deepseek_v3(sglang_py: Path) -> Path:
    """Kimi-K2's architecture, tiny: MLA with q-LoRA, a dense layer, then MoE with a shared expert (float32)."""
    return ensure_tiny_model(sglang_py, "deepseek_v3", seed=0, dtype="float32")
