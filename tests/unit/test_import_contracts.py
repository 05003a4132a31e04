"""The layers of docs/architecture.md, pinned: import-linter's contracts (pyproject.toml) must all hold."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_import_contract_is_kept() -> None:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint, "import-linter is a dev dependency: pip install -e '.[dev]'"
    done = subprocess.run([lint, "--no-cache"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "BROKEN" not in done.stdout and " 0 broken" in done.stdout


def test_the_layers_contract_names_every_agent_wing() -> None:
    """A new top-level module of the agent must take a place in the layers, not float outside them."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in config if c["type"] == "layers" and c["containers"] == ["weightsync_agent"])["layers"]
    placed = {name.strip() for layer in layers for name in layer.split("|")}
    package = ROOT / "agent" / "weightsync_agent"
    wings = {p.stem for p in package.glob("*.py") if p.stem != "__init__"} | {
        p.parent.name for p in package.glob("*/__init__.py")
    }
    assert wings == placed, f"not placed in a layer: {sorted(wings - placed)}; gone: {sorted(placed - wings)}"
