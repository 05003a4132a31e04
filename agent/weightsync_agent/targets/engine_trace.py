"""Running a stock engine's shard-map trace (``weightsync_engine/trace.py``) with the ENGINE's Python.

The trace imports the engine's own model code, which only the engine's image has: the engine pod's agent runs it as
a subprocess of ``$WEIGHTSYNC_ENGINE_PYTHON`` (the engine image's interpreter; the pinned engine virtualenv in tests),
one TP rank at a time, and reads its one JSON object. Shared by the SGLang and vLLM adapters. The script belongs to
the engine root, which the agent never imports: it only asks where the file is (:func:`trace_script`).
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

from weightsync_agent.engine_python import ENV_ENGINE_PYTHON, engine_python, trace_script
from weightsync_agent.layout.manifest import ManifestError

__all__ = ["ENV_ENGINE_PYTHON", "engine_python", "run_replica_layout", "run_trace", "trace_script"]

TRACE_TIMEOUT_SECONDS = 300.0


def run_trace(engine: str, *, model: str, tp: int, rank: int, dtype: str, who: str) -> dict[str, Any]:
    """The ``engine`` (``sglang``, ``vllm``) trace of TP rank ``rank`` of ``model`` at TP size ``tp`` in ``dtype``;
    ManifestError naming ``who`` and the trace's last lines when it fails or does not print JSON."""
    args = [engine, "--model", model, "--tp", str(tp), "--rank", str(rank), "--dtype", dtype]
    return _run(args, f"tracing rank {rank}'s model", who)


def run_replica_layout(
    engine: str, *, model: str, tp: int, rank: int, dtype: str, ep: int = 1, dp: int = 1, who: str
) -> dict[str, Any]:
    """The engine-replica layout of TP rank ``rank`` (``weightsync_engine/<engine>/replica_serve.py``), checked
    against the engine's own load; ManifestError naming ``who`` when it fails."""
    args = [engine, "--replica-layout", "--model", model, "--tp", str(tp), "--rank", str(rank), "--dtype", dtype]
    return _run([*args, "--ep", str(ep), "--dp", str(dp)], f"building rank {rank}'s engine replica", who)


def _run(args: list[str], doing: str, who: str) -> dict[str, Any]:
    command = [engine_python(), str(trace_script()), *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TRACE_TIMEOUT_SECONDS, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ManifestError(f"{who}: {doing} took over {TRACE_TIMEOUT_SECONDS:g} s") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ManifestError(f"{who}: {doing} failed: {' | '.join(tail)}")
    try:
        answer: dict[str, Any] = json.loads(done.stdout)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{who}: {doing} did not print JSON: {exc}") from exc
    return answer
