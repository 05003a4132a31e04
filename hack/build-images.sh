#!/usr/bin/env bash
# Build the project's images on a machine that reaches no container registry (docs/local-cluster.md, "Images"):
#   base       Debian (the host's release) made with debootstrap from Debian packages only: python3, python3-venv,
#              passwd (the Dockerfiles' useradd), ca-certificates and the shared libraries agent/Dockerfile
#              apt-installs (libibverbs1, ibverbs-providers, libnuma1, libcurl4). It stands in for python:3.11-slim.
#   operator   operator/Dockerfile built FROM that base (--build-arg BASE_IMAGE), named and tagged as the chart's
#              defaults name it (values.yaml's image.repository, Chart.yaml's appVersion).
#   agent      agent/Dockerfile FROM that base with --build-arg TORCH=node: everything but torch, which the node
#              mounts from its own cache (4.2 GB of PyPI's CUDA build in a layer would cost CI minutes on every run);
#              named as the chart's agentImage default. For a registry, build it with TORCH=pypi (the Dockerfile).
# Each image is written as an OCI archive under ${WEIGHTSYNC_CACHE:-~/.cache/weightsync}/images/ and reused while its
# inputs are unchanged (base: the release, mirror, package list and this script's recipe; an image: its Dockerfile,
# its ignore file, every file its COPY lines take, its build arguments, the base). The archives import into containerd as they are
# (`ctr -n k8s.io images import FILE`: their index names the image) and push with
# `skopeo copy oci-archive:FILE docker://REGISTRY/...`. Prints the archives' paths on stdout, one per line.
#
# The builder is buildah (Debian's package): it builds Dockerfiles as root with `--isolation chroot`, so it needs no
# daemon, no container runtime of its own and no registry, and it writes OCI archives directly. BuildKit from Go
# modules would need buildkitd plus a runc worker and a build of its own, for nothing buildah lacks here.
#
# Usage: hack/build-images.sh [--check | --rebuild]
#   --check    build nothing: print the operator's and the agent's archive paths and exit 0 when both were built
#              from the current inputs, else say what is missing or stale on stderr and exit 3
#              (tests/e2e/test_images.py asks so)
#   --rebuild  ignore the cached archives
# Needs root (debootstrap, and buildah's chroot isolation); as root it apt-installs debootstrap and buildah when
# missing (WEIGHTSYNC_SKIP_SYSTEM_PACKAGES=1 installs nothing). A failing step prints one line,
# `build-images: <step> failed: <cause> (full log: <file>)`.
# Environment: WEIGHTSYNC_CACHE, DEBIAN_RELEASE (default: the host's), DEBIAN_MIRROR.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-}
case $mode in
  "" | --check | --rebuild) ;;
  *)
    echo "usage: hack/build-images.sh [--check | --rebuild]" >&2
    exit 2
    ;;
esac

CACHE=${WEIGHTSYNC_CACHE:-$HOME/.cache/weightsync}/images
# shellcheck disable=SC1091 # the host's, read at run time
RELEASE=${DEBIAN_RELEASE:-$(. /etc/os-release && echo "${VERSION_CODENAME:-}")}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE_PACKAGES=(python3 python3-venv passwd ca-certificates libibverbs1 ibverbs-providers libnuma1 libcurl4)
BASE_IMAGE=weightsync.local/debian-python:$RELEASE
# The chart's defaults are what a user's `helm install` pulls, so the build reads its name from them rather than
# keeping a second copy that could drift.
OPERATOR_REPOSITORY=$(awk '/^image:/ {f = 1} f && $1 == "repository:" {print $2; exit}' charts/weightsync/values.yaml)
APP_VERSION=$(awk '$1 == "appVersion:" {gsub(/"/, "", $2); print $2; exit}' charts/weightsync/Chart.yaml)
AGENT_REPOSITORY=$(awk '/^agentImage:/ {f = 1} f && $1 == "repository:" {print $2; exit}' charts/weightsync/values.yaml)
OPERATOR_IMAGE=$OPERATOR_REPOSITORY:$APP_VERSION
AGENT_IMAGE=$AGENT_REPOSITORY:$APP_VERSION
BASE_ARCHIVE=$CACHE/weightsync-base-$RELEASE.oci.tar
OPERATOR_ARCHIVE=$CACHE/weightsync-operator-$APP_VERSION.oci.tar
AGENT_ARCHIVE=$CACHE/weightsync-agent-$APP_VERSION.oci.tar
# NAME DOCKERFILE IMAGE ARCHIVE BUILD-ARGS (space-separated KEY=VALUE): what this script builds FROM the base.
IMAGES=(
  "operator operator/Dockerfile $OPERATOR_IMAGE $OPERATOR_ARCHIVE"
  "agent agent/Dockerfile $AGENT_IMAGE $AGENT_ARCHIVE TORCH=node"
)
# buildah's image store, kept apart from /var/lib/containers so that nothing else on the machine sees or prunes it.
BUILDAH=(buildah --root "$CACHE/storage" --runroot "$CACHE/run" --storage-driver overlay)

