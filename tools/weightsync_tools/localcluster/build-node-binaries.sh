#!/usr/bin/env bash
# Build what a real Kubernetes node needs, from the Go module proxy, into a cache keyed by versions:
#   kubelet                  k8s.io/kubernetes/cmd/kubelet, the same version and module setup as the control plane
#                            in build-binaries.sh (staging replaces generated from its own go.mod, version ldflags)
#   containerd, containerd-shim-runc-v2, ctr   github.com/containerd/containerd/v2 (static, CGO off: no btrfs)
#   runc                     github.com/opencontainers/runc (cgo; with seccomp when libseccomp-dev is installed: as
#                            root, hack/system-packages.sh installs it with gcc and pkg-config; else runc is built
#                            without seccomp, and the script says so)
#   bridge, host-local, loopback   github.com/containernetworking/plugins, into cni/
#   kube-router-VERSION/kube-router   github.com/cloudnativelabs/kube-router/v2 (static, CGO off): the NetworkPolicy
#                            engine a test starts beside the real node (network_policies.py; iptables + ipset, which
#                            this script installs as root: Debian packages iptables, ipset)
#   coredns-VERSION/coredns  CoreDNS (github.com/coredns/coredns) with the plugins the node's cluster DNS uses (bind,
#                            errors, log, kubernetes), as CoreDNS documents building it with a chosen plugin list:
#                            a main package of a few lines (below) importing coremain and those plugins
#   image/weightsync-pause   a static Go program of a few lines (below), the only file of the two images the
#                            real node runs (no registry is reachable): the pod sandbox ("pause", it waits for
#                            SIGTERM) and the test pod's container ("serve PORT": also answers HTTP 200)
# Reuses the cache when every binary is already there. Prints the cache directory on stdout. Each build's wall time
# is appended to build-times.txt in the cache. hack/setup.sh runs it after build-binaries.sh (the kubelet then
# finds most of its packages in the Go build cache).
#
# --check: build nothing; print the cache directory and exit 0 when every binary is there, else name the missing
# ones on stderr and exit 3 (tests/e2e/test_real_node.py asks this way).
#
# Environment: K8S_VERSION, CONTAINERD_VERSION, RUNC_VERSION, CNI_PLUGINS_VERSION, KUBE_ROUTER_VERSION,
# COREDNS_VERSION, WEIGHTSYNC_CACHE, OUT;
# GOFLAGS is passed on (e.g. GOFLAGS=-p=1 on a shared machine); WEIGHTSYNC_SKIP_SYSTEM_PACKAGES=1 installs nothing.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)

K8S_VERSION=${K8S_VERSION:-v1.37.2}
CONTAINERD_VERSION=${CONTAINERD_VERSION:-v2.4.2}
RUNC_VERSION=${RUNC_VERSION:-v1.5.3}
CNI_PLUGINS_VERSION=${CNI_PLUGINS_VERSION:-v1.10.0}
KUBE_ROUTER_VERSION=${KUBE_ROUTER_VERSION:-v2.1.0}
COREDNS_VERSION=${COREDNS_VERSION:-v1.15.0}
CACHE_ROOT=${WEIGHTSYNC_CACHE:-$HOME/.cache/weightsync}
OUT=${OUT:-$CACHE_ROOT/node/kubelet$K8S_VERSION-containerd$CONTAINERD_VERSION-runc$RUNC_VERSION-cni$CNI_PLUGINS_VERSION}
BINARIES=(kubelet containerd containerd-shim-runc-v2 ctr runc cni/bridge cni/host-local cni/loopback image/weightsync-pause
  "kube-router-$KUBE_ROUTER_VERSION/kube-router" "coredns-$COREDNS_VERSION/coredns")

complete() {
  for b in "${BINARIES[@]}"; do [[ -x "$OUT/$b" ]] || return 1; done
}
if complete; then echo "$OUT"; exit 0; fi
if [[ ${1:-} == --check ]]; then
  missing=()
  for b in "${BINARIES[@]}"; do [[ -x "$OUT/$b" ]] || missing+=("$b"); done
  echo "build-node-binaries: not built in $OUT: ${missing[*]}" >&2
  exit 3
fi

log() { echo "[build-node-binaries $(date -u +%H:%M:%S)] $*" >&2; }
if ! command -v go >/dev/null; then
  echo "build-node-binaries: Go is needed (>= 1.26; GOTOOLCHAIN=auto fetches a newer one through the module proxy if required)" >&2
  exit 1
