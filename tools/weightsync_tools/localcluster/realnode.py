"""A real node next to the kwok nodes: containerd 2.x (runc, the CNI bridge) and a kubelet of the control plane's
version, registered to a running :class:`~weightsync_tools.localcluster.cluster.LocalCluster`.

Everything lives under ``<cluster>/realnode/`` (containerd's root and state, the kubelet's root dir, pod logs, CNI
config and IPAM data, the images' OCI tarballs). No registry is reachable, so the two images the node runs (the pod
sandbox and a test image, both the one static binary ``weightsync-pause``) are OCI tarballs made here and imported
with ``ctr images import``; pods must use ``imagePullPolicy: Never`` (or ``IfNotPresent``).

What it changes on the host beyond that directory: a bridge ``wsrn0`` with 10.89.0.1/24 (the CNI bridge plugin's
gateway) and the ``kubernetes`` Service's ClusterIP (/32, where ``weightsync_testing.tcp_forward`` relays pods'
API requests to the API server; both deleted with the bridge by :meth:`RealNode.stop`), ``net.ipv4.ip_forward=1``
(the bridge plugin sets it for a gateway), and the kubelet's cgroups (``kubepods`` in every cgroup v1 hierarchy;
removed by :meth:`RealNode.stop` when empty). No netfilter rule (unless a test enforces NetworkPolicies:
network_policies.py). Its cluster DNS (cluster_dns.py, CoreDNS) listens on the bridge's address, port 53.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from weightsync.ports import free_port
from weightsync_tools.localcluster import cluster_dns, network_policies
from weightsync_tools.localcluster import pki as pki_mod
from weightsync_tools.localcluster.cluster import (
    ClusterError,
    ClusterState,
    LocalCluster,
    _alive,
    _wait,
    terminate,
)

NODE_BUILD_SCRIPT = Path(__file__).with_name("build-node-binaries.sh")
NODE_NAME = "real-node-0"
#: The pod sandbox image (containerd's pinned ``sandbox`` image) and an image for test pods: both hold only
#: ``/weightsync-pause``; the test image runs it as ``serve 8080`` (HTTP 200 on every path).
PAUSE_IMAGE = "weightsync.local/pause:1"
SERVE_IMAGE = "weightsync.local/serve:1"
#: The same binary, an empty ``/usr`` and the merged-/usr links (``bin``, ``lib``, ``lib64``, ``sbin`` -> ``usr/...``):
#: a container that mounts the host's ``/usr`` read-only runs the host's programs (:func:`host_python_pod`).
HOST_IMAGE = "weightsync.local/host:1"
MERGED_USR_LINKS = {"bin": "usr/bin", "lib": "usr/lib", "lib64": "usr/lib64", "sbin": "usr/sbin"}
#: The checkout this module is in (tools/weightsync_tools/localcluster/realnode.py).
REPO = Path(__file__).resolve().parents[3]
SERVE_PORT = 8080
BRIDGE = "wsrn0"
POD_SUBNET = "10.89.0.0/24"
#: The bridge's address (the pods' gateway), created before the kubelet starts: the node's InternalIP and the
#: address its API (logs, exec) listens on, so nothing of it is on eth0 (the kubelet refuses a loopback node IP:
#: "nodeIP can't be loopback address").
NODE_IP = "10.89.0.1"
#: The kubelet's cgroups under the root of every cgroup v1 hierarchy (cgroupsPerQOS with cgroupRoot "/").
CGROUP_V1_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class NodeBinaries:
    directory: Path

    @property
    def kubelet(self) -> Path:
        return self.directory / "kubelet"

    @property
    def containerd(self) -> Path:
        return self.directory / "containerd"

    @property
    def ctr(self) -> Path:
        return self.directory / "ctr"

    @property
    def runc(self) -> Path:
        return self.directory / "runc"

    @property
    def shim(self) -> Path:
        return self.directory / "containerd-shim-runc-v2"

    @property
    def cni(self) -> Path:
        return self.directory / "cni"

    @property
    def image_binary(self) -> Path:
        return self.directory / "image" / "weightsync-pause"


def build_node_binaries(*, quiet: bool = False) -> NodeBinaries:
    """Run build-node-binaries.sh (a no-op when its cache is complete); return the binaries."""
    result = subprocess.run(
        ["bash", str(NODE_BUILD_SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if quiet else None,
        text=True,
        check=True,
    )
    return NodeBinaries(Path(result.stdout.strip().splitlines()[-1]))


class NodeBinariesMissingError(ClusterError):
    """build-node-binaries.sh's cache is incomplete (``hack/setup.sh`` builds it)."""


