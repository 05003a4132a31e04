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
    layers = next(c for c in config if c["type"] == "layers" and c.get("containers") == ["weightsync_agent"])["layers"]
    placed = {name.strip() for layer in layers for name in layer.split("|")}
    package = ROOT / "agent" / "weightsync_agent"
    wings = {p.stem for p in package.glob("*.py") if p.stem != "__init__"} | {
        p.parent.name for p in package.glob("*/__init__.py")
    }
    assert wings == placed, f"not placed in a layer: {sorted(wings - placed)}; gone: {sorted(placed - wings)}"


def test_every_top_level_package_is_a_root_in_its_place() -> None:
    """A new top-level package must be an import root with a place in the roots' order (or, as the engine root, be
    walled off by its own contracts), not import what it likes."""
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    linter = pyproject["tool"]["importlinter"]
    roots = set(linter["root_packages"])
    where = pyproject["tool"]["setuptools"]["packages"]["find"]["where"]
    found = {init.parent.name for folder in where for init in (ROOT / folder).glob("*/__init__.py")}
    # A folder beside the others that holds a package but is not one of the distribution's folders.
    skip = {"tests", "bench", "hack", "examples", "docs", "charts", "crds", "build", "node_modules"}
    stray = {
        init.parent.relative_to(ROOT).as_posix()
        for folder in ROOT.iterdir()
        if folder.is_dir()
        and not folder.name.startswith(".")
        and folder.name not in skip | set(where)
        and not (folder / "__init__.py").is_file()  # a package of its own: a root found in "."
        for init in folder.glob("*/__init__.py")
    }
    assert not stray, f"packages outside the distribution's folders {where}: {sorted(stray)}"
    assert found == roots, f"not a root: {sorted(found - roots)}; no such package: {sorted(roots - found)}"
    contracts = linter["contracts"]
    order = next(c for c in contracts if c["type"] == "layers" and "containers" not in c)["layers"]
    placed = {name.strip() for layer in order for name in layer.split("|")}
    assert placed <= roots, f"no such root: {sorted(placed - roots)}"
    isolated = roots - placed
    assert isolated == {"weightsync_engine"}, f"not placed in the roots' layers: {sorted(isolated)}"
    forbidden = [(set(c["source_modules"]), set(c["forbidden_modules"])) for c in contracts if c["type"] == "forbidden"]
    for root in isolated:
        others = roots - {root}
        assert ({root}, others) in forbidden, f"{root} may import another root"
        assert (others, {root}) in forbidden, f"another root may import {root}"
