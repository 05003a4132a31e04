"""Running a stock engine's shard-map trace (``targets/<engine>/trace_model.py``) with the ENGINE's Python.

The trace imports the engine's own model code, which only the engine's image has: the engine pod's agent runs it as
a subprocess of ``$WEIGHTSYNC_ENGINE_PYTHON`` (the engine image's interpreter; the pinned engine virtualenv in tests),
one TP rank at a time, and reads its one JSON object. Shared by the SGLang and vLLM adapters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from weightsync_agent.layout.manifest import ManifestError

#: The engine's Python (its image's, in a pod; the pinned engine virtualenv in tests).
ENV_ENGINE_PYTHON = "WEIGHTSYNC_ENGINE_PYTHON"
TRACE_TIMEOUT_SECONDS = 300.0


def run_trace(script: Path, *, model: str, tp: int, rank: int, dtype: str, who: str) -> dict[str, Any]:
    """The trace of TP rank ``rank`` of ``model`` at TP size ``tp`` in ``dtype``; ManifestError naming ``who`` and
    the trace's last lines when it fails or does not print JSON."""
    python = os.environ.get(ENV_ENGINE_PYTHON) or sys.executable
    command = [python, str(script), "--model", model, "--tp", str(tp), "--rank", str(rank), "--dtype", dtype]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TRACE_TIMEOUT_SECONDS, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ManifestError(f"{who}: tracing rank {rank}'s model took over {TRACE_TIMEOUT_SECONDS:g} s") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ManifestError(f"{who}: tracing rank {rank}'s model failed: {' | '.join(tail)}")
    try:
        trace: dict[str, Any] = json.loads(done.stdout)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{who}: the trace of rank {rank} is not JSON: {exc}") from exc
    return trace
