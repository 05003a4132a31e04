#!/usr/bin/env bash
# Set up and run the demo: validate the example group, compute its transfer plan, and show every object
# the operator creates for it. No cluster needed.
set -euo pipefail
cd "$(dirname "$0")/.."
./hack/setup.sh
. .venv/bin/activate
EXAMPLE=${1:-examples/tcp-group.yaml}
echo "== weightsync validate -f $EXAMPLE"
weightsync validate -f "$EXAMPLE"
echo
echo "== weightsync plan -f $EXAMPLE"
COLUMNS=${COLUMNS:-120} weightsync plan -f "$EXAMPLE"
echo
echo "== weightsync render -f $EXAMPLE   (what the operator creates)"
weightsync render -f "$EXAMPLE" -o name
echo
echo "== a bad spec is refused with a reason"
weightsync validate -f tests/fixtures/invalid/rdma-without-resource.yaml || true
