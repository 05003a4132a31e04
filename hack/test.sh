#!/usr/bin/env bash
# The test command (README, CI): set up, lint, type-check, run every test.
# Before pytest it builds (once; cached, ~2 min and ~6 GB the first time) the pinned venv of the stock SGLang
# server (hack/engines/sglang-env.sh) and exports its python as WEIGHTSYNC_SGLANG_PYTHON for tests/engines/sglang.
# If the package index is unreachable that tier skips, unless WEIGHTSYNC_REQUIRE_SGLANG=1 (CI), which fails here.
# Likewise the stock vLLM (CPU build) server's venv (hack/engines/vllm-env.sh, ~4 min and ~6 GB the first time):
# WEIGHTSYNC_VLLM_PYTHON for tests/engines/vllm, WEIGHTSYNC_REQUIRE_VLLM=1 (CI) to fail instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."
./hack/setup.sh
. .venv/bin/activate
echo "== ruff"; ruff check .
echo "== mypy"; mypy
echo "== sglang engine venv"
if sglang_python=$(./hack/engines/sglang-env.sh); then
  export WEIGHTSYNC_SGLANG_PYTHON=$sglang_python
else
  rc=$?
  if [[ $rc != 2 || ${WEIGHTSYNC_REQUIRE_SGLANG:-} == 1 ]]; then exit "$rc"; fi
  echo "   (package index unreachable: tests/engines/sglang will skip; WEIGHTSYNC_REQUIRE_SGLANG=1 fails instead)"
fi
echo "== vllm engine venv"
if vllm_python=$(./hack/engines/vllm-env.sh); then
  export WEIGHTSYNC_VLLM_PYTHON=$vllm_python
else
  rc=$?
  if [[ $rc != 2 || ${WEIGHTSYNC_REQUIRE_VLLM:-} == 1 ]]; then exit "$rc"; fi
  echo "   (package index unreachable: tests/engines/vllm will skip; WEIGHTSYNC_REQUIRE_VLLM=1 fails instead)"
fi
echo "== pytest"; python -m pytest "$@"