def built_node_binaries() -> NodeBinaries:
    """The binaries as already built (``build-node-binaries.sh --check``: builds nothing); raises
    :class:`NodeBinariesMissingError`, naming what is missing, when they are not all there."""
    result = subprocess.run(
        ["bash", str(NODE_BUILD_SCRIPT), "--check"], capture_output=True, text=True, check=False, timeout=60
    )
    if result.returncode != 0:
        raise NodeBinariesMissingError(
            result.stderr.strip() or f"build-node-binaries.sh --check exited {result.returncode}"
        )
    return NodeBinaries(Path(result.stdout.strip().splitlines()[-1]))


# --- OCI images without Docker ------------------------------------------------------------------------------


def _blob(blobs: dict[str, bytes], data: bytes) -> dict[str, object]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"digest": digest, "size": len(data)}


def _tar(entries: list[tuple[str, bytes | None, int]], links: dict[str, str] | None = None) -> bytes:
    """An uncompressed, reproducible tar: (path, content or None for a directory, mode), then symbolic links
    (path: target)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, content, mode in entries:
            info = tarfile.TarInfo(path)
            info.mode, info.mtime, info.uid, info.gid = mode, 0, 0, 0
            if content is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
        for path, target in sorted((links or {}).items()):
            info = tarfile.TarInfo(path)
            info.type, info.linkname, info.mode, info.mtime = tarfile.SYMTYPE, target, 0o777, 0
            tar.addfile(info)
    return out.getvalue()


def oci_archive(
    path: Path,
    binary: Path,
    name: str,
    entrypoint: list[str],
    *,
    directories: tuple[str, ...] = (),
    links: dict[str, str] | None = None,
) -> Path:
    """Write an OCI image layout tarball of one layer holding ``binary`` as ``/<its name>`` (and the empty
    directories a container's mounts land on, plus ``directories`` and symbolic ``links``), named ``name`` for
    ``ctr images import``."""
    layer = _tar(
        [(d, None, 0o755) for d in ("dev", "proc", "sys", "etc", "tmp", "var", "run", *directories)]
        + [(binary.name, binary.read_bytes(), 0o755)],
        links,
    )
    # Level 1: the 5.7 MB binary took 1.26 s at the default 9 (three images: most of the node's start), 0.08 s here.
    compressed = gzip.compress(layer, compresslevel=1, mtime=0)
    blobs: dict[str, bytes] = {}
    layer_desc = {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **_blob(blobs, compressed)}
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": entrypoint, "Env": ["PATH=/"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
    }
    config_desc = {
        "mediaType": "application/vnd.oci.image.config.v1+json",
        **_blob(blobs, json.dumps(config, sort_keys=True).encode()),
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config_desc,
        "layers": [layer_desc],
    }
    manifest_desc = {
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        **_blob(blobs, json.dumps(manifest, sort_keys=True).encode()),
        "platform": {"architecture": "amd64", "os": "linux"},
        "annotations": {
            "io.containerd.image.name": name,
            "org.opencontainers.image.ref.name": name.rsplit(":", maxsplit=1)[-1],
        },
    }
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [manifest_desc]}
    entries: list[tuple[str, bytes | None, int]] = [
        ("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode(), 0o644),
        ("index.json", json.dumps(index, sort_keys=True).encode(), 0o644),
        ("blobs", None, 0o755),
        ("blobs/sha256", None, 0o755),
    ]
    entries += [(f"blobs/sha256/{d.split(':')[1]}", data, 0o644) for d, data in blobs.items()]
    path.write_bytes(_tar(entries))
    return path


def host_python_mounts() -> list[Path]:
    """What a container needs of this host to run this process's Python (``sys.executable``) on this checkout:
    ``/usr`` (the C library and what the interpreter links), the interpreter's installation (``sys.base_prefix``),
    the venv (``sys.prefix``) and the repository (its editable install points there); each at its own path, none
    inside another."""
    wanted = [Path("/usr"), Path(sys.base_prefix).resolve(), Path(sys.prefix), REPO]
    mounts: list[Path] = []
    for path in wanted:
        if not any(path == m or m in path.parents for m in mounts):
            mounts = [m for m in mounts if path not in m.parents] + [path]
    return mounts


def host_python_pod(name: str, args: list[str], node: str = NODE_NAME) -> dict[str, object]:
    """A pod on the real node whose one container (``HOST_IMAGE``) runs ``sys.executable args...`` with the
    host's ``/usr``, the interpreter, the venv and the checkout mounted read-only at their own paths (hostPath
    volumes), to completion (``restartPolicy: Never``)."""
    mounts = host_python_mounts()
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            "dnsPolicy": "Default",
            "volumes": [
                {"name": f"host-{i}", "hostPath": {"path": str(path), "type": "Directory"}}
                for i, path in enumerate(mounts)
            ],
            "containers": [
                {
                    "name": "python",
                    "image": HOST_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": [sys.executable, *args],
                    "workingDir": "/tmp",
                    "env": [
                        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
                        {"name": "HOME", "value": "/tmp"},
                        {"name": "PATH", "value": f"{Path(sys.executable).parent}:/usr/bin:/bin"},
                    ],
                    "volumeMounts": [
                        {"name": f"host-{i}", "mountPath": str(path), "readOnly": True} for i, path in enumerate(mounts)
                    ],
                }
            ],
        },
    }


def other_real_nodes(directory: Path | None = None) -> list[tuple[int, str]]:
    """The kubelets of real nodes running on this host (PID, their ``--config``), but the one under ``directory``:
    one real node per host (the bridge, its subnet and the node's name are fixed)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        if Path(argv[0]).name != "kubelet":
            continue
        config = next((a.removeprefix("--config=") for a in argv if a.startswith("--config=")), "")
        if "/realnode/" in config and (directory is None or not config.startswith(f"{directory}/")):
            found.append((int(entry.name), config))
    return found


# --- The node ----------------------------------------------------------------------------------------------


class RealNode:
    """containerd and a kubelet for one real node of ``cluster``; their processes are recorded in the cluster's
    state (so ``LocalCluster.down`` stops them), and :meth:`stop` cleans what they leave behind."""

    def __init__(self, cluster: LocalCluster, binaries: NodeBinaries, name: str = NODE_NAME) -> None:
        self.cluster = cluster
        self.binaries = binaries
        self.name = name
        self.directory = cluster.directory / "realnode"
        self.socket = self.directory / "containerd" / "containerd.sock"

    @classmethod
    def started(cls, cluster: LocalCluster, state: ClusterState) -> RealNode:
        """The real node ``cluster.up(real_node=...)`` started, its binaries as ``state`` recorded them."""
        if not state.real_node:
            raise ClusterError(f"the cluster at {cluster.directory} runs no real node")
        return cls(cluster, NodeBinaries(Path(state.real_node)))

    # --- Start -------------------------------------------------------------------------------------------

    def start(self, state: ClusterState, timeout: float = 120) -> None:
        """containerd, the images, the kubelet; returns when the node is Ready."""
        others = other_real_nodes(self.directory)
        if others:
            pid, config = others[0]
            raise ClusterError(
                f"another real node runs on this host (kubelet PID {pid}, {config}): one per host (bridge {BRIDGE}, "
                f"{POD_SUBNET}); stop its cluster first"
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        self._start_containerd(state)
        self._import_images()
        self._bridge()
        self._start_api_relay(state)
        cluster_dns.start(self.cluster, state, self.binaries.directory, NODE_IP)
        self._start_kubelet(state)
        _wait(f"node {self.name} Ready", lambda: self.ready(state), timeout, self.cluster.logs / "kubelet.log")

    def ready(self, state: ClusterState) -> bool:
        out = self.cluster._kubectl(
            state,
            "get",
            "node",
            self.name,
            "-o",
            "jsonpath={.status.conditions[?(@.type=='Ready')].status}",
            check=False,
        ).stdout
        return out.strip() == "True"

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.binaries.ctr), f"--address={self.socket}", "--namespace=k8s.io", *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=120,
        )

    def _containerd_config(self) -> str:
        d = self.directory / "containerd"
        cni = self.directory / "cni"
        return f"""version = 3
root = '{d / "root"}'
state = '{d / "state"}'
# Plugins that need what this host lacks (or a second daemon's paths) are left out.
disabled_plugins = ['io.containerd.snapshotter.v1.btrfs', 'io.containerd.snapshotter.v1.zfs',
  'io.containerd.snapshotter.v1.devmapper', 'io.containerd.snapshotter.v1.erofs',
  'io.containerd.tracing.processor.v1.otlp', 'io.containerd.internal.v1.tracing']

[grpc]
  address = '{self.socket}'
[ttrpc]
  address = '{d / "containerd.sock.ttrpc"}'
[debug]
  address = '{d / "debug.sock"}'
[metrics]
  address = ''

[plugins]
  [plugins.'io.containerd.internal.v1.opt']
    path = '{d / "opt"}'
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = '{PAUSE_IMAGE}'
  [plugins.'io.containerd.cri.v1.runtime']
    netns_mounts_under_state_dir = true
    # Processes here lack CAP_SYS_RESOURCE, so runc cannot lower a sandbox's oom_score_adj (the CRI's is -998):
    # "runc init error(s): nsexec[900]: failed to update /proc/self/oom_score_adj: Permission denied". This clamps
    # it to containerd's own (0).
    restrict_oom_score_adj = true
    cdi_spec_dirs = []
    enable_criu = false
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
        runtime_path = '{self.binaries.shim}'
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = '{self.binaries.runc}'
          SystemdCgroup = false
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['{self.binaries.cni}']
      conf_dir = '{cni / "net.d"}'
  [plugins.'io.containerd.grpc.v1.cri']
    stream_server_address = '127.0.0.1'
"""

    def _cni_config(self) -> str:
        return json.dumps(
            {
                "cniVersion": "1.0.0",
                "name": "weightsync-realnode",
                "plugins": [
                    {
                        "type": "bridge",
                        "bridge": BRIDGE,
                        "isGateway": True,
                        "ipMasq": False,
                        "ipam": {
                            "type": "host-local",
                            "ranges": [[{"subnet": POD_SUBNET}]],
                            "routes": [{"dst": "0.0.0.0/0"}],
                            "dataDir": str(self.directory / "cni" / "ipam"),
                        },
                    }
                ],
            },
            indent=2,
        )

    def _start_containerd(self, state: ClusterState) -> None:
        (self.directory / "containerd").mkdir(parents=True, exist_ok=True)
        (self.directory / "cni" / "net.d").mkdir(parents=True, exist_ok=True)
        (self.directory / "cni" / "net.d" / "10-weightsync.conflist").write_text(self._cni_config())
        config = self.directory / "containerd" / "config.toml"
        config.write_text(self._containerd_config())
        self.cluster._start(state, "containerd", self.binaries.containerd, [f"--config={config}"])

        def up() -> bool:
            return self.socket.exists() and self.ctr("version", check=False).returncode == 0

        _wait("containerd", up, 60, self.cluster.logs / "containerd.log")

    def _import_images(self) -> None:
        images = self.directory / "images"
        images.mkdir(exist_ok=True)
        binary = self.binaries.image_binary
        for name, entrypoint, file, host in (
            (PAUSE_IMAGE, [f"/{binary.name}"], "pause.tar", False),
            (SERVE_IMAGE, [f"/{binary.name}", "serve", str(SERVE_PORT)], "serve.tar", False),
            (HOST_IMAGE, [f"/{binary.name}"], "host.tar", True),
        ):
            archive = oci_archive(
                images / file,
                binary,
                name,
                entrypoint,
                directories=("usr",) if host else (),
                links=MERGED_USR_LINKS if host else None,
            )
            result = self.ctr("images", "import", "--platform=linux/amd64", str(archive), check=False)
            if result.returncode != 0:
                raise ClusterError(f"ctr images import {archive} failed: {result.stderr.strip()}")

    def import_archive(self, archive: Path) -> None:
        """An image's OCI archive (``hack/build-images.sh``'s) into the node's containerd, named as its index says."""
        result = self.ctr("images", "import", "--platform=linux/amd64", str(archive), check=False)
        if result.returncode != 0:
            raise ClusterError(f"ctr images import {archive} failed: {result.stderr.strip()}")

    @staticmethod
    def _bridge() -> None:
        """The CNI bridge with its gateway address (the plugin takes it as it finds it)."""
        if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True, check=False).returncode != 0:
            subprocess.run(["ip", "link", "add", BRIDGE, "type", "bridge"], capture_output=True, check=True)
        show = ["ip", "-4", "-o", "addr", "show", BRIDGE]
        addresses = subprocess.run(show, capture_output=True, text=True, check=True).stdout
        if f" {NODE_IP}/" not in addresses:
            prefix = POD_SUBNET.rsplit("/", 1)[1]
            subprocess.run(["ip", "addr", "add", f"{NODE_IP}/{prefix}", "dev", BRIDGE], capture_output=True, check=True)
        subprocess.run(["ip", "link", "set", BRIDGE, "up"], capture_output=True, check=True)

    def _start_api_relay(self, state: ClusterState, timeout: float = 30) -> None:
        """The ``kubernetes`` Service's ClusterIP on the bridge and a relay there to the API server (127.0.0.1): what
        a pod's in-cluster client connects to (``$KUBERNETES_SERVICE_HOST``), with no kube-proxy. TLS stays end to
        end (the API server's certificate names the ClusterIP). A NAT rule would do too, but a NAT table makes the
        kernel track every connection of the host, the suite's loopback traffic included: the relay needs no
        netfilter (docs/local-cluster.md)."""
        service: dict[str, object] = {}

        def found() -> bool:
            got = self.cluster._kubectl(
                state, "get", "service", "kubernetes", "-n", "default", "-o", "json", check=False
            )
            if got.returncode == 0:
                service.update(json.loads(got.stdout)["spec"])
            return bool(service)

        _wait("the kubernetes Service", found, timeout, self.cluster.logs / "apiserver.log")
        cluster_ip = str(service["clusterIP"])
        ports = service["ports"]
        assert isinstance(ports, list) and ports, service
        port = int(ports[0]["port"])
        show = ["ip", "-4", "-o", "addr", "show", BRIDGE]
        if f" {cluster_ip}/" not in subprocess.run(show, capture_output=True, text=True, check=True).stdout:
            subprocess.run(["ip", "addr", "add", f"{cluster_ip}/32", "dev", BRIDGE], capture_output=True, check=True)
        self.cluster._start(
            state,
            "apiserver-relay",
            Path(sys.executable),
            [
                "-m",
                "weightsync_testing.tcp_forward",
                cluster_ip,
                str(port),
                "127.0.0.1",
                str(state.apiserver_port),
            ],
        )

        def listening() -> bool:
            with contextlib.suppress(OSError), socket.create_connection((cluster_ip, port), timeout=1):
                return True
            return False

        _wait("the API server relay", listening, timeout, self.cluster.logs / "apiserver-relay.log")

    def _kubelet_config(self, healthz_port: int, port: int) -> dict[str, object]:
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # This host has cgroup v1 (hybrid); kubelet >= 1.35 refuses it unless told not to.
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "address": NODE_IP,
            "port": port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": healthz_port,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(pki_mod.Pki(self.cluster.directory / "pki").ca_cert)},
            },
            # Only this host reaches the bridge; the API server comes with a certificate of the cluster's CA.
            "authorization": {"mode": "AlwaysAllow"},
            "clusterDomain": cluster_dns.DOMAIN,
            "clusterDNS": [NODE_IP],
            "resolvConf": "/etc/resolv.conf",
            "podLogsDir": str(self.directory / "pod-logs"),
            "volumePluginDir": str(self.directory / "volume-plugins"),
            # A shared development disk may be nearly full: no image GC, no disk-pressure eviction.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "registerNode": True,
            # No KUBE-FIREWALL chains: with iptables on the host (buildah pulls it in) they put every packet of the
            # host, the suite's loopback Mooncake and HTTP traffic included, through conntrack (run23: +27 % CPU).
            "makeIPTablesUtilChains": False,
            "serializeImagePulls": False,
        }

    def _start_kubelet(self, state: ClusterState) -> None:
        pki = pki_mod.Pki(self.cluster.directory / "pki")
        client = pki_mod.client_certificate(pki, f"kubelet-{self.name}", f"system:node:{self.name}", "system:nodes")
        kubeconfig = self.directory / "kubelet.kubeconfig"
        kubeconfig.write_text(pki_mod.kubeconfig(pki, state.server, user=f"system:node:{self.name}", client=client))
        config = self.directory / "kubelet-config.yaml"
        config.write_text(yaml.safe_dump(self._kubelet_config(free_port(), free_port()), sort_keys=False))
        for sub in ("kubelet", "pod-logs", "volume-plugins", "kubelet-certs"):
            (self.directory / sub).mkdir(exist_ok=True)
        self.cluster._start(
            state,
            "kubelet",
            self.binaries.kubelet,
            [
                f"--config={config}",
                f"--kubeconfig={kubeconfig}",
                f"--root-dir={self.directory / 'kubelet'}",
                f"--cert-dir={self.directory / 'kubelet-certs'}",
                f"--hostname-override={self.name}",
                f"--node-ip={NODE_IP}",
                "--node-labels=type=real",
                "--v=2",
            ],
        )

    # --- Stop --------------------------------------------------------------------------------------------

    def stop(self, state: ClusterState, timeout: float = 60) -> None:
        """Delete the node's pods (the kubelet stops their sandboxes: CNI DEL, unmounts), stop the kubelet, remove
        what is left in containerd, stop it, then its shims (by PID, those serving its socket), mounts under the
        node's directory, the bridge and the kubelet's empty cgroups."""
        names = {p.name: p for p in state.processes}
        kubelet, containerd = names.get("kubelet"), names.get("containerd")
        if kubelet and _alive(kubelet) and containerd and _alive(containerd):
            self.cluster._kubectl(
                state,
                "delete",
                "pods",
                "--all-namespaces",
                f"--field-selector=spec.nodeName={self.name}",
                "--wait=false",
                check=False,
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.ctr("tasks", "ls", "-q", check=False).stdout.strip():
                time.sleep(0.5)
        for process in (kubelet, containerd):
            if process is not None and process.name == "containerd" and _alive(process):
                for task in self.ctr("tasks", "ls", "-q", check=False).stdout.split():
                    self.ctr("tasks", "kill", "--signal=SIGKILL", task, check=False)
                    self.ctr("tasks", "delete", "--force", task, check=False)
                for container in self.ctr("containers", "ls", "-q", check=False).stdout.split():
                    self.ctr("containers", "delete", container, check=False)
            if process is not None:
                terminate(process)
        helpers = ("apiserver-relay", cluster_dns.PROCESS, network_policies.PROCESS)
        for helper in helpers:
            if helper in names:
                terminate(names[helper])
        if network_policies.PROCESS in names:  # a test that enforced NetworkPolicies and did not stop the engine
            network_policies.remove_rules()
        state.processes = [p for p in state.processes if p.name not in ("kubelet", "containerd", *helpers)]
        state.save()
        for pid in self._shims():
            os.kill(pid, signal.SIGKILL)
        self._unmount()
        subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, check=False)
        self._remove_cgroups()

    def _shims(self) -> list[int]:
        """PIDs of containerd-shim-runc-v2 processes started by this node's containerd (``-address <socket>``)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if Path(argv[0].decode(errors="replace")).name != "containerd-shim-runc-v2":
                continue
            args = [a.decode(errors="replace") for a in argv]
            if "-address" in args and args[args.index("-address") + 1 : args.index("-address") + 2] == [
                str(self.socket)
            ]:
                pids.append(int(entry.name))
        return pids

    def _unmount(self) -> None:
        prefix = str(self.directory) + "/"
        mounts = [
            line.split()[1].encode().decode("unicode_escape") for line in Path("/proc/mounts").read_text().splitlines()
        ]
        for target in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
            subprocess.run(["umount", "-l", target], capture_output=True, check=False)

    @staticmethod
    def _remove_cgroups() -> None:
        for hierarchy in CGROUP_V1_ROOT.iterdir():
            kubepods = hierarchy / "kubepods"
            if not kubepods.is_dir():
                continue
            for directory, _subdirs, _files in sorted(os.walk(kubepods), key=lambda w: len(w[0]), reverse=True):
                with contextlib.suppress(OSError):
                    os.rmdir(directory)
