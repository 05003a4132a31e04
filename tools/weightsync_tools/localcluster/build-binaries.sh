#!/usr/bin/env bash
# Build a real Kubernetes control plane from the Go module proxy, into a cache keyed by versions:
#   kube-apiserver, kube-controller-manager, kube-scheduler  (k8s.io/kubernetes, staging replaces
#   generated from its own go.mod, version ldflags set), etcd (a wrapper module around
#   go.etcd.io/etcd/server/v3), kwok (sigs.k8s.io/kwok) and kwok's stage definitions.
# Reuses the cache when every binary is already there. Prints the cache directory on stdout.
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-v1.37.2}
ETCD_VERSION=${ETCD_VERSION:-v3.6.16}
KWOK_VERSION=${KWOK_VERSION:-v0.8.0}
CACHE_ROOT=${WEIGHTSYNC_CACHE:-$HOME/.cache/weightsync}
OUT=${OUT:-$CACHE_ROOT/k8s/$K8S_VERSION-etcd$ETCD_VERSION-kwok$KWOK_VERSION}
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler etcd kwok)

complete() {
  for b in "${BINARIES[@]}"; do [[ -x "$OUT/$b" ]] || return 1; done
  [[ -s "$OUT/kwok-stages.yaml" ]]
}
if complete; then echo "$OUT"; exit 0; fi

log() { echo "[build-binaries $(date -u +%H:%M:%S)] $*" >&2; }
if ! command -v go >/dev/null; then
  echo "build-binaries: Go is needed (>= 1.26; GOTOOLCHAIN=auto fetches a newer one through the module proxy if required)" >&2
  exit 1
fi
mkdir -p "$OUT"
# One build at a time per cache (setup builds in the background while a test or the demo may ask too): a second
# caller waits for the first and then finds the cache complete.
exec 9>"$OUT.lock"
flock 9
if complete; then echo "$OUT"; exit 0; fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export GOFLAGS=-mod=mod CGO_ENABLED=0 GOTOOLCHAIN=${GOTOOLCHAIN:-auto}
start=$(date +%s)

# --- kube-apiserver, kube-controller-manager, kube-scheduler ------------------------------------
if [[ ! -x "$OUT/kube-apiserver" || ! -x "$OUT/kube-controller-manager" || ! -x "$OUT/kube-scheduler" ]]; then
  log "k8s.io/kubernetes $K8S_VERSION: resolving modules"
  mkdir "$WORK/k8s" && cd "$WORK/k8s"
  go mod init local/k8sbins >/dev/null 2>&1
  gomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  staging="v0.${K8S_VERSION#v1.}"
  # k/k requires its staging modules as v0.0.0 with replace => ./staging/...; point them at the
  # published versions instead (the list differs between releases, so read it from go.mod).
  for m in $(awk '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print $1}' "$gomod" | sort -u); do
    go mod edit -replace="$m=$m@$staging"
  done
  go mod edit -require="k8s.io/kubernetes@$K8S_VERSION"
  cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
GO
  minor=$(echo "$K8S_VERSION" | cut -d. -f2)
  ver="-X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1"
  ver+=" -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
  ver+=" -X k8s.io/component-base/version.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  ver+=" -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION -X k8s.io/client-go/pkg/version.gitMajor=1"
  ver+=" -X k8s.io/client-go/pkg/version.gitMinor=$minor"
  log "building kube-apiserver, kube-controller-manager, kube-scheduler"
  go build -trimpath -tags=selinux,notest,grpcnotrace -ldflags "-s -w $ver" -o "$OUT/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler
fi

# --- etcd, in its own module so its dependency versions don't move the apiserver's --------------
if [[ ! -x "$OUT/etcd" ]]; then
  log "etcd $ETCD_VERSION"
  mkdir "$WORK/etcd" && cd "$WORK/etcd"
  go mod init local/etcd >/dev/null 2>&1
  go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >/dev/null 2>&1
  go build -trimpath -ldflags "-s -w" -o "$OUT/etcd" go.etcd.io/etcd/server/v3
fi

# --- kwok, and the stages it needs (standalone kwok has no defaults) -----------------------------
if [[ ! -x "$OUT/kwok" || ! -s "$OUT/kwok-stages.yaml" ]]; then
  log "kwok $KWOK_VERSION"
  GOBIN="$OUT" go install "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  stages="$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage"
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    echo '---'; cat "$stages/$f"
  done > "$OUT/kwok-stages.yaml"
fi

"$OUT/kube-apiserver" --version >&2
log "done in $(( $(date +%s) - start )) s -> $OUT"
echo "$OUT"
