"""The pinned, cached virtualenv that runs the stock SGLang server (separate from the project's .venv).

``${WEIGHTSYNC_CACHE:-~/.cache/weightsync}/engines/sglang-0.5.23/`` gets ``pip install --no-deps -r
hack/engines/sglang-requirements.txt`` (``sglang==0.5.23`` plus its exact, pinned CPU-side dependency set),
then a smoke import. A stamp file written last holds the sha256 of the requirements file, the Python version
and :data:`BUILDER_VERSION`; while it matches, :func:`ensure_sglang_env` returns at once. A missing or stale
stamp (an interrupted build, a changed requirements file) rebuilds the venv from scratch. Concurrent builders
serialise on a lock file.

CLI (``hack/engines/sglang-env.sh``, or ``python sglang_env.py``; stdlib only, so any Python >= 3.11 runs it):
prints the venv's python on stdout, progress on stderr, and on failure one line
``sglang-env: <step> failed: <cause> (full log: <file>)`` with exit status 1 (2: PyPI unreachable).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

SGLANG_VERSION = "0.5.23"
BUILDER_VERSION = 1
STAMP = ".weightsync-sglang-env.json"
ENV_PYTHON = "WEIGHTSYNC_SGLANG_PYTHON"
REPO = Path(__file__).resolve().parents[2]
REQUIREMENTS = REPO / "hack" / "engines" / "sglang-requirements.txt"
SMOKE = (
    "import importlib.metadata as m, mooncake.engine, sglang, torch, transformers; "
    "print(m.version('sglang'), torch.__version__, transformers.__version__)"
)
# pip's output when the index cannot be reached (the one case the test tier may skip for).
_UNREACHABLE = re.compile(
    r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|Name or service not known"
    r"|Network is unreachable|Connection refused|ProxyError|ConnectTimeout|Read timed out"
)


class SglangEnvError(RuntimeError):
    """Building the venv failed; ``str()`` is the one-line message, ``log`` the full log."""

    def __init__(self, step: str, cause: str, log: Path) -> None:
        super().__init__(f"sglang-env: {step} failed: {cause} (full log: {log})")
        self.step, self.cause, self.log = step, cause, log


class SglangEnvUnavailable(SglangEnvError):  # noqa: N818 (a kind of SglangEnvError)
    """The package index cannot be reached, so the venv cannot be built on this machine."""


def cache_root() -> Path:
    return Path(os.environ.get("WEIGHTSYNC_CACHE") or Path.home() / ".cache" / "weightsync")


def env_dir(cache: Path | None = None) -> Path:
    return (cache or cache_root()) / "engines" / f"sglang-{SGLANG_VERSION}"


def env_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def stamp_key(requirements: Path, python: str) -> dict[str, str | int]:
    version = subprocess.run(
        [python, "-c", "import platform, sys; print(platform.python_implementation(), *sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    digest = hashlib.sha256(requirements.read_bytes()).hexdigest()
    return {"requirements_sha256": digest, "python": version, "builder": BUILDER_VERSION}


def _progress(message: str) -> None:
    print(f"sglang-env: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_sglang_env(
    cache: Path | None = None,
    *,
    python: str | None = None,
    requirements: Path = REQUIREMENTS,
    quiet: bool = False,
) -> Path:
    """The SGLang venv's python, building the venv first unless its stamp matches ``requirements``.

    ``python``: the interpreter to make the venv with (default ``$PYTHON``, else this one's base
    interpreter). Raises :class:`SglangEnvUnavailable` when pip cannot reach the package index and
    :class:`SglangEnvError` on any other failure."""
    say: Callable[[str], None] = (lambda _m: None) if quiet else _progress
    venv = env_dir(cache)
    log = venv.parent / f"{venv.name}.log"
    if not requirements.is_file():
        raise SglangEnvError("reading requirements", f"{requirements} not found (needs a source checkout)", log)
    base = str(python or os.environ.get("PYTHON") or getattr(sys, "_base_executable", sys.executable))
    try:
        key = stamp_key(requirements, base)
    except (OSError, subprocess.CalledProcessError) as error:
        raise SglangEnvError("checking Python", f"{base}: {error}", log) from error
    if _stamp_matches(venv, key):
        return env_python(venv)
    with _locked(venv.parent / f"{venv.name}.lock"):
        if _stamp_matches(venv, key):  # built by another process while we waited
            return env_python(venv)
        return _build(venv, key, base, requirements, log, say)


def _stamp_matches(venv: Path, key: dict[str, str | int]) -> bool:
    try:
        stamp = json.loads((venv / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return all(stamp.get(k) == v for k, v in key.items()) and env_python(venv).exists()


def _build(
    venv: Path, key: dict[str, str | int], base: str, requirements: Path, log: Path, say: Callable[[str], None]
) -> Path:
    started = time.monotonic()
    log.write_text(f"# sglang-env build {time.strftime('%Y-%m-%d %H:%M:%S')}, {key}\n")
    if venv.exists():
        say(f"removing stale {venv}")
        shutil.rmtree(venv)
    say(f"creating {venv} with {base}")
    _step("creating the venv", [base, "-m", "venv", str(venv)], log)
    python = str(env_python(venv))
    say(f"installing {requirements} (sglang=={SGLANG_VERSION}, torch, ...: ~2 min and ~6 GB on a clean machine)")
    pip = [python, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--no-input"]
    pip += ["--progress-bar", "off", "--retries", "2", "--timeout", "30", "-r", str(requirements)]
    _step("installing the pinned packages", pip, log)
    say("checking that sglang, torch, transformers and mooncake import")
    versions = _step("importing sglang", [python, "-c", SMOKE], log).strip().splitlines()[-1]
    seconds = time.monotonic() - started
    stamp = {**key, "versions": versions, "build_seconds": round(seconds, 1), "built": time.strftime("%Y-%m-%d")}
    (venv / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    say(f"ready in {seconds:.0f} s: {versions}")
    return Path(python)


def _step(name: str, command: list[str], log: Path) -> str:
    with open(log, "a") as out:
        out.write(f"== {name}: {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
        out.write(done.stdout)
    if done.returncode == 0:
        return done.stdout
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    cause = next((line for line in lines if re.match(r"(ERROR|Error|error)\b|\w+Error:", line)), None)
    cause = cause or (lines[-1] if lines else "no output")
    message = f"{command[0] if '-m' not in command else command[command.index('-m') + 1]} exited {done.returncode}: "
    unreachable = _UNREACHABLE.search(done.stdout)
    if unreachable:
        raise SglangEnvUnavailable(name, message + f"cannot reach the package index ({unreachable.group(0)})", log)
    raise SglangEnvError(name, message + cause, log)


def sglang_python(cache: Path | None = None) -> Path:
    """``$WEIGHTSYNC_SGLANG_PYTHON`` if set (it must exist), else the cached venv's python (built if needed)."""
    given = os.environ.get(ENV_PYTHON)
    if given:
        if not Path(given).exists():
            raise SglangEnvError("finding the SGLang python", f"{ENV_PYTHON}={given} does not exist", Path(given))
        return Path(given)
    return ensure_sglang_env(cache)


def venv_size_bytes(venv: Path) -> int:
    return sum(p.stat().st_size for p in venv.rglob("*") if p.is_file() and not p.is_symlink())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build (once) the pinned SGLang venv; print its python.")
    parser.add_argument("--cache", type=Path, default=None, help="cache root (default: $WEIGHTSYNC_CACHE)")
    parser.add_argument("--python", default=None, help="interpreter to make the venv with (default: $PYTHON)")
    parser.add_argument("--requirements", type=Path, default=REQUIREMENTS)
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)
    try:
        python = ensure_sglang_env(args.cache, python=args.python, requirements=args.requirements, quiet=args.quiet)
    except SglangEnvUnavailable as error:
        print(error, file=sys.stderr)
        return 2
    except SglangEnvError as error:
        print(error, file=sys.stderr)
        return 1
    print(python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
