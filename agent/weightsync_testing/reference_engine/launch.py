"""Start a reference engine as its own process and wait for its ready line (demo, tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

from weightsync.api import names
from weightsync_agent.targets.engine_client import EngineClient


@dataclass
class EngineProcess:
    process: subprocess.Popen[str]
    ready: dict[str, Any]
    log: IO[str] = field(repr=False)
    #: The credential its routes require (None: an open engine).
    token: str | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return str(self.ready["url"])

    def client(self, timeout: float = 15.0) -> EngineClient:
        return EngineClient(self.url, timeout=timeout, api_key=self.token)

    def stop(self) -> None:
        stop_process(self.process)
        self.log.close()

    def stderr_tail(self, lines: int = 40) -> str:
        self.log.seek(0)
        return "\n".join(self.log.read().splitlines()[-lines:])


def stop_process(process: subprocess.Popen[Any], *, kill: bool = False, grace: float = 15.0) -> None:
    """SIGTERM (or SIGKILL) and reap; escalate to SIGKILL after ``grace`` seconds."""
    if process.poll() is not None:
        return
    if kill:
        process.kill()
    else:
        process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def launch_engine(
    engine: int,
    tp: int,
    *,
    seed: int = 0,
    port: int = 0,
    transport: str = "mooncake",
    host: str = "127.0.0.1",
    staged: bool = False,
    extra: tuple[str, ...] = (),
    timeout: float = 60.0,
    wrap: tuple[str, ...] = (),
    token: str | None = None,
    env: dict[str, str] | None = None,
) -> EngineProcess:
    """``port`` 0 picks a free one. ``wrap`` prefixes the command (the testbed runs
    ``ip netns exec NS env VAR=... python ...``). ``token``: the group's credential its routes require
    (``WEIGHTSYNC_GROUP_TOKEN`` in its environment, as the operator gives the engine container). ``env``: more
    variables, e.g. Mooncake's port range as the operator sets it (``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT``)."""
    command = [
        *wrap,
        sys.executable, "-m", "weightsync_testing.reference_engine.server",
        "--engine", str(engine), "--tp", str(tp), "--port", str(port), "--seed", str(seed),
        "--transport", transport, "--host", host, *(["--staged"] if staged else []), *extra,
    ]  # fmt: skip
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 — lives as long as the process
    environment = {k: v for k, v in os.environ.items() if k != names.ENV_GROUP_TOKEN} | (env or {})
    if token:
        environment[names.ENV_GROUP_TOKEN] = token
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=environment)
    started = EngineProcess(process, {}, log, token)
    deadline = time.monotonic() + timeout
    try:
        while True:
            line = _read_line(process, max(0.1, deadline - time.monotonic()))
            if not line:
                raise RuntimeError(f"engine {engine} exited before it was ready:\n{started.stderr_tail()}")
            if line.startswith("{"):  # Mooncake may log to stdout before the ready line
                message = json.loads(line)
                if message.get("event") == "ready":
                    started.ready = message
                    return started
    except BaseException:
        started.stop()
        raise


def _read_line(process: subprocess.Popen[str], timeout: float) -> str:
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(process.stdout.readline() if process.stdout else ""))
    reader.daemon = True
    reader.start()
    reader.join(timeout)
    if not out:
        raise TimeoutError(f"no output from the engine within {timeout:.0f} s")
    return out[0]
