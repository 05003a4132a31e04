"""A stock engine's server running as a local process group (SGLang, vLLM): what their launchers share.

The launchers (``sglang_server.py``, ``vllm_server.py``) build the command and the engine's own environment
settings, then :func:`launch` starts it: its log, a new session (so it can be stopped as a process group), and a
wait until its readiness paths answer. The process is a :class:`ServerProcess`: plain HTTP calls to it that
return errors instead of raising, and a stop that lets the server shut its children down before the whole
process group is killed.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar, Self, TypeVar

#: The attribute that marks a fixture function yielding a test tier's session server (tests/conftest.py groups
#: the modules that use it into one worker).
SHARED_SERVER = "weightsync_shared_server"

#: Shutdowns still running in the background (:func:`retire`).
_retiring: list[threading.Thread] = []


def retire(*stops: Callable[[], None]) -> None:
    """Run the ``stops`` (servers' shutdowns) side by side on a background thread and return at once.

    A stock server's shutdown mostly waits: SGLang notices SIGTERM on a 5-second poll, then its children exit;
    a test's teardown need not wait for that while the next test starts its own servers (docs/testing.md, "Time").
    Only for servers nothing will start again on the same port. :func:`join_retired` (the test session's end,
    and the interpreter's exit) waits for every one, so no server outlives the run."""

    thread = threading.Thread(target=stop_side_by_side, args=stops, name="retire-servers", daemon=True)
    thread.start()
    _retiring.append(thread)


def stop_side_by_side(*stops: Callable[[], None]) -> None:
    """Run the ``stops`` on threads of their own and return when all are done (a group's engines stop in the
    time of the slowest, not of their sum)."""
    threads = [threading.Thread(target=stop, daemon=True) for stop in stops]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


@atexit.register
def join_retired() -> None:
    """Wait until every server handed to :func:`retire` has stopped."""
    while _retiring:
        _retiring.pop().join()


class ServerStartError(RuntimeError):
    """The server exited or did not become ready in time; the message names its log file and ends with its tail."""


@dataclass(kw_only=True)
class ServerProcess:
    #: The engine, as the start errors name it.
    engine_name: ClassVar[str] = "engine"
    start_error: ClassVar[type[ServerStartError]] = ServerStartError

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

    def ready_bearer(self) -> str | None:
        """The token the readiness calls send (the engine's own key, where it has one)."""
        return None

    def wait_ready(self, paths: Sequence[str], timeout: float) -> None:
        """Until each of ``paths`` answers a GET with 200 in turn, the last one with a JSON object; raises
        :attr:`start_error` if the server exits first or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise self.start_error(
                    f"{self.engine_name} server exited with code {code} before it was ready (log: {self.log_path})\n"
                    + self.log_tail(25)
                )
            try:
                status, body = 200, None
                for path in paths:
                    status, body = self.call("GET", path, timeout=5.0, bearer=self.ready_bearer())
                    if status != 200:
                        break
                if status == 200 and isinstance(body, dict):
                    return
                last = f"HTTP {status}: {str(body)[:200]}"
            except (OSError, urllib.error.URLError) as error:
                last = str(error)
            time.sleep(0.5)
        raise self.start_error(
            f"{self.engine_name} server not ready after {timeout:.0f} s ({last}; log: {self.log_path})\n"
            + self.log_tail(25)
        )

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


ServerT = TypeVar("ServerT", bound=ServerProcess)


def engine_server_env(*settings: Mapping[str, str] | None) -> dict[str, str]:
    """This process's environment for an engine server, plus each of ``settings`` in turn (a later one wins).

    Without the project's Python paths: the server runs from its engine's own venv. Offline: the tests' models are
    local directories, and a lookup on the Hub would only slow the start (or fail on a machine without network).
    Mooncake over TCP: the test machines have no RDMA devices."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", MOONCAKE_PROTOCOL="tcp")
    for more in settings:
        env.update(more or {})
    return env


def log_file(log_dir: Path | None, engine: str, port: int) -> Path:
    """``<log_dir>/<engine>-<port>.log``, ``log_dir`` created (default: a new temporary directory)."""
    directory = Path(log_dir or tempfile.mkdtemp(prefix=f"weightsync-{engine}-"))
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"{engine}-{port}.log"


def launch(
    command: Sequence[str],
    make: Callable[[subprocess.Popen[bytes], IO[bytes]], ServerT],
    *,
    env: Mapping[str, str],
    log_path: Path,
    ready: Sequence[str],
    timeout: float,
    shown: Sequence[str] | None = None,
) -> ServerT:
    """Start ``command`` in a new session, its output in ``log_path`` (after a ``$ <command>`` line: ``shown``,
    where the command holds a secret), and return once the server is ready (:meth:`ServerProcess.wait_ready` on
    the paths ``ready``); stopped if it is not. ``make``: the engine's :class:`ServerProcess` of the process and
    its open log (the server closes it when it stops)."""
    log = open(log_path, "wb")  # noqa: SIM115 (closed by ServerProcess.stop)
    log.write(("$ " + " ".join(command if shown is None else shown) + "\n").encode())
    log.flush()
    started = time.monotonic()
    process = subprocess.Popen(
        list(command), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    server = make(process, log)
    try:
        server.wait_ready(ready, timeout)
    except BaseException:
        server.stop(grace=5.0)
        raise
    server.started_s = time.monotonic() - started
    return server
