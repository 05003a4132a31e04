"""How the loopback group starts an engine of each kind: the reference engine, or a stock SGLang server.

A harness starts engine ``e`` as local processes. Whether the engine also needs its own agent is the
adapter's to say (``manifests_from_engine_agent``), not the harness's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_agent.targets.engine_client import EngineClient
from weightsync_testing.reference_engine.launch import launch_engine


@dataclass
class StartedEngine:
    url: str
    stop: Callable[[], None]
    #: Extra environment for this engine's agent (e.g. which Python runs the engine's own code).
    agent_env: dict[str, str]

    def client(self, timeout: float = 15.0) -> EngineClient:
        return EngineClient(self.url, timeout=timeout)


class EngineHarness(Protocol):
    def start(self, engine: int, spec: WeightSyncGroupSpec, seed: int) -> StartedEngine: ...


class ReferenceEngines:
    def start(self, engine: int, spec: WeightSyncGroupSpec, seed: int) -> StartedEngine:
        process = launch_engine(
            engine,
            spec.inference.ranks_per_engine,
            seed=seed,
            staged=spec.transfer.target_staging == "staged",
            extra=("--transfer-timeout", str(spec.transfer.timeout_seconds)),
        )
        return StartedEngine(process.url, process.stop, {})


class SglangEngines:
    """Stock SGLang servers on a model directory (CPU, the pinned venv; weightsync_testing.sglang_server)."""

    def __init__(self, model_dir: Path, *, python: str, dtype: str = "float32", log_dir: Path | None = None) -> None:
        self.model_dir = model_dir
        self.python = python
        self.dtype = dtype
        self.log_dir = log_dir
        self.servers: dict[int, object] = {}

    def start(self, engine: int, spec: WeightSyncGroupSpec, seed: int) -> StartedEngine:
        from weightsync_testing.sglang_server import launch_sglang

        server = launch_sglang(
            self.model_dir,
            tp=spec.inference.ranks_per_engine,
            python=self.python,
            dtype=self.dtype,
            log_dir=self.log_dir,
        )
        self.servers[engine] = server
        return StartedEngine(server.url, server.stop, {"WEIGHTSYNC_ENGINE_PYTHON": self.python})
