#!/usr/bin/env bash
# The Debian packages weightsync needs, checked (and, as root, installed) before hack/setup.sh builds .venv:
#   python3, python3-venv   the interpreter and `python -m venv` (checked by running $PYTHON, default python3)
#   libibverbs1, libnuma1, libcurl4   shared libraries the Mooncake Transfer Engine wheel loads (the data plane)
#   gcc, pkg-config, libseccomp-dev   the real node's runc (cgo, with seccomp; build-node-binaries.sh), iproute2
#                                     (`ip`: its bridge), iptables and ipset (kube-router, which enforces
#                                     NetworkPolicies there when a test asks): as root (the node runs only as root)
#                                     or with WEIGHTSYNC_REAL_NODE=1; never with WEIGHTSYNC_E2E=0 or
#                                     WEIGHTSYNC_REAL_NODE=0
# Installed packages are checked with dpkg-query (a t64-renamed library such as libcurl4t64 counts too).
# As root, the missing ones are installed with apt-get; otherwise one line names them and the command to run,
# and the exit status is 1.
#
# Environment:
#   WEIGHTSYNC_SKIP_SYSTEM_PACKAGES=1   skip this check (other distributions: install the equivalents yourself)
#   WEIGHTSYNC_SYSTEM_PACKAGES="a b"    check these packages instead of the list below (the tests use it)
#   WEIGHTSYNC_SETUP_LOG=FILE           append apt-get's output here (default: a new file in $TMPDIR)
#   PYTHON                              the interpreter .venv will be made with (default python3)
#
# Self-contained (sources nothing, never uses its own path), so it can also run as `bash -s < system-packages.sh`.
set -euo pipefail

PACKAGES=(python3 python3-venv libibverbs1 libnuma1 libcurl4)
if [[ ${WEIGHTSYNC_E2E:-1} != 0 && ${WEIGHTSYNC_REAL_NODE:-} != 0 ]] &&
  [[ $(id -u) == 0 || ${WEIGHTSYNC_REAL_NODE:-} == 1 ]]; then
  PACKAGES+=(gcc pkg-config libseccomp-dev iproute2 iptables ipset)
fi

[[ ${WEIGHTSYNC_SKIP_SYSTEM_PACKAGES:-} == 1 ]] && exit 0
if [[ -n ${WEIGHTSYNC_SYSTEM_PACKAGES:-} ]]; then
  read -r -a PACKAGES <<<"$WEIGHTSYNC_SYSTEM_PACKAGES"
fi
PYTHON=${PYTHON:-python3}

installed() { [[ $(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null) == installed ]]; }

present() {
  case $1 in
    python3) command -v "$PYTHON" >/dev/null 2>&1 ;;
    python3-venv) "$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1 ;;
    gcc | pkg-config) command -v "$1" >/dev/null 2>&1 ;;
    iproute2) command -v ip >/dev/null 2>&1 || [[ -x /usr/sbin/ip || -x /sbin/ip ]] ;;
    *) installed "$1" || installed "$1t64" ;;
  esac
}

# The name apt knows: Debian 13 and Ubuntu 24.04 renamed some libraries (libcurl4 -> libcurl4t64).
apt_name() {
  if [[ $1 == lib* ]] && ! apt-cache show "$1" >/dev/null 2>&1 && apt-cache show "$1t64" >/dev/null 2>&1; then
    echo "$1t64"
  else
    echo "$1"
  fi
}

missing_packages() {
  local pkg
  for pkg in "${PACKAGES[@]}"; do
    present "$pkg" || echo "$pkg"
  done
}

fail() {
  echo "setup: $1 failed: $2${3:+ (full log: $3)}" >&2
  exit 1
}

if ! command -v dpkg-query >/dev/null 2>&1; then
  fail "system packages" "no dpkg-query, so not Debian: install the equivalents of ${PACKAGES[*]} yourself, then rerun with WEIGHTSYNC_SKIP_SYSTEM_PACKAGES=1"
fi
mapfile -t missing < <(missing_packages)
((${#missing[@]})) || exit 0
mapfile -t names < <(for pkg in "${missing[@]}"; do apt_name "$pkg"; done)

if [[ $(id -u) != 0 ]]; then
  echo "setup: missing Debian packages: ${names[*]}; install them with: sudo apt-get install -y ${names[*]}" \
    "(or run ./hack/setup.sh as root; WEIGHTSYNC_SKIP_SYSTEM_PACKAGES=1 skips this check)" >&2
  exit 1
fi

log=${WEIGHTSYNC_SETUP_LOG:-$(mktemp "${TMPDIR:-/tmp}/weightsync-setup-XXXXXX.log")}
echo "setup: installing Debian packages: ${names[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
for command in "apt-get update -qq" "apt-get install -y -qq ${names[*]}"; do
  echo "== $command" >>"$log"
  start=$(wc -l <"$log")
  $command >>"$log" 2>&1 && continue
  rc=$?
  output=$(tail -n +"$((start + 1))" "$log")
  cause=$(grep -m1 -E '^(E|Err):|[Ee]rror' <<<"$output" || tail -n1 <<<"$output")
  fail "installing system packages" "${command%% -*} exited $rc: ${cause:-no output}" "$log"
done
mapfile -t still < <(missing_packages)
if ((${#still[@]})); then
  hint=
  [[ " ${still[*]}" == *" python3"* ]] && hint=" with PYTHON=$PYTHON"
  fail "installing system packages" "apt-get installed ${names[*]} but ${still[*]} still not found$hint" "$log"
fi
[[ -n ${WEIGHTSYNC_SETUP_LOG:-} ]] || rm -f "$log"
