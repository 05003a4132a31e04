"""The images that ``hack/build-images.sh`` builds (no registry: a Debian base from debootstrap), imported into a
containerd and run with the real node's runc. Each one's index names the chart's default image, it runs as uid 65532,
and its root filesystem is read-only under ``--read-only`` (what ``readOnlyRootFilesystem`` asks of a kubelet). The
operator's entry point with the chart's arguments (or its own default ones) runs ``weightsync operator``. The agent's
(built with ``TORCH=node``) runs ``weightsync agent``: with the node's site-packages mounted read-only where the image
looks for it, torch, the Mooncake Transfer Engine and the agent's own modules import in the image's Python; without the
mount it says so in one line and exits 2.

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
import shutil
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

from weightsync.api import names
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


#: Where the agent image built with ``TORCH=node`` looks for the node's torch (agent/Dockerfile's .pth line).
NODE_PYTHON = names.SITE_PACKAGES_PATH


def agent_image_name() -> str:
    """What the operator puts into pods by default (the chart's ``agentImage``)."""
    values = yaml.safe_load((REPO / "charts" / "weightsync" / "values.yaml").read_text())
    chart = yaml.safe_load((REPO / "charts" / "weightsync" / "Chart.yaml").read_text())
    return f"{values['agentImage']['repository']}:{values['agentImage']['tag'] or chart['appVersion']}"


def archive_or_reason() -> tuple[list[Path], NodeBinaries] | str:
    """The archives (operator, agent) and the node binaries where the images can run here; otherwise why not, in one
    line."""
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
    return [Path(line) for line in check.stdout.split()], binaries


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

    def run(
        self, image: str, name: str, *command: str, mounts: tuple[str, ...] = (), timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """``command`` in a new container of ``image`` as the image configures it (user, environment, working
        directory), its root filesystem read-only, removed afterwards. No cgroup: nothing to clean up on the host.
        ``mounts``: ``ctr run --mount`` specifications."""
        flags = [f"--mount={mount}" for mount in mounts]
        return self.ctr(
            "run",
            "--rm",
            "--read-only",
            "--cgroup=",
            *flags,
            f"--runc-binary={self.binaries.runc}",
            image,
            name,
            *command,
            timeout=timeout,
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
def images() -> Iterator[tuple[Containerd, dict[str, tuple[str, dict[str, Any]]]]]:
    """The containerd that imported both images, and each image's name and runtime configuration by role."""
    found = archive_or_reason()
    if isinstance(found, str):
        if os.environ.get(REQUIRE) == "1":  # CI: the build ran in hack/setup.sh, so an image is missing for a cause
            pytest.fail(f"{REQUIRE}=1 and images: {found}")
        pytest.skip(f"images: {found}")
    archives, binaries = found
    with contextlib.ExitStack() as cleanup:  # undone in reverse: containerd stopped, unmounted, removed
        # A short path: containerd's sockets live under it (a unix socket's path has at most 107 bytes).
        directory = Path(tempfile.mkdtemp(prefix="ws-images-", dir="/tmp"))
        cleanup.callback(subprocess.run, ["rm", "-rf", "--one-file-system", str(directory)], check=False)
        # containerd's root and state on a tmpfs of their own: the import writes the archive's blobs and unpacks
        # its layers (~600 MB for the operator's), which took 17-44 s on this machine's shared disk and 5 s in memory.
        (directory / "ram").mkdir()
        mount = ["mount", "-t", "tmpfs", "-o", "size=3g,mode=0700", "tmpfs", str(directory / "ram")]
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
        for archive in archives:
            started = time.monotonic()
            imported = daemon.ctr("images", "import", "--platform=linux/amd64", str(archive))
            assert imported.returncode == 0, imported.stderr
            print(f"\nimported {archive.name} in {time.monotonic() - started:.1f} s", file=sys.stderr)
        operator_archive, agent_archive = archives
        yield (
            daemon,
            {
                "operator": (operator_image_name(), image_config(operator_archive)),
                "agent": (agent_image_name(), image_config(agent_archive)),
            },
        )


@pytest.fixture
def operator_image(
    images: tuple[Containerd, dict[str, tuple[str, dict[str, Any]]]],
) -> tuple[Containerd, str, dict[str, Any]]:
    return _of_role(images, "operator")


@pytest.fixture
def agent_image(
    images: tuple[Containerd, dict[str, tuple[str, dict[str, Any]]]],
) -> tuple[Containerd, str, dict[str, Any]]:
    return _of_role(images, "agent")


def _of_role(
    images: tuple[Containerd, dict[str, tuple[str, dict[str, Any]]]], role: str
) -> tuple[Containerd, str, dict[str, Any]]:
    daemon, by_role = images
    name, config = by_role[role]
    return daemon, name, config


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


@pytest.mark.parametrize("role", ["operator", "agent"])
def test_the_archive_is_the_charts_default_image(
    images: tuple[Containerd, dict[str, tuple[str, dict[str, Any]]]], role: str
) -> None:
    """`ctr images import` names it from the archive alone, as the chart's values name the image."""
    daemon, by_role = images
    image, _ = by_role[role]
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


@pytest.mark.parametrize("role", ["operator", "agent"])
def test_runs_as_uid_65532_with_a_read_only_root(
    images: tuple[Containerd, dict[str, tuple[str, dict[str, Any]]]], role: str
) -> None:
    """The user comes from the image (no ``--user``); a write to ``/`` and to the world-writable ``/tmp`` fails with
    EROFS, not EACCES, so it is the read-only mount that refuses it and not the permissions."""
    daemon, by_role = images
    image, config = by_role[role]
    assert config["User"] == f"{UID}:{UID}"
    script = "id -u; id -g; touch /probe 2>&1; touch /tmp/probe 2>&1; echo end"
    result = daemon.run(image, f"{role}-probe", "sh", "-c", script)
    assert result.returncode == 0, result
    lines = result.stdout.splitlines()
    assert lines[:2] == [str(UID), str(UID)], result.stdout
    assert len(lines) == 5 and lines[-1] == "end", result.stdout
    for line, path in zip(lines[2:4], ("/probe", "/tmp/probe"), strict=True):
        assert path in line and "Read-only file system" in line, result.stdout


def node_python_mount() -> str:
    """This interpreter's site-packages (the checkout's venv: torch, its CUDA libraries, the rest), read-only where the
    agent image looks for the node's: what the real node's cache gives the agent container."""
    import sysconfig

    return f"type=bind,src={sysconfig.get_paths()['purelib']},dst={NODE_PYTHON},options=rbind:ro"


def test_the_agent_image_runs_the_agent_with_the_nodes_torch(
    agent_image: tuple[Containerd, str, dict[str, Any]],
) -> None:
    """Its default command is ``weightsync agent``; with the node's site-packages mounted, the image's own Python
    imports torch from the mount and the transfer engine and the agent's sidecar from the image (the image's packages
    come first: the mount's copy of weightsync, an editable install, is not the one imported), and the entry point's
    ``--help`` lists the agent's options."""
    daemon, image, config = agent_image
    assert config["Entrypoint"] + config["Cmd"] == ["weightsync", "agent"], config
    probe = (
        "import torch, mooncake.engine, weightsync_agent.sidecar.main as m; "
        "print(torch.__file__); print(mooncake.engine.__file__); print(m.__file__); "
        "print(torch.ones(3).add(1).sum().item())"
    )
    result = daemon.run(image, "agent-imports", "python3", "-c", probe, mounts=(node_python_mount(),))
    assert result.returncode == 0, result
    torch_file, mooncake_file, agent_file, total = result.stdout.split()
    assert torch_file.startswith(NODE_PYTHON + "/"), result.stdout
    assert mooncake_file.startswith("/opt/venv/") and agent_file.startswith("/opt/venv/"), result.stdout
    assert total == "6.0", result.stdout
    helped = daemon.run(
        image, "agent-help", *config["Entrypoint"], *config["Cmd"], "--help", mounts=(node_python_mount(),)
    )
    assert helped.returncode == 0, helped
    assert "Usage: weightsync agent" in helped.stdout and "--plan-file" in helped.stdout, helped.stdout


def test_the_agent_image_without_the_nodes_torch_says_so_in_one_line(
    agent_image: tuple[Containerd, str, dict[str, Any]],
) -> None:
    """Started as a pod would start it, without the mount: exit 2 and one line naming torch and where the image looks
    for it, not a traceback."""
    daemon, image, config = agent_image
    result = daemon.run(image, "agent-no-torch", *config["Entrypoint"], *config["Cmd"])
    assert result.returncode == 2, result
    # ctr's own log lines (logrus: time="..." level=...) share its stderr with the container's.
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line and not line.startswith('time="')]
    assert len(lines) == 1, result
    (line,) = lines
    assert "torch is not installed" in line and NODE_PYTHON in line, line


def test_the_agent_image_traces_a_stock_sglang_model_with_the_engines_site_packages(
    agent_image: tuple[Containerd, str, dict[str, Any]],
) -> None:
    """The engine-side agent for SGLang engines is the same image with the engine's site-packages mounted instead
    of the trainer's: the pinned SGLang venv's (SGLang, its torch), so the agent's own interpreter is also the
    engine's (``WEIGHTSYNC_ENGINE_PYTHON`` unset). In it, the agent's ``run_trace`` runs stock SGLang's shard-map
    trace of a tiny model: SGLang's own ``load_weights`` traced in the container, read-only root, uid 65532."""
    sglang_python = os.environ.get("WEIGHTSYNC_SGLANG_PYTHON")
    if not sglang_python:
        reason = "WEIGHTSYNC_SGLANG_PYTHON is not set (hack/test.sh sets it to the pinned SGLang venv)"
        if os.environ.get("WEIGHTSYNC_REQUIRE_SGLANG") == "1":
            pytest.fail(f"WEIGHTSYNC_REQUIRE_SGLANG=1 and {reason}")
        pytest.skip(reason)
    site = subprocess.run(
        [sglang_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    from weightsync_testing.sglang_models import ensure_tiny_model

    # A copy anyone may read: the container runs as uid 65532, the cache is root's.
    model = Path(tempfile.mkdtemp(prefix="ws-model-"))
    model_source = ensure_tiny_model(sglang_python)
    shutil.copytree(model_source, model, dirs_exist_ok=True)
    model.chmod(0o755)
    for path in model.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    daemon, image, _ = agent_image
    probe = (
        "import json, torch, sglang; "
        "from weightsync_agent.targets.engine_trace import run_trace; "
        "t = run_trace('sglang', model='/model', tp=2, rank=1, dtype='float32', who='probe'); "
        "print(json.dumps({'sglang': sglang.__file__, 'torch': torch.__file__, 'trace': t}))"
    )
    mounts = (
        f"type=bind,src={site},dst={names.SITE_PACKAGES_PATH},options=rbind:ro",
        f"type=bind,src={model},dst=/model,options=rbind:ro",
        "type=tmpfs,src=tmpfs,dst=/tmp,options=rw:size=256m:mode=1777",
    )
    try:
        result = daemon.run(image, "agent-sglang-trace", "python3", "-c", probe, mounts=mounts, timeout=300)
    finally:
        shutil.rmtree(model, ignore_errors=True)
    assert result.returncode == 0, result
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["sglang"].startswith(names.SITE_PACKAGES_PATH + "/"), answer["sglang"]
    assert answer["torch"].startswith(names.SITE_PACKAGES_PATH + "/"), answer["torch"]
    # The same trace on the host, with the venv's own interpreter: the container's is that trace, not a stand-in.
    from weightsync_agent.engine_python import trace_script

    args = ["sglang", "--model", str(model_source), "--tp", "2", "--rank", "1", "--dtype", "float32"]
    host = subprocess.run(
        [sglang_python, str(trace_script()), *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    expected = json.loads(host.stdout)
    in_container = answer["trace"]
    assert in_container["tensors"] and in_container["refused"] == expected["refused"] == []
    for key in ("tensors", "layers", "sglang_version", "tp_rank", "tp_size", "dtype"):
        assert in_container[key] == expected[key], key