fi
mkdir -p "$OUT/cni"
exec 9>"$OUT.lock"
flock 9
if complete; then echo "$OUT"; exit 0; fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export GOFLAGS="-mod=mod ${GOFLAGS:-}" CGO_ENABLED=0 GOTOOLCHAIN=${GOTOOLCHAIN:-auto}
start=$(date +%s)
timed() {  # timed NAME COMMAND...: run it, append its wall time to build-times.txt
  local name=$1 t0
  shift
  t0=$(date +%s)
  "$@"
  echo "$name $(( $(date +%s) - t0 )) s ($(date -u +%Y-%m-%dT%H:%M:%SZ))" >> "$OUT/build-times.txt"
  log "$name built in $(( $(date +%s) - t0 )) s"
}

# --- kubelet: the module setup of build-binaries.sh -------------------------------------------------
build_kubelet() {
  log "k8s.io/kubernetes $K8S_VERSION: resolving modules"
  mkdir "$WORK/k8s" && cd "$WORK/k8s"
  go mod init local/k8snode >/dev/null 2>&1
  local gomod staging minor ver m
  gomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  staging="v0.${K8S_VERSION#v1.}"
  for m in $(awk '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print $1}' "$gomod" | sort -u); do
    go mod edit -replace="$m=$m@$staging"
  done
  go mod edit -require="k8s.io/kubernetes@$K8S_VERSION"
  cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kubelet"
)
GO
  minor=$(echo "$K8S_VERSION" | cut -d. -f2)
  ver="-X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1"
  ver+=" -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
  ver+=" -X k8s.io/component-base/version.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  ver+=" -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION -X k8s.io/client-go/pkg/version.gitMajor=1"
  ver+=" -X k8s.io/client-go/pkg/version.gitMinor=$minor"
  log "building kubelet"
  # The control plane's tags, so the Go build cache of build-binaries.sh serves the packages they share.
  go build -trimpath -tags=selinux,notest,grpcnotrace -ldflags "-s -w $ver" -o "$OUT/kubelet" k8s.io/kubernetes/cmd/kubelet
}

# --- containerd 2.x, its runc shim and ctr (no replace directives in its go.mod: go install works) ------------
build_containerd() {
  log "containerd $CONTAINERD_VERSION"
  local ld="-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION"
  ld+=" -X github.com/containerd/containerd/v2/version.Package=github.com/containerd/containerd/v2"
  # CGO off: the btrfs snapshotter (cgo only) is left out, as in upstream's static builds.
  GOBIN="$OUT" go install -trimpath -ldflags "$ld" \
    "github.com/containerd/containerd/v2/cmd/containerd@$CONTAINERD_VERSION" \
    "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION" \
    "github.com/containerd/containerd/v2/cmd/ctr@$CONTAINERD_VERSION"
}
if ! [[ -x "$OUT/containerd" && -x "$OUT/containerd-shim-runc-v2" && -x "$OUT/ctr" ]]; then timed containerd build_containerd; fi

# --- runc (cgo: its nsenter is C) ------------------------------------------------------------------------
build_runc() {
  local tags=""
  # cgo needs gcc; seccomp needs libseccomp-dev (found with pkg-config). Root installs them; others get a hint.
  if ! pkg-config --exists libseccomp 2>/dev/null || ! command -v gcc >/dev/null; then
    WEIGHTSYNC_SYSTEM_PACKAGES="gcc pkg-config libseccomp-dev" bash "$REPO/hack/system-packages.sh" ||
      log "gcc, pkg-config or libseccomp-dev missing (see above)"
  fi
  if pkg-config --exists libseccomp 2>/dev/null; then
    tags="seccomp"
    log "runc $RUNC_VERSION (seccomp, libseccomp $(pkg-config --modversion libseccomp))"
  else
    log "runc $RUNC_VERSION WITHOUT seccomp (no libseccomp-dev: apt-get install libseccomp-dev for it)"
  fi
  CGO_ENABLED=1 GOBIN="$OUT" go install -trimpath -tags="$tags" \
    -ldflags "-s -w -X main.version=${RUNC_VERSION#v}" "github.com/opencontainers/runc@$RUNC_VERSION"
}
if ! [[ -x "$OUT/runc" ]]; then timed runc build_runc; fi

