"""The engine's interpreter and the engine root's entry point, as the agent finds them (it never imports that root).

The engine root (``weightsync_engine``) runs with the ENGINE's Python: the engine pod's agent runs its trace and
engine-replica layout there (``targets/engine_trace.py``), a source's agent its engine-replica loader
(``source/engine_loader.py``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from weightsync_agent.layout.manifest import ManifestError

#: The engine's Python (its image's, in a pod; the pinned engine virtualenv in tests).
ENV_ENGINE_PYTHON = "WEIGHTSYNC_ENGINE_PYTHON"


def engine_python() -> str:
    """The engine's interpreter (``$WEIGHTSYNC_ENGINE_PYTHON``, else this one)."""
    return os.environ.get(ENV_ENGINE_PYTHON) or sys.executable


def trace_script() -> Path:
    """The path of ``weightsync_engine/trace.py``, installed beside the agent; found, not imported."""
    spec = importlib.util.find_spec("weightsync_engine.trace")
    if spec is None or spec.origin is None:
        raise ManifestError("weightsync_engine.trace is not installed beside the agent: no shard-map trace to run")
    return Path(spec.origin)
