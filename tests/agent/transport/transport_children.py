"""Child processes for the transport tests (helper scripts of this folder), reaped by conftest's fixtures."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


class Child:
    """A helper script from this folder, talking one JSON line per request on stdin/stdout."""

    def __init__(self, script: str, *args: str) -> None:
        self.script = script
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in close()); glog chatter
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.info: Any = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read(self, timeout: float = 60.0) -> Any:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"{self.script} gave no answer within {timeout}s; stderr:\n{self.stderr()}")
        return json.loads(line)

    def ask(self, line: str, timeout: float = 60.0) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()[-4000:]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def request_exit(self) -> None:
        """Ask the child to quit (it also quits on EOF); resumes it first if it was stopped."""
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            assert self.proc.stdin is not None
            if self.proc.stdin.closed:
                return
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            except OSError:
                pass

    def close(self, grace: float = 10.0) -> None:
        self.request_exit()
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def close_all(children: list[Child]) -> None:
    """Quit them all at once (each closes its engines, about 1 s apiece), then reap them."""
    for child in children:
        child.request_exit()
    for child in reversed(children):
        child.close()