fail() {
  echo "build-images: $1 failed: $2${3:+ (full log: $3)}" >&2
  exit 1
}

# --- inputs and their hashes ------------------------------------------------------------------------------------

# The recipe is part of the base's key, so that editing how the base is made rebuilds it.
make_base_rootfs() {
  # `step` runs this in an && list, where set -e does not apply: each command says `|| return` itself.
  local rootfs=$1 packages
  packages=$(IFS=, && echo "${BASE_PACKAGES[*]}")
  debootstrap --variant=minbase --include="$packages" "$RELEASE" "$rootfs" "$MIRROR" || return
  # What a container never uses: the package indexes and downloaded .debs (a derived image runs apt-get update),
  # documentation other than the copyright files, device nodes (the runtime mounts /dev), the host's resolver.
  rm -rf "${rootfs:?}"/var/lib/apt/lists/* "${rootfs:?}"/var/cache/apt/*.bin "${rootfs:?}"/var/cache/apt/archives/*.deb \
    "${rootfs:?}"/usr/share/man/* "${rootfs:?}"/usr/share/info/* "${rootfs:?}"/dev/* \
    "${rootfs:?}"/etc/resolv.conf "${rootfs:?}"/etc/hostname || return
  # Logs emptied, their directories kept (apt writes into /var/log/apt without creating it).
  find "$rootfs"/var/log -type f -delete || return
  find "$rootfs"/usr/share/doc -mindepth 1 -not -name copyright -not -type d -delete
}

make_base_image() {
  local rootfs=$1 container mount
  container=$("${BUILDAH[@]}" from --quiet scratch) || return
  mount=$("${BUILDAH[@]}" mount "$container") || return
  tar -C "$rootfs" -cf - . | tar -C "$mount" -xpf - || return
  "${BUILDAH[@]}" umount "$container" >/dev/null || return
  # The environment python:3.11-slim sets that a Dockerfile may rely on; CMD as the public image's.
  "${BUILDAH[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --cmd '["python3"]' --label "org.opencontainers.image.description=Debian $RELEASE with python3, from Debian packages" \
    "$container" || return
  "${BUILDAH[@]}" commit --quiet --rm "$container" "$BASE_IMAGE"
}

base_key() {
  {
    echo "$RELEASE $MIRROR ${BASE_PACKAGES[*]} $BASE_IMAGE"
    declare -f make_base_rootfs make_base_image
  } | sha256sum | cut -c1-64
}

# The sources of a Dockerfile's COPY lines (everything but flags and the destination), one per line.
copy_sources() {
  awk 'toupper($1) == "COPY" {for (i = 2; i < NF; i++) if ($i !~ /^--/) print $i}' "$1"
}

# image_key DOCKERFILE IMAGE BUILD-ARGS...: every file the build reads (the Dockerfile, its ignore file and the files
# under its COPY sources, minus what the ignore file drops: caches and build metadata), each as "sha256  path", then
# the image's name, its build arguments and the base's key.
image_key() {
  local dockerfile=$1
  shift
  {
    mapfile -t sources < <(copy_sources "$dockerfile")
    find "$dockerfile" "$dockerfile.dockerignore" "${sources[@]}" -type f \
      -not -path '*/__pycache__/*' -not -name '*.pyc' -not -path '*.egg-info/*' -print0 |
      sort -z | xargs -0 sha256sum
    echo "base $(base_key) $*"
  } | sha256sum | cut -c1-64
}

# fresh ARCHIVE KEY: the archive exists and was built from inputs with this key.
fresh() { [[ -f $1 && -f $1.key && $(cat "$1.key") == "$2" ]]; }

if [[ -z $RELEASE ]]; then
  fail "reading the Debian release" "/etc/os-release has no VERSION_CODENAME (set DEBIAN_RELEASE=bookworm)"
fi
if [[ -z $OPERATOR_REPOSITORY || -z $AGENT_REPOSITORY || -z $APP_VERSION ]]; then
  fail "reading the chart's defaults" \
    "no image.repository or agentImage.repository in charts/weightsync/values.yaml or no appVersion in Chart.yaml"
fi
if [[ $mode == --check ]]; then
  for entry in "${IMAGES[@]}"; do
    read -r _ dockerfile image archive build_args <<<"$entry"
    # shellcheck disable=SC2086 # build_args: words by design
    if ! fresh "$archive" "$(image_key "$dockerfile" "$image" $build_args)"; then
      state="not built"
      [[ -f $archive ]] && state="stale (its inputs changed)"
      echo "build-images: $archive $state; hack/build-images.sh builds it" >&2
      exit 3
    fi
  done
  echo "$OPERATOR_ARCHIVE"
  echo "$AGENT_ARCHIVE"
  exit 0
fi

# --- steps --------------------------------------------------------------------------------------------------------

[[ $(id -u) == 0 ]] || fail "checking the user" "debootstrap and buildah's chroot isolation need root (run it as root)"
mkdir -p "$CACHE"
log=$(mktemp "${TMPDIR:-/tmp}/weightsync-build-images-XXXXXX.log")
exec 9>"$CACHE/.lock"
flock 9 # two builds at once would share buildah's store and the archives

say() { echo "[build-images $(date -u +%H:%M:%S)] $*" >&2; }

# step NAME COMMAND...: run COMMAND with its output in the log; on failure, one line with its likeliest cause.
step() {
  local name=$1 start rc output cause
  shift
  echo "== $name: $*" >>"$log"
  start=$(wc -l <"$log")
  "$@" >>"$log" 2>&1 && return 0
  rc=$?
  output=$(tail -n +"$((start + 1))" "$log")
  cause=$(grep -m1 -E '^(E|Error|error|ERROR|W: Failure)[: ]|^[a-z-]+: error|failed' <<<"$output" ||
    grep -v '^\s*$' <<<"$output" | tail -n1 || true)
  # A function of this script is named by its step; a program by its name.
  local program="${1##*/} "
  declare -F "$1" >/dev/null && program=
  fail "$name" "${program}exited $rc${cause:+: $cause}" "$log"
}

