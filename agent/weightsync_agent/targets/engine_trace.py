"""Running a stock engine's shard-map trace (``weightsync_engine/trace.py``) with the ENGINE's Python.

The trace imports the engine's own model code, which only the engine's image has: the engine pod's agent runs it as
a subprocess of ``$WEIGHTSYNC_ENGINE_PYTHON`` (the engine image's interpreter; the pinned engine virtualenv in tests),
one TP rank at a time, and reads its one JSON object. Shared by the SGLang and vLLM adapters. The script belongs to
the engine root, which the agent never imports: it only asks where the file is (:func:`trace_script`).
"""

from __future__ import annotations

import importlib.util
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


def trace_script() -> Path:
    """The path of ``weightsync_engine/trace.py``, installed beside the agent; found, not imported."""
    spec = importlib.util.find_spec("weightsync_engine.trace")
    if spec is None or spec.origin is None:
        raise ManifestError("weightsync_engine.trace is not installed beside the agent: no shard-map trace to run")
    return Path(spec.origin)


def run_trace(engine: str, *, model: str, tp: int, rank: int, dtype: str, who: str) -> dict[str, Any]:
    """The ``engine`` (``sglang``, ``vllm``) trace of TP rank ``rank`` of ``model`` at TP size ``tp`` in ``dtype``;
    ManifestError naming ``who`` and the trace's last lines when it fails or does not print JSON."""
    python = os.environ.get(ENV_ENGINE_PYTHON) or sys.executable
    script = str(trace_script())
    command = [python, script, engine, "--model", model, "--tp", str(tp), "--rank", str(rank), "--dtype", dtype]
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
