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


SGLANG = engine_env.EngineEnv(
    name="sglang",
    dir_name=f"sglang-{SGLANG_VERSION}",
    smoke=SMOKE,
    what=f"sglang=={SGLANG_VERSION}, torch, ...: ~2 min and ~6 GB on a clean machine",
    builder_version=BUILDER_VERSION,
)
SglangEnvError, SglangEnvUnavailable = SGLANG.error, SGLANG.unavailable
REQUIREMENTS, STAMP, ENV_PYTHON = SGLANG.requirements, SGLANG.stamp, SGLANG.env_python
env_dir, ensure_sglang_env, sglang_python, main = SGLANG.env_dir, SGLANG.ensure, SGLANG.python, SGLANG.main


def stamp_key(requirements: Path, python: str) -> dict[str, str | int]:
    return engine_env.stamp_key(requirements, python, BUILDER_VERSION)


if __name__ == "__main__":
    sys.exit(main())
