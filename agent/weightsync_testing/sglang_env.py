"""The pinned, cached virtualenv that runs the stock SGLang server (separate from the project's .venv).

``${WEIGHTSYNC_CACHE:-~/.cache/weightsync}/engines/sglang-0.5.23/`` gets ``pip install --no-deps -r
hack/engines/sglang-requirements.txt`` (``sglang==0.5.23`` plus its exact, pinned CPU-side dependency set),
then a smoke import, then a stamp; the build, stamp and lock are :mod:`weightsync_testing.engine_env`'s.

CLI (``hack/engines/sglang-env.sh``, or ``python sglang_env.py``; stdlib only, so any Python >= 3.11 runs it):
prints the venv's python on stdout, progress on stderr, and on failure one line
``sglang-env: <step> failed: <cause> (full log: <file>)`` with exit status 1 (2: PyPI unreachable).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script (hack/engines/sglang-env.sh): make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from weightsync_testing import engine_env
from weightsync_testing.engine_env import cache_root, env_python, venv_size_bytes

SGLANG_VERSION = "0.5.23"
BUILDER_VERSION = 1
STAMP = ".weightsync-sglang-env.json"
ENV_PYTHON = "WEIGHTSYNC_SGLANG_PYTHON"
REPO = engine_env.REPO
REQUIREMENTS = REPO / "hack" / "engines" / "sglang-requirements.txt"
SMOKE = (
    "import importlib.metadata as m, mooncake.engine, sglang, torch, transformers; "
    "print(m.version('sglang'), torch.__version__, transformers.__version__)"
)
__all__ = [  # the names tests and tools use; the shared ones come from engine_env
    "BUILDER_VERSION",
    "ENV_PYTHON",
    "REQUIREMENTS",
    "SGLANG",
    "SGLANG_VERSION",
    "SMOKE",
    "STAMP",
    "SglangEnvError",
    "SglangEnvUnavailable",
    "cache_root",
    "ensure_sglang_env",
    "env_dir",
    "env_python",
    "main",
    "sglang_python",
    "stamp_key",
    "venv_size_bytes",
]


class SglangEnvError(engine_env.EngineEnvError):
    """Building the SGLang venv failed; ``str()`` is the one-line message, ``log`` the full log."""

    prefix = "sglang-env"


class SglangEnvUnavailable(SglangEnvError, engine_env.EngineEnvUnavailable):  # noqa: N818 (a kind of error)
    """The package index cannot be reached, so the venv cannot be built on this machine."""


SGLANG = engine_env.EngineEnv(
    name="sglang",
    dir_name=f"sglang-{SGLANG_VERSION}",
    requirements=REQUIREMENTS,
    stamp=STAMP,
    smoke=SMOKE,
    env_python=ENV_PYTHON,
    what=f"sglang=={SGLANG_VERSION}, torch, ...: ~2 min and ~6 GB on a clean machine",
    error=SglangEnvError,
    unavailable=SglangEnvUnavailable,
    builder_version=BUILDER_VERSION,
)


def env_dir(cache: Path | None = None) -> Path:
    return engine_env.env_dir(SGLANG, cache)


def stamp_key(requirements: Path, python: str) -> dict[str, str | int]:
    return engine_env.stamp_key(requirements, python, BUILDER_VERSION)


def ensure_sglang_env(
    cache: Path | None = None,
    *,
    python: str | None = None,
    requirements: Path = REQUIREMENTS,
    quiet: bool = False,
) -> Path:
    """The SGLang venv's python, building the venv first unless its stamp matches ``requirements``.

    Raises :class:`SglangEnvUnavailable` when pip cannot reach the package index and
    :class:`SglangEnvError` on any other failure."""
    return engine_env.ensure_env(SGLANG, cache, python=python, requirements=requirements, quiet=quiet)


def sglang_python(cache: Path | None = None) -> Path:
    """``$WEIGHTSYNC_SGLANG_PYTHON`` if set (it must exist), else the cached venv's python (built if needed)."""
    return engine_env.engine_python(SGLANG, cache)


def main(argv: list[str] | None = None) -> int:
    return engine_env.cli(SGLANG, argv)


if __name__ == "__main__":
    sys.exit(main())
