"""The operator image that ``hack/build-images.sh`` builds (no registry: a Debian base from debootstrap), imported into
the real node's containerd and run with its runc: its index names the chart's default image, its entry point with the
chart's arguments (or its own default ones) runs ``weightsync operator``, it runs as uid 65532, and its root filesystem
is read-only under ``--read-only`` (what the chart's ``readOnlyRootFilesystem`` asks of a kubelet).

The build is not part of the test (cold ~3 min, then cached): it skips with the reason in one line unless the archive
was built from the current sources (``hack/build-images.sh --check``), it runs as root on Linux, and the real node's
binaries are built (``hack/setup.sh``). A containerd of its own (its own root, state and socket in a temporary
directory, in memory, the CRI left out) runs the containers, so it needs no cluster and leaves the real node's
alone; ~5-10 s, most of it the import. ``WEIGHTSYNC_REQUIRE_IMAGES=1`` (CI) makes a skip a failure.
docs/local-cluster.md, "Images".
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from weightsync_tools.localcluster import binaries as binaries_mod
from weightsync_tools.localcluster.realnode import NodeBinaries, NodeBinariesMissingError, built_node_binaries

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "hack" / "build-images.sh"
UID = 65532
#: Set (CI: ``.ci/run``): a missing image is a failure, not a skip.
REQUIRE = "WEIGHTSYNC_REQUIRE_IMAGES"


def operator_image_name() -> str:
    """What the chart deploys by default (the name the build gives the image)."""
    values = yaml.safe_load((REPO / "charts" / "weightsync" / "values.yaml").read_text())
    chart = yaml.safe_load((REPO / "charts" / "weightsync" / "Chart.yaml").read_text())
    return f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}"


def chart_operator_args() -> list[str]:
    """The operator container's ``args`` as the chart renders them with its default values."""
    helm = binaries_mod.install_tools(quiet=True) / "helm"
    command = [str(helm), "template", "weightsync", str(REPO / "charts" / "weightsync")]
    rendered = subprocess.run(command, capture_output=True, text=True, check=True, timeout=60).stdout
    for document in yaml.safe_load_all(rendered):
        if document and document["kind"] == "Deployment":
            (container,) = [c for c in document["spec"]["template"]["spec"]["containers"] if c["name"] == "operator"]
            return [str(arg) for arg in container["args"]]
    raise AssertionError(f"the chart renders no operator Deployment:\n{rendered}")


def archive_or_reason() -> tuple[Path, NodeBinaries] | str:
    """The operator archive and the node binaries where the images can run here; otherwise why not, in one line."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "containerd and runc need root on Linux"
    check = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--check"], capture_output=True, text=True, check=False, timeout=60
    )
    if check.returncode != 0:
        return check.stderr.strip() or f"hack/build-images.sh --check exited {check.returncode}"
    try:
        binaries = built_node_binaries()
    except NodeBinariesMissingError as error:
        return f"{error} (hack/setup.sh builds them)"
    return Path(check.stdout.strip().splitlines()[-1]), binaries


def image_config(archive: Path) -> dict[str, Any]:
    """The image's runtime configuration (Entrypoint, Cmd, User, ...), read from the OCI archive."""
    with tarfile.open(archive) as tar:

        def blob(digest: str) -> dict[str, Any]:
            member = tar.extractfile("blobs/sha256/" + digest.removeprefix("sha256:"))
            assert member is not None, digest
            return dict(json.load(member))

        index_file = tar.extractfile("index.json")
        assert index_file is not None
        (manifest,) = json.load(index_file)["manifests"]
        config: dict[str, Any] = blob(blob(manifest["digest"])["config"]["digest"])["config"]
        return config


@dataclass
class Containerd:
    binaries: NodeBinaries
    directory: Path
    process: subprocess.Popen[bytes]

    @property
    def socket(self) -> Path:
        return self.directory / "containerd.sock"

    def ctr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.binaries.ctr), f"--address={self.socket}", "--namespace=weightsync-images", *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
        )

    def run(self, image: str, name: str, *command: str) -> subprocess.CompletedProcess[str]:
        """``command`` in a new container of ``image`` as the image configures it (user, environment, working
        directory), its root filesystem read-only, removed afterwards. No cgroup: nothing to clean up on the host."""
        return self.ctr(
            "run", "--rm", "--read-only", "--cgroup=", f"--runc-binary={self.binaries.runc}", image, name, *command
        )


def _containerd_config(directory: Path) -> str:
    # The CRI (and what only it uses) is left out: this daemon only imports and runs with ctr.
    return f"""version = 3
root = '{directory / "ram" / "root"}'
state = '{directory / "ram" / "state"}'
disabled_plugins = ['io.containerd.grpc.v1.cri', 'io.containerd.cri.v1.images', 'io.containerd.cri.v1.runtime',
  'io.containerd.podsandbox.controller.v1.podsandbox', 'io.containerd.sandbox.controller.v1.shim',
  'io.containerd.snapshotter.v1.btrfs', 'io.containerd.snapshotter.v1.zfs', 'io.containerd.snapshotter.v1.devmapper',
  'io.containerd.snapshotter.v1.erofs', 'io.containerd.tracing.processor.v1.otlp', 'io.containerd.internal.v1.tracing']

[grpc]
  address = '{directory / "containerd.sock"}'
[ttrpc]
  address = '{directory / "containerd.sock.ttrpc"}'
[debug]
  address = '{directory / "debug.sock"}'
[metrics]
  address = ''
[plugins]
  [plugins.'io.containerd.internal.v1.opt']
    path = '{directory / "opt"}'
"""


