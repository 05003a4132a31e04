#!/usr/bin/env bash
# The test command (README, CI): set up, lint, type-check, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
./hack/setup.sh
. .venv/bin/activate
echo "== ruff"; ruff check .
echo "== mypy"; mypy
echo "== pytest"; python -m pytest "$@"
