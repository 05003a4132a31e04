"""How ``weightsync demo`` fails: one line naming the step and its cause, the traceback in a log file.

The demos run their work inside :func:`step` blocks, which turn any exception into a :class:`StepError`
naming the step; :func:`run_reporting` (the CLI's wrapper) prints it as

    weightsync demo: step "helm install weightsync charts/weightsync" failed: helm exited 1: Error: ...
    (full log: /tmp/weightsync-demo-XXXX.log)

on one line, writes the full traceback (and any captured stderr) to that log, and returns exit status 1.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

#: What the agents import to move weights; :func:`check_data_plane` loads it before anything starts.
DATA_PLANE_MODULE = "mooncake.engine"
#: The shared libraries the Mooncake Transfer Engine wheel loads, and their Debian packages
#: (hack/system-packages.sh installs them).
DATA_PLANE_LIBRARIES = {"libibverbs": "libibverbs1", "libnuma": "libnuma1", "libcurl": "libcurl4"}
SETUP_HINT = "run ./hack/setup.sh as root, or: sudo apt-get install -y " + " ".join(DATA_PLANE_LIBRARIES.values())
MAX_CAUSE = 400

_MISSING_LIBRARY = re.compile(r"\b(lib[\w+-]+)\.so[.\d]*: cannot open shared object file")
# "Error: ...", "E: ...", "install_tools: error: ...", "ImportError: ..." (the last line of a traceback).
_ERROR_LINE = re.compile(r"^(?:[\w.-]+: )?(?:error|fatal|e)\s*:|^\w*(?:error|exception)\b:", re.IGNORECASE)


class StepError(Exception):
    """A demo step failed; ``cause`` is one line (the original exception is chained as ``__cause__``)."""

    def __init__(self, step: str, cause: str) -> None:
        super().__init__(f'step "{step}" failed: {cause}')
        self.step = step
        self.cause = cause


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    """Any exception inside becomes a :class:`StepError` naming ``name`` (an inner step's name wins)."""
    try:
        yield
    except StepError:
        raise
    except Exception as exc:
        raise StepError(name, describe(exc)) from exc


@contextlib.contextmanager
def cleanup(name: str, failure: BaseException | None) -> Iterator[None]:
    """A :func:`step` that cleans up after ``failure`` (None: after success): then its own failure is only a
    note on ``failure``, which is the one to report."""
    try:
        with step(name):
            yield
    except StepError as exc:
        if failure is None:
            raise
        failure.add_note(f'then step "{name}" failed too: {exc.cause}')


def check_data_plane() -> None:
    """Load the Mooncake Transfer Engine now, so a missing system library fails first and by name."""
    with step("load the data plane (Mooncake Transfer Engine)"):
        importlib.import_module(DATA_PLANE_MODULE)


def describe(exc: BaseException) -> str:
    """One line saying what went wrong, for a person: the command and its error, or the message."""
    if isinstance(exc, StepError):
        return exc.cause
    text = str(exc)
    output = getattr(exc, "stderr", None) or getattr(exc, "output", None) or ""  # a command's
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    missing = _MISSING_LIBRARY.search(f"{text}\n{output}")
    if missing and missing.group(1) in DATA_PLANE_LIBRARIES:
        package = DATA_PLANE_LIBRARIES[missing.group(1)]
        return f"the Mooncake Transfer Engine needs Debian's {package} ({SETUP_HINT})"
    returncode = getattr(exc, "returncode", None)
    if isinstance(returncode, int):  # subprocess.CalledProcessError, session.CommandError
        line = _telling_line(str(output))
        return _short(f"{_program(exc)} exited {returncode}" + (f": {line}" if line else ""))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    message = lines[0] if lines else ""
    if message.endswith(":") and len(lines) > 1:  # "agent of pod 0 exited:\n<its log>"
        rest = "\n".join(lines[1:])
        message = f"{message} {_telling_line(rest)}"
    if not message:
        return type(exc).__name__
    if isinstance(exc, RuntimeError | AssertionError | TimeoutError):
        return _short(message)
    return _short(f"{type(exc).__name__}: {message}")


def run_reporting(command: str, body: Callable[[], int]) -> int:
    """Run a demo; on failure print one line (step, cause, log file) on stderr and return 1."""
    try:
        return body()
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as exc:
        line = f"{command}: {exc}" if isinstance(exc, StepError) else f"{command}: failed: {describe(exc)}"
        log = write_log(command, line, exc)
        print(f"{line} (full log: {log})", file=sys.stderr, flush=True)
        return 1


def write_log(command: str, line: str, exc: BaseException) -> Path:
    """The failure, its traceback and every captured stderr along its chain, in a new file under $TMPDIR."""
    prefix = re.sub(r"[^\w]+", "-", command).strip("-") + "-"
    handle, name = tempfile.mkstemp(prefix=prefix, suffix=".log")
    with open(handle, "w") as out:
        out.write(f"{line}\n\n")
        out.write("".join(traceback.format_exception(exc)))
        chain: list[BaseException] = []
        seen: BaseException | None = exc
        while seen is not None and seen not in chain:
            chain.append(seen)
            seen = seen.__cause__ or seen.__context__
        for link in chain:
            stderr = getattr(link, "stderr", None)
            if isinstance(stderr, bytes):
                stderr = stderr.decode(errors="replace")
            if stderr:
                out.write(f"\n--- stderr of {_program(link)}:\n{stderr}")
    return Path(name)


def _program(exc: BaseException) -> str:
    program = getattr(exc, "program", None)
    if isinstance(program, str):
        return program
    cmd = getattr(exc, "cmd", None)
    argv = [str(a) for a in cmd] if isinstance(cmd, list | tuple) else str(cmd or "a command").split()
    name = Path(argv[0]).name if argv else "a command"
    if name in ("bash", "sh") or name.startswith("python"):  # a script: name it, not its interpreter
        script = next((a for a in argv[1:] if not a.startswith("-")), None)
        return Path(script).name if script else name
    return name


def _telling_line(output: str) -> str:
    """The line of a command's output that most likely says why it failed: the last error line; else the
    first line and the next when it ends in a colon (kubectl's "... is invalid:"); else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.search(line)]
    if errors:
        return _short(errors[-1])
    if len(lines) > 1 and lines[0].endswith(":"):
        return _short(f"{lines[0]} {lines[1]}")
    return _short(lines[-1] if lines else "")


def _short(text: str) -> str:
    return text if len(text) <= MAX_CAUSE else text[: MAX_CAUSE - 1] + "…"