@pytest.fixture(scope="module")
def operator_image() -> Iterator[tuple[Containerd, str, dict[str, Any]]]:
    found = archive_or_reason()
    if isinstance(found, str):
        if os.environ.get(REQUIRE) == "1":  # CI: the build ran in hack/setup.sh, so an image is missing for a cause
            pytest.fail(f"{REQUIRE}=1 and images: {found}")
        pytest.skip(f"images: {found}")
    archive, binaries = found
    with contextlib.ExitStack() as cleanup:  # undone in reverse: containerd stopped, unmounted, removed
        # A short path: containerd's sockets live under it (a unix socket's path has at most 107 bytes).
        directory = Path(tempfile.mkdtemp(prefix="ws-images-", dir="/tmp"))
        cleanup.callback(subprocess.run, ["rm", "-rf", "--one-file-system", str(directory)], check=False)
        # containerd's root and state on a tmpfs of their own: the import writes the archive's blobs and unpacks
        # its layers (~600 MB in all), which took 17-44 s on this machine's shared disk and 5 s in memory.
        (directory / "ram").mkdir()
        mount = ["mount", "-t", "tmpfs", "-o", "size=2g,mode=0700", "tmpfs", str(directory / "ram")]
        subprocess.run(mount, check=True)
        cleanup.callback(_unmount_under, directory)
        config = directory / "config.toml"
        config.write_text(_containerd_config(directory))
        log = cleanup.enter_context((directory / "containerd.log").open("wb"))
        # containerd finds the runc shim on its PATH.
        env = {**os.environ, "PATH": f"{binaries.directory}:{os.environ.get('PATH', '')}"}
        process = subprocess.Popen(
            [str(binaries.containerd), f"--config={config}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        daemon = Containerd(binaries, directory, process)
        cleanup.callback(_stop, daemon)
        deadline = time.monotonic() + 30
        while daemon.ctr("version", timeout=10).returncode != 0:
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"containerd did not start: {(directory / 'containerd.log').read_text()[-2000:]}")
            time.sleep(0.1)
        started = time.monotonic()
        imported = daemon.ctr("images", "import", "--platform=linux/amd64", str(archive))
        assert imported.returncode == 0, imported.stderr
        print(f"\nimported {archive.name} in {time.monotonic() - started:.1f} s", file=sys.stderr)
        yield daemon, operator_image_name(), image_config(archive)


def _stop(daemon: Containerd) -> None:
    """Kill what still runs (a test that failed mid-run), then containerd (by its PID)."""
    for task in daemon.ctr("tasks", "ls", "-q").stdout.split():
        daemon.ctr("tasks", "kill", "--signal=SIGKILL", task)
    daemon.process.send_signal(signal.SIGTERM)
    try:
        daemon.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        daemon.process.kill()
        daemon.process.wait(timeout=10)


def _unmount_under(directory: Path) -> None:
    """Unmount what is mounted under ``directory``, deepest first: a snapshot a killed container left, the tmpfs."""
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    inside = [p for p in points if p == str(directory) or p.startswith(f"{directory}/")]
    for point in sorted(inside, key=len, reverse=True):
        subprocess.run(["umount", point], check=False)


def test_the_archive_is_the_charts_default_image(operator_image: tuple[Containerd, str, dict[str, Any]]) -> None:
    """`ctr images import` names it from the archive alone, as the chart's values name the operator image."""
    daemon, image, _ = operator_image
    assert image in daemon.ctr("images", "ls", "-q").stdout.split()


def test_the_charts_args_run_weightsync_operator(operator_image: tuple[Containerd, str, dict[str, Any]]) -> None:
    """The chart gives the container only ``args``, and a kubelet runs the image's Entrypoint followed by them: that
    command, and the image's own default (Entrypoint + Cmd), must both be ``weightsync operator`` with options only
    (an Entrypoint of ``weightsync operator`` made the chart's ``weightsync operator operator ...``, refused with "Got
    unexpected extra argument(s) (operator)"). ``--help`` appended to the chart's command exits 0 and lists the
    usage: every option given exists (an unknown one fails even before ``--help`` is handled)."""
    daemon, image, config = operator_image
    args = chart_operator_args()
    for command in (config["Entrypoint"] + args, config["Entrypoint"] + config["Cmd"]):
        assert command[:2] == ["weightsync", "operator"] and "operator" not in command[2:], command
    result = daemon.run(image, "operator-help", *config["Entrypoint"], *args, "--help")
    assert result.returncode == 0, result
    assert "Usage: weightsync operator" in result.stdout, result.stdout
    for option in (arg for arg in args + config["Cmd"] if arg.startswith("--")):
        assert option in result.stdout, (option, result.stdout)


def test_runs_as_uid_65532_with_a_read_only_root(operator_image: tuple[Containerd, str, dict[str, Any]]) -> None:
    """The user comes from the image (no ``--user``); a write to ``/`` and to the world-writable ``/tmp`` fails with
    EROFS, not EACCES, so it is the read-only mount that refuses it and not the permissions."""
    daemon, image, config = operator_image
    assert config["User"] == f"{UID}:{UID}"
    script = "id -u; id -g; touch /probe 2>&1; touch /tmp/probe 2>&1; echo end"
    result = daemon.run(image, "operator-probe", "sh", "-c", script)
    assert result.returncode == 0, result
    lines = result.stdout.splitlines()
    assert lines[:2] == [str(UID), str(UID)], result.stdout
    assert len(lines) == 5 and lines[-1] == "end", result.stdout
    for line, path in zip(lines[2:4], ("/probe", "/tmp/probe"), strict=True):
        assert path in line and "Read-only file system" in line, result.stdout
