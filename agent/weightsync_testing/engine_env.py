"""The builder of the pinned, cached virtualenvs that run stock inference engines (SGLang, vLLM) in tests.

Each engine venv is separate from the project's .venv, as in the engine's own image:
``${WEIGHTSYNC_CACHE:-~/.cache/weightsync}/engines/<dir name>/`` gets ``pip install --no-deps -r <requirements>``
(the engine's package plus its exact, pinned dependency set), then a smoke import. A stamp file written last
holds the sha256 of the requirements file, the Python version and the builder version; while it matches,
:func:`ensure_env` returns at once. A missing or stale stamp (an interrupted build, a changed requirements
file) rebuilds the venv from scratch. Concurrent builders serialise on a lock file next to the venv.

One engine is one :class:`EngineEnv` (``sglang_env.SGLANG``, ``vllm_env.VLLM``); failures raise that engine's
:class:`EngineEnvError` subclasses, whose ``str()`` is one line ``<engine>-env: <step> failed: <cause> (full
log: <file>)``. Stdlib only, so any Python >= 3.11 runs the engines' CLIs (:func:`cli`).
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
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# pip's output when the index cannot be reached (the one case a test tier may skip for).
_UNREACHABLE = re.compile(
    r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|Name or service not known"
    r"|Network is unreachable|Connection refused|ProxyError|ConnectTimeout|Read timed out"
)


class EngineEnvError(RuntimeError):
    """Building an engine venv failed; ``str()`` is the one-line message, ``log`` the full log.

    Subclasses set :attr:`prefix` (the CLI's name, ``sglang-env``)."""

    prefix = "engine-env"

    def __init__(self, step: str, cause: str, log: Path) -> None:
        super().__init__(f"{self.prefix}: {step} failed: {cause} (full log: {log})")
        self.step, self.cause, self.log = step, cause, log


class EngineEnvUnavailable(EngineEnvError):  # noqa: N818 (a kind of EngineEnvError)
    """The package index cannot be reached, so the venv cannot be built on this machine."""


@dataclass(frozen=True)
class EngineEnv:
    """What differs between engines; the build itself is the same. By convention, the engine's name also names its
    requirements file, stamp, interpreter variable and error classes."""

    name: str  # "sglang": the CLI prefix ("sglang-env") and progress lines
    dir_name: str  # the venv's directory under <cache>/engines/, with the engine's version
    smoke: str  # python -c source run in the new venv; its last stdout line is recorded in the stamp
    what: str  # the progress line's summary of what is installed, with its rough cost
    builder_version: int = 1  # bump to rebuild every cached venv of this engine after a builder change
    #: ``<Name>EnvError``: this engine's :class:`EngineEnvError`, so that a caller can tell one engine's failure
    #: from another's. Bound in ``weightsync_testing.<name>_env`` under its name.
    error: type[EngineEnvError] = field(init=False, repr=False, compare=False)
    #: ``<Name>EnvUnavailable``: a subclass of :attr:`error` and of :class:`EngineEnvUnavailable`.
    unavailable: type[EngineEnvUnavailable] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        title, module = self.name.capitalize(), f"weightsync_testing.{self.name}_env"
        error = type(
            f"{title}EnvError",
            (EngineEnvError,),
            {
                "__doc__": f"Building the {self.name} venv failed; ``str()`` is the one-line message, ``log`` the log.",
                "__module__": module,
                "prefix": f"{self.name}-env",
            },
        )
        unavailable = type(
            f"{title}EnvUnavailable",
            (error, EngineEnvUnavailable),
            {"__doc__": EngineEnvUnavailable.__doc__, "__module__": module},
        )
        object.__setattr__(self, "error", error)
        object.__setattr__(self, "unavailable", unavailable)

    @property
    def requirements(self) -> Path:
        return REPO / "hack" / "engines" / f"{self.name}-requirements.txt"

    @property
    def stamp(self) -> str:
        """The stamp file's name inside the venv."""
        return f".weightsync-{self.name}-env.json"

    @property
    def env_python(self) -> str:
        """The environment variable naming an already built interpreter (tests, hack/test.sh)."""
        return f"WEIGHTSYNC_{self.name.upper()}_PYTHON"

    def env_dir(self, cache: Path | None = None) -> Path:
        return env_dir(self, cache)

    def ensure(
        self,
        cache: Path | None = None,
        *,
        python: str | None = None,
        requirements: Path | None = None,
        quiet: bool = False,
    ) -> Path:
        """:func:`ensure_env` of this engine."""
        return ensure_env(self, cache, python=python, requirements=requirements, quiet=quiet)

    def python(self, cache: Path | None = None) -> Path:
        """:func:`engine_python` of this engine."""
        return engine_python(self, cache)

    def main(self, argv: list[str] | None = None) -> int:
        """:func:`cli` of this engine."""
        return cli(self, argv)


def cache_root() -> Path:
    return Path(os.environ.get("WEIGHTSYNC_CACHE") or Path.home() / ".cache" / "weightsync")


def env_dir(engine: EngineEnv, cache: Path | None = None) -> Path:
    return (cache or cache_root()) / "engines" / engine.dir_name


def env_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def stamp_key(requirements: Path, python: str, builder_version: int) -> dict[str, str | int]:
    version = subprocess.run(
        [python, "-c", "import platform, sys; print(platform.python_implementation(), *sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    digest = hashlib.sha256(requirements.read_bytes()).hexdigest()
    return {"requirements_sha256": digest, "python": version, "builder": builder_version}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_env(
    engine: EngineEnv,
    cache: Path | None = None,
    *,
    python: str | None = None,
    requirements: Path | None = None,
    quiet: bool = False,
) -> Path:
    """The engine venv's python, building the venv first unless its stamp matches ``requirements``.

    ``python``: the interpreter to make the venv with (default ``$PYTHON``, else this one's base
    interpreter). Raises ``engine.unavailable`` when pip cannot reach the package index and ``engine.error``
    on any other failure."""
    requirements = requirements or engine.requirements
    say: Callable[[str], None] = (lambda _m: None) if quiet else _progress(engine.name)
    venv = env_dir(engine, cache)
    log = venv.parent / f"{venv.name}.log"
    if not requirements.is_file():
        raise engine.error("reading requirements", f"{requirements} not found (needs a source checkout)", log)
    base = str(python or os.environ.get("PYTHON") or getattr(sys, "_base_executable", sys.executable))
    try:
        key = stamp_key(requirements, base, engine.builder_version)
    except (OSError, subprocess.CalledProcessError) as error:
        raise engine.error("checking Python", f"{base}: {error}", log) from error
    if _stamp_matches(venv, engine.stamp, key):
        return env_python(venv)
    with _locked(venv.parent / f"{venv.name}.lock"):
        if _stamp_matches(venv, engine.stamp, key):  # built by another process while we waited
            return env_python(venv)
        return _build(engine, venv, key, base, requirements, log, say)


def _progress(name: str) -> Callable[[str], None]:
    def say(message: str) -> None:
        print(f"{name}-env: {message}", file=sys.stderr, flush=True)

    return say


def _stamp_matches(venv: Path, stamp_name: str, key: dict[str, str | int]) -> bool:
    try:
        stamp = json.loads((venv / stamp_name).read_text())
    except (OSError, ValueError):
        return False
    return all(stamp.get(k) == v for k, v in key.items()) and env_python(venv).exists()


def _build(
    engine: EngineEnv,
    venv: Path,
    key: dict[str, str | int],
    base: str,
    requirements: Path,
    log: Path,
    say: Callable[[str], None],
) -> Path:
    started = time.monotonic()
    log.write_text(f"# {engine.name}-env build {time.strftime('%Y-%m-%d %H:%M:%S')}, {key}\n")
    if venv.exists():
        say(f"removing stale {venv}")
        shutil.rmtree(venv)
    say(f"creating {venv} with {base}")
    _step(engine, "creating the venv", [base, "-m", "venv", str(venv)], log)
    python = str(env_python(venv))
    say(f"installing {requirements} ({engine.what})")
    pip = [python, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--no-input"]
    pip += ["--progress-bar", "off", "--retries", "2", "--timeout", "30", "-r", str(requirements)]
    _step(engine, "installing the pinned packages", pip, log)
    say(f"smoke import: {engine.smoke}")
    versions = _step(engine, f"importing {engine.name}", [python, "-c", engine.smoke], log).strip().splitlines()[-1]
    seconds = time.monotonic() - started
    stamp = {**key, "versions": versions, "build_seconds": round(seconds, 1), "built": time.strftime("%Y-%m-%d")}
    (venv / engine.stamp).write_text(json.dumps(stamp, indent=2) + "\n")
    say(f"ready in {seconds:.0f} s: {versions}")
    return Path(python)


def _step(engine: EngineEnv, name: str, command: list[str], log: Path) -> str:
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
        raise engine.unavailable(name, message + f"cannot reach the package index ({unreachable.group(0)})", log)
    raise engine.error(name, message + cause, log)


def engine_python(engine: EngineEnv, cache: Path | None = None) -> Path:
    """``$<engine.env_python>`` if set (it must exist), else the cached venv's python (built if needed)."""
    given = os.environ.get(engine.env_python)
    if given:
        if not Path(given).exists():
            raise engine.error(
                f"finding the {engine.name} python", f"{engine.env_python}={given} does not exist", Path(given)
            )
        return Path(given)
    return ensure_env(engine, cache)


def venv_size_bytes(venv: Path) -> int:
    return sum(p.stat().st_size for p in venv.rglob("*") if p.is_file() and not p.is_symlink())


def cli(engine: EngineEnv, argv: list[str] | None = None) -> int:
    """``<engine>-env.sh``: build (once) the venv, print its python on stdout; exit 1 on failure, 2 when the
    package index is unreachable, with the one-line message on stderr."""
    parser = argparse.ArgumentParser(description=f"Build (once) the pinned {engine.name} venv; print its python.")
    parser.add_argument("--cache", type=Path, default=None, help="cache root (default: $WEIGHTSYNC_CACHE)")
    parser.add_argument("--python", default=None, help="interpreter to make the venv with (default: $PYTHON)")
    parser.add_argument("--requirements", type=Path, default=engine.requirements)
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)
    try:
        python = ensure_env(engine, args.cache, python=args.python, requirements=args.requirements, quiet=args.quiet)
    except EngineEnvUnavailable as error:
        print(error, file=sys.stderr)
        return 2
    except EngineEnvError as error:
        print(error, file=sys.stderr)
        return 1
    print(python)
    return 0