# timed NAME SECONDS-SINCE: one line on stderr and in build-times.txt.
timed() {
  local seconds=$(($(date +%s) - $2))
  echo "$1 $seconds s ($(date -u +%Y-%m-%dT%H:%M:%SZ))" >>"$CACHE/build-times.txt"
  say "$1 built in $seconds s"
}

missing=()
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v buildah >/dev/null || missing+=(buildah)
if ((${#missing[@]})); then
  [[ ${WEIGHTSYNC_SKIP_SYSTEM_PACKAGES:-} != 1 ]] ||
    fail "checking the tools" "${missing[*]} not found and WEIGHTSYNC_SKIP_SYSTEM_PACKAGES=1 (apt-get install -y ${missing[*]})"
  say "installing ${missing[*]}"
  step "apt-get update" apt-get update -qq
  step "installing ${missing[*]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Working containers that a failed run left in the store (the lock makes this run its only user).
"${BUILDAH[@]}" rm --all >/dev/null 2>&1 || true

# oci_archive IMAGE ARCHIVE KEY: write IMAGE from buildah's store as an OCI archive, atomically, with its key.
# containers/image writes only org.opencontainers.image.ref.name, which `ctr images import` drops unless it is told a
# --base-name; io.containerd.image.name (what containerd's own exports carry) makes the plain import name the image.
oci_archive() {
  local image=$1 archive=$2 key=$3
  rm -f "$archive.tmp"
  step "writing $archive" "${BUILDAH[@]}" push --quiet "$image" "oci-archive:$archive.tmp:$image"
  step "naming the image in $archive" python3 - "$archive.tmp" "$image" <<'PY'
import io, json, sys, tarfile

path, name = sys.argv[1], sys.argv[2]
with tarfile.open(path) as tar:
    members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
    for member, data in members:
        if member.name in ("index.json", "./index.json"):
            index = json.loads(data)
            for manifest in index["manifests"]:
                manifest.setdefault("annotations", {})["io.containerd.image.name"] = name
            data = json.dumps(index).encode()
            member.size = len(data)
        tar.addfile(member, io.BytesIO(data) if data is not None else None)
PY
  mv "$archive.tmp" "$archive"
  echo "$key" >"$archive.key"
}

# remove_work DIR: debootstrap mounts /proc, /sys and device nodes into its target and unmounts them when it exits,
# but not when it is killed: unmount what is left (deepest first), and never let rm cross into a mount.
remove_work() {
  local point
  while read -r point; do umount "$point" 2>/dev/null || umount -l "$point" 2>/dev/null || true; done < <(
    awk -v dir="$1/" 'index($2, dir) == 1 {print $2}' /proc/self/mounts | sort -r
  )
  rm -rf --one-file-system "$1"
}

key=$(base_key)
if [[ $mode != --rebuild ]] && fresh "$BASE_ARCHIVE" "$key"; then
  say "base image: cached ($BASE_ARCHIVE)"
  # The archive may outlive buildah's store (a removed storage directory): bring the image back from it.
  if ! "${BUILDAH[@]}" inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
    step "loading the base image from $BASE_ARCHIVE" "${BUILDAH[@]}" pull --quiet "oci-archive:$BASE_ARCHIVE"
  fi
else
  t0=$(date +%s)
  work=$(mktemp -d "$CACHE/base-XXXXXX")
  trap 'remove_work "$work"' EXIT
  say "base image: debootstrap $RELEASE from $MIRROR (${BASE_PACKAGES[*]})"
  step "debootstrap $RELEASE" make_base_rootfs "$work/rootfs"
  step "making the base image $BASE_IMAGE" make_base_image "$work/rootfs"
  oci_archive "$BASE_IMAGE" "$BASE_ARCHIVE" "$key"
  remove_work "$work"
  trap - EXIT
  timed "base" "$t0"
fi

# The host's CA bundle over the base's during RUN steps only (a bind mount: nothing of it lands in a layer): it holds
# the local CAs the host trusts and Debian's bundle lacks, such as a TLS-inspecting proxy's in front of PyPI
# (pip then failed: "CERTIFICATE_VERIFY_FAILED ... self-signed certificate in certificate chain"). Debian's pip
# reads that file rather than its own certifi bundle.
cas=()
[[ -f /etc/ssl/certs/ca-certificates.crt ]] &&
  cas=(--volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
for entry in "${IMAGES[@]}"; do
  read -r name dockerfile image archive build_args <<<"$entry"
  # shellcheck disable=SC2086 # build_args: words by design
  key=$(image_key "$dockerfile" "$image" $build_args)
  if [[ $mode != --rebuild ]] && fresh "$archive" "$key"; then
    say "$name image: cached ($archive)"
    continue
  fi
  t0=$(date +%s)
  say "$name image: $image FROM $BASE_IMAGE${build_args:+ ($build_args)}"
  args=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
  for arg in $build_args; do args+=(--build-arg "$arg"); done
  # --pull=never: the base is in buildah's store, and there is no registry to ask anyway.
  step "building $image from $dockerfile" "${BUILDAH[@]}" bud --isolation chroot --pull=never \
    --layers=false "${cas[@]}" "${args[@]}" -f "$dockerfile" --ignorefile "$dockerfile.dockerignore" -t "$image" .
  oci_archive "$image" "$archive" "$key"
  # Only the archive is kept; the store keeps the base (every build starts FROM it), not old images.
  "${BUILDAH[@]}" rmi --prune >/dev/null 2>&1 || true
  timed "$name" "$t0"
done
rm -f "$log"
echo "$BASE_ARCHIVE"
echo "$OPERATOR_ARCHIVE"
echo "$AGENT_ARCHIVE"
