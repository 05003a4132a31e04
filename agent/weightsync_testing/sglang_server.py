"""Start the stock SGLang server (as PyPI ships it) from its own venv, and wait until it serves.

Runs in the project's venv and never imports ``sglang``: it spawns ``python -m sglang.launch_server`` with the
SGLang venv's interpreter (``weightsync_testing.sglang_env``). On ``--device cpu`` it adds the flags of the
stock-engines note (§5b) and puts ``weightsync_testing/sglang_cpu`` on the server's ``PYTHONPATH``, enabling
only the workarounds that TP size needs; their evidence lands in :attr:`SglangProcess.workaround_log`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from weightsync.ports import free_port
from weightsync_testing import sglang_cpu
from weightsync_testing.server_process import ServerProcess, ServerStartError, engine_server_env, launch, log_file


class SglangStartError(ServerStartError):
    """The server exited or did not become ready in time; the message names its log file and ends with its tail."""


@dataclass(kw_only=True)
class SglangProcess(ServerProcess):
    engine_name: ClassVar[str] = "SGLang"
    start_error: ClassVar[type[ServerStartError]] = SglangStartError

    bootstrap_port: int
    tp: int
    workaround_log: Path
    workarounds: list[str]
    admin_api_key: str | None = None

    def workaround_events(self) -> list[dict[str, Any]]:
        """The JSON lines the CPU workarounds wrote (``sglang_cpu/sitecustomize.py``)."""
        try:
            text = self.workaround_log.read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def request(
        self, method: str, path: str, body: Any = None, *, timeout: float = 30.0, admin: bool = True
    ) -> tuple[int, Any]:
        """One HTTP call (see :meth:`ServerProcess.call`), with the admin key unless ``admin`` is false."""
        return self.call(method, path, body, timeout=timeout, bearer=self.admin_api_key if admin else None)

    def ready_bearer(self) -> str | None:
        return self.admin_api_key


def omp_bind(tp: int) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND``: this process's CPUs split into ``tp`` contiguous groups, ``a-b|c-d``.

    Without it SGLang's ``numa_utils.py`` asserts that TP ranks <= NUMA nodes."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        cpus = [cpus[i % len(cpus)] for i in range(tp)]
    per = len(cpus) // tp
    groups = [cpus[i * per : (i + 1) * per] for i in range(tp)]
    return "|".join(str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}" for g in groups)


def server_command(
    python: str | Path,
    model_dir: Path,
    *,
    host: str,
    port: int,
    bootstrap_port: int,
    tp: int = 1,
    device: str = "cpu",
    admin_api_key: str | None = None,
    transfer_engine: bool = True,
    dtype: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    command = [str(python), "-m", "sglang.launch_server", "--model-path", str(model_dir), "--device", device]
    command += ["--host", host, "--port", str(port), "--tp-size", str(tp)]
    if device == "cpu":
        command += ["--attention-backend", "torch_native", "--disable-cuda-graph", "--sleep-on-idle"]
        # --max-total-tokens caps the KV pool; the fraction only has to pass SGLang's CPU memory profile, which
        # reads the machine's free memory before and after loading: another process allocating meanwhile (the
        # suite's other worker) made 0.05 fail with "Loaded weights leave no GPU memory for the KV cache".
        command += ["--mem-fraction-static", "0.5", "--max-total-tokens", "2048"]
        if tp >= 2:
            command += ["--disable-custom-all-reduce"]
    if transfer_engine:
        command += ["--remote-instance-weight-loader-start-seed-via-transfer-engine"]
        command += ["--engine-info-bootstrap-port", str(bootstrap_port)]
    if dtype:
        command += ["--dtype", dtype]
    if admin_api_key:
        command += ["--admin-api-key", admin_api_key]
    return command + list(extra_args)


def launch_sglang(
    model_dir: Path | str,
    *,
    tp: int = 1,
    port: int = 0,
    bootstrap_port: int = 0,
    admin_api_key: str | None = None,
    extra_env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    python: str | Path | None = None,
    device: str = "cpu",
    host: str = "127.0.0.1",
    transfer_engine: bool = True,
    dtype: str | None = None,
    log_dir: Path | None = None,
    timeout: float = 180.0,
    healthy: bool = True,
    pythonpath: Sequence[Path] = (),
) -> SglangProcess:
    """Start ``sglang.launch_server`` on ``model_dir`` and return once ``/health`` and ``/model_info`` answer.

    ``python``: the SGLang venv's interpreter (default: ``$WEIGHTSYNC_SGLANG_PYTHON``, else the cached venv,
    created if missing). ``port``/``bootstrap_port`` 0 pick free ports. ``dtype``: ``--dtype`` (SGLang's
    ``auto`` serves a float32 checkpoint in bfloat16). Raises :class:`SglangStartError` naming
    the log file if the server exits or is not ready within ``timeout`` seconds (then it is stopped).
    ``healthy=False``: ready once ``/model_info`` answers, without ``/health`` (which answers 503 while generation
    is paused: a restarted engine of a running group may be paused by a catch-up before its first health check).
    ``pythonpath``: more directories on the server's ``PYTHONPATH``, after the CPU workarounds' (the directory holding
    ``weightsync_engine``, for a ``--custom-weight-loader`` from it)."""
    if python is None:
        from weightsync_testing.sglang_env import sglang_python

        python = sglang_python()
    port = port or free_port(host)
    bootstrap_port = bootstrap_port or free_port(host)
    log = log_file(log_dir, "sglang", port)
    workaround_log = log.with_name(f"sglang-{port}-workarounds.jsonl")
    workaround_log.unlink(missing_ok=True)
    mla = sglang_cpu.uses_mla(Path(model_dir))
    workarounds = sglang_cpu.workarounds_for(tp, transfer_engine=transfer_engine, mla=mla) if device == "cpu" else []
    command = server_command(
        python,
        Path(model_dir),
        host=host,
        port=port,
        bootstrap_port=bootstrap_port,
        tp=tp,
        device=device,
        admin_api_key=admin_api_key,
        transfer_engine=transfer_engine,
        dtype=dtype,
        extra_args=extra_args,
    )
    return launch(
        command,
        lambda process, opened: SglangProcess(
            process=process,
            host=host,
            port=port,
            bootstrap_port=bootstrap_port,
            tp=tp,
            log_path=log,
            workaround_log=workaround_log,
            workarounds=workarounds,
            command=command,
            admin_api_key=admin_api_key,
            _log=opened,
        ),
        env=engine_server_env(
            _cpu_env(tp, workarounds, workaround_log, device=device), extra_env, _pythonpath(pythonpath, device=device)
        ),
        log_path=log,
        ready=("/health", "/model_info") if healthy else ("/model_info",),
        timeout=timeout,
    )


def _pythonpath(more: Sequence[Path], *, device: str) -> dict[str, str]:
    """``PYTHONPATH`` with ``more`` after what the CPU workarounds put there (nothing: no change)."""
    if not more:
        return {}
    first = [str(sglang_cpu.DIRECTORY)] if device == "cpu" else []
    return {"PYTHONPATH": os.pathsep.join([*first, *(str(p) for p in more)])}


def _cpu_env(tp: int, workarounds: Sequence[str], workaround_log: Path, *, device: str) -> dict[str, str]:
    """On CPU: the workarounds ``tp`` needs (``sglang_cpu``, loaded by its ``sitecustomize``) and the threads' CPUs."""
    if device != "cpu":
        return {}
    env = {
        "PYTHONPATH": str(sglang_cpu.DIRECTORY),
        sglang_cpu.ENV_ENABLE: ",".join(workarounds),
        sglang_cpu.ENV_LOG: str(workaround_log),
    }
    if tp >= 2:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = omp_bind(tp)
    return env
