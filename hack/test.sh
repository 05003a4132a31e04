#!/usr/bin/env bash
# The test command (README, CI): set up, lint, type-check, run every test, three worker processes side by side
# (pytest-xdist; tests/conftest.py keeps what shares a cluster or an engine server in one process; docs/testing.md).
# WEIGHTSYNC_TEST_WORKERS=N changes the number of workers (1: no parallel workers). Arguments go to pytest.
# Before pytest it builds (once; cached, ~2 min and ~6 GB the first time) the pinned venv of the stock SGLang
# server (hack/engines/sglang-env.sh) and exports its python as WEIGHTSYNC_SGLANG_PYTHON for tests/engines/sglang.
# If the package index is unreachable that tier skips, unless WEIGHTSYNC_REQUIRE_SGLANG=1 (CI), which fails here.
# Likewise the stock vLLM (CPU build) server's venv (hack/engines/vllm-env.sh, ~4 min and ~6 GB the first time):
# WEIGHTSYNC_VLLM_PYTHON for tests/engines/vllm, WEIGHTSYNC_REQUIRE_VLLM=1 (CI) to fail instead of skipping.
# The real-node tier (tests/e2e/test_real_node.py) runs as root with the node binaries setup builds; elsewhere it
# skips, unless WEIGHTSYNC_REQUIRE_REAL_NODE=1 (CI), which fails instead.
set -euo pipefail
cd "$(dirname "$0")/.."
./hack/setup.sh --engines
. .venv/bin/activate
echo "== ruff"; ruff check .
echo "== mypy"; mypy
# engine_venv KIND TIER PYTHON_VAR REQUIRE_VAR: export the engine venv's python (built by setup: instant here) as
# PYTHON_VAR; an unreachable package index (exit 2) skips the tier unless REQUIRE_VAR=1.
engine_venv() {
  local kind=$1 tier=$2 var=$3 require=$4 python rc=0
  echo "== $kind engine venv"
  python=$(./hack/engines/"$kind"-env.sh) || rc=$?
  if ((rc == 0)); then
    export "$var=$python"
  elif [[ $rc == 2 && ${!require:-} != 1 ]]; then
    echo "   (package index unreachable: $tier will skip; $require=1 fails instead)"
  else
    exit "$rc"
  fi
}
engine_venv sglang tests/engines/sglang WEIGHTSYNC_SGLANG_PYTHON WEIGHTSYNC_REQUIRE_SGLANG
engine_venv vllm tests/engines/vllm WEIGHTSYNC_VLLM_PYTHON WEIGHTSYNC_REQUIRE_VLLM
# Three workers on two cores: the engine tests mostly wait (servers starting, rounds, HF references), so two
# workers left 43 % of the CPU idle; three took the warm run from 33 min 37 s to 24 min 44 s (docs/testing.md).
workers=${WEIGHTSYNC_TEST_WORKERS:-3}
parallel=()
if ((workers > 1)); then
  parallel=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
  # Workers' engines, traces and torch references share two cores: OpenMP threads that spin while they wait
  # (libgomp's default) burn the other workers' CPU. Two 2-thread torch processes side by side took 12.0 s
  # spinning and 5.8 s passive (one alone: 2.8 s); docs/testing.md.
  export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
fi
echo "== pytest"; python -m pytest "${parallel[@]}" --durations=25 "$@"
