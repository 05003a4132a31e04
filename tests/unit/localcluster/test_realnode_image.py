"""The real node's OCI image tarballs (realnode.oci_archive): a valid image layout that `ctr images import` names
from its index annotation, with digests and the layer's diff ID that match their contents."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

from weightsync_tools.localcluster.realnode import (
    HOST_IMAGE,
    MERGED_USR_LINKS,
    REPO,
    SERVE_IMAGE,
    host_python_mounts,
    host_python_pod,
    oci_archive,
    other_real_nodes,
)


def _members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


def test_archive_is_an_oci_layout_with_matching_digests(tmp_path: Path) -> None:
    binary = tmp_path / "weightsync-pause"
    binary.write_bytes(b"\x7fELF not really")
    archive = oci_archive(tmp_path / "serve.tar", binary, SERVE_IMAGE, ["/weightsync-pause", "serve", "8080"])
    files = _members(archive)
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    for name, data in files.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1]

    (entry,) = json.loads(files["index.json"])["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == SERVE_IMAGE
    manifest = json.loads(files[f"blobs/sha256/{entry['digest'].split(':')[1]}"])
    assert entry["size"] == len(files[f"blobs/sha256/{entry['digest'].split(':')[1]}"])
    config = json.loads(files[f"blobs/sha256/{manifest['config']['digest'].split(':')[1]}"])
    assert config["config"]["Entrypoint"] == ["/weightsync-pause", "serve", "8080"]
    (layer_desc,) = manifest["layers"]
    layer = gzip.decompress(files[f"blobs/sha256/{layer_desc['digest'].split(':')[1]}"])
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(layer).hexdigest()]
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        member = tar.getmember("weightsync-pause")
        assert member.mode == 0o755
        assert tar.extractfile(member).read() == binary.read_bytes()  # type: ignore[union-attr]
        assert {"dev", "proc", "sys", "etc", "tmp"} <= set(tar.getnames())


def test_archive_is_reproducible(tmp_path: Path) -> None:
    binary = tmp_path / "weightsync-pause"
    binary.write_bytes(b"same bytes")
    first = oci_archive(tmp_path / "a.tar", binary, SERVE_IMAGE, ["/weightsync-pause"]).read_bytes()
    second = oci_archive(tmp_path / "b.tar", binary, SERVE_IMAGE, ["/weightsync-pause"]).read_bytes()
    assert first == second


def test_host_image_has_the_merged_usr_links(tmp_path: Path) -> None:
    binary = tmp_path / "weightsync-pause"
    binary.write_bytes(b"x")
    archive = oci_archive(
        tmp_path / "host.tar", binary, HOST_IMAGE, ["/weightsync-pause"], directories=("usr",), links=MERGED_USR_LINKS
    )
    files = _members(archive)
    (entry,) = json.loads(files["index.json"])["manifests"]
    manifest = json.loads(files[f"blobs/sha256/{entry['digest'].split(':')[1]}"])
    (layer_desc,) = manifest["layers"]
    layer = gzip.decompress(files[f"blobs/sha256/{layer_desc['digest'].split(':')[1]}"])
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        assert tar.getmember("usr").isdir()
        assert {m.name: m.linkname for m in tar.getmembers() if m.issym()} == MERGED_USR_LINKS


def test_host_python_pod_mounts_usr_the_interpreter_and_the_checkout_read_only() -> None:
    mounts = host_python_mounts()
    assert Path("/usr") in mounts and any(m == REPO or m in REPO.parents for m in mounts)
    assert not any(a != b and a in b.parents for a in mounts for b in mounts)  # none inside another
    pod = host_python_pod("p", ["-m", "weightsync_tools.cli.main", "--help"])
    (container,) = pod["spec"]["containers"]  # type: ignore[index]
    assert container["image"] == HOST_IMAGE and all(m["readOnly"] for m in container["volumeMounts"])
    assert [v["hostPath"]["path"] for v in pod["spec"]["volumes"]] == [str(m) for m in mounts]  # type: ignore[index]


def test_a_running_real_node_is_found_by_its_kubelets_config(tmp_path: Path) -> None:
    """One real node per host: a process named kubelet with a --config under some <cluster>/realnode/ is another one,
    unless it is under the directory asked about."""
    kubelet = tmp_path / "kubelet"
    shutil.copy("/bin/sh", kubelet)
    config = tmp_path / "cluster" / "realnode" / "kubelet-config.yaml"
    # A shell named kubelet that waits (two commands, so it does not exec sleep in its place).
    process = subprocess.Popen([str(kubelet), "-c", "sleep 30; :", f"--config={config}"])
    try:
        # Popen returns once exec has closed its error pipe, before the kernel has set the new argv: on a loaded
        # machine /proc/PID/cmdline is empty for a moment (CI read it so). Wait for the argv, bounded.
        cmdline, deadline = Path(f"/proc/{process.pid}/cmdline"), time.monotonic() + 10
        while b"--config=" not in cmdline.read_bytes():
            assert time.monotonic() < deadline, cmdline.read_bytes()
            time.sleep(0.01)
        assert (process.pid, str(config)) in other_real_nodes()
        assert process.pid not in [pid for pid, _ in other_real_nodes(tmp_path / "cluster" / "realnode")]
    finally:
        process.kill()
        process.wait()
    assert process.pid not in [pid for pid, _ in other_real_nodes()]
