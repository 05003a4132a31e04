"""A stock engine's server running as a local process group (SGLang, vLLM): what their launchers share.

The launchers (``sglang_server.py``, ``vllm_server.py``) build the command and environment of their engine; the
process they start is one of these: its log, plain HTTP calls to it that return errors instead of raising, and a
stop that lets the server shut its children down before the whole process group is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self


@dataclass(kw_only=True)
class ServerProcess:
    process: subprocess.Popen[bytes]
    host: str
    port: int
    log_path: Path
    command: list[str]
    started_s: float = 0.0
    _log: Any = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def call(self, method: str, path: str, body: Any = None, *, timeout: float, bearer: str | None) -> tuple[int, Any]:
        """One HTTP call: ``(status, parsed JSON or text)``; HTTP errors return their status, not raise.
        ``bearer``: sent as ``Authorization: Bearer ...`` when given."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if bearer:
            req.add_header("Authorization", f"Bearer {bearer}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as answer:
                status, raw = answer.status, answer.read()
        except urllib.error.HTTPError as error:
            status, raw = error.code, error.read()
        text = raw.decode(errors="replace")
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the server's leader (it shuts its own children down), then SIGKILL its whole process group.

        Only the leader gets SIGTERM: signalled too, SGLang's children take their exit for a crash and sleep 5 s
        for diagnostics. Children outlive a leader killed first, so the group (its id is the leader's pid: the
        launchers start a new session) is killed after ``grace`` seconds whatever is left."""
        try:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=grace)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            if self.process.poll() is None:
                self.process.wait(timeout=grace)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