# --- CNI plugins: bridge, host-local, loopback ------------------------------------------------------------
build_cni() {
  log "CNI plugins $CNI_PLUGINS_VERSION"
  local p=github.com/containernetworking/plugins
  GOBIN="$OUT/cni" go install -trimpath \
    -ldflags "-s -w -X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion=$CNI_PLUGINS_VERSION" \
    "$p/plugins/main/bridge@$CNI_PLUGINS_VERSION" "$p/plugins/ipam/host-local@$CNI_PLUGINS_VERSION" \
    "$p/plugins/main/loopback@$CNI_PLUGINS_VERSION"
}
if ! [[ -x "$OUT/cni/bridge" && -x "$OUT/cni/host-local" && -x "$OUT/cni/loopback" ]]; then timed cni-plugins build_cni; fi

# --- the images' one binary (realnode.py packs it into OCI tarballs for `ctr images import`) ---------------
build_image_binary() {
  mkdir -p "$WORK/pause" "$OUT/image" && cd "$WORK/pause"
  go mod init local/weightsyncpause >/dev/null 2>&1
  cat > main.go <<'GO'
// weightsync-pause: wait for SIGTERM or SIGINT and exit 0 (a pod sandbox's pause process); with
// "serve PORT" also answer every HTTP request with 200 "ok" on that port (a pod with a readiness probe).
package main

import (
	"net/http"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if len(os.Args) == 3 && os.Args[1] == "serve" {
		go func() {
			err := http.ListenAndServe(":"+os.Args[2], http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				_, _ = w.Write([]byte("ok\n"))
			}))
			os.Stderr.WriteString(err.Error() + "\n")
			os.Exit(1)
		}()
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
}
GO
  go build -trimpath -ldflags "-s -w" -o "$OUT/image/weightsync-pause" .
}
if ! [[ -x "$OUT/image/weightsync-pause" ]]; then timed image-binary build_image_binary; fi

# --- kube-router (its go.mod has no replace directives: go install works) ------------------------------------
build_kube_router() {
  log "kube-router $KUBE_ROUTER_VERSION"
  # It runs iptables-save/-restore and ipset; the real node needs them only when a test enforces policies.
  if ! command -v ipset >/dev/null || ! command -v iptables-restore >/dev/null; then
    WEIGHTSYNC_SYSTEM_PACKAGES="iptables ipset" bash "$REPO/hack/system-packages.sh" ||
      log "iptables or ipset missing (see above): NetworkPolicies will not be enforced on the real node"
  fi
  local ld="-s -w -X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version=$KUBE_ROUTER_VERSION"
  GOBIN="$OUT/kube-router-$KUBE_ROUTER_VERSION" go install -trimpath -ldflags "$ld" \
    "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router@$KUBE_ROUTER_VERSION"
}
if ! [[ -x "$OUT/kube-router-$KUBE_ROUTER_VERSION/kube-router" ]]; then timed kube-router build_kube_router; fi

# --- CoreDNS with four plugins (its full build links every cloud provider's SDK) ----------------------------
build_coredns() {
  log "CoreDNS $COREDNS_VERSION"
  mkdir -p "$WORK/coredns" && cd "$WORK/coredns"
  go mod init local/weightsynccoredns >/dev/null 2>&1
  cat > main.go <<'GO'
// The real node's cluster DNS: CoreDNS with the plugins it uses (no upstream is reachable, so no forward).
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
)

func init() {
	dnsserver.Directives = []string{"bind", "errors", "log", "kubernetes"}
}

func main() { coremain.Run() }
GO
  go get "github.com/coredns/coredns@$COREDNS_VERSION" >/dev/null
  go mod tidy >/dev/null
  go build -trimpath -ldflags "-s -w" -o "$OUT/coredns-$COREDNS_VERSION/coredns" .
}
if ! [[ -x "$OUT/coredns-$COREDNS_VERSION/coredns" ]]; then timed coredns build_coredns; fi

# The kubelet last: the longest build (the others are usable while it runs).
if ! [[ -x "$OUT/kubelet" ]]; then timed kubelet build_kubelet; fi

"$OUT/kubelet" --version >&2
log "done in $(( $(date +%s) - start )) s -> $OUT"
echo "$OUT"
