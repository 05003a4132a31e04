"""The command line, end to end in-process: plan, render, --help, errors."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from weightsync.api.load import load_groups
from weightsync.plan import Plan, plan_for
from weightsync_tools.cli.main import app

ROOT = Path(__file__).resolve().parents[3]
TCP = ROOT / "examples" / "tcp-group.yaml"
RDMA = ROOT / "examples" / "rdma-group.yaml"
runner = CliRunner()


def test_help_lists_every_command() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("crd", "validate", "plan", "render", "reference", "operator", "agent", "cluster"):
        assert command in result.output


def test_plan_json_is_the_planners_document() -> None:
    result = runner.invoke(app, ["plan", "-f", str(TCP), "--json"])
    assert result.exit_code == 0, result.output
    printed = Plan.from_json(result.stdout)
    (group,) = load_groups(TCP)
    assert printed == plan_for(group.spec, group="demo", namespace="default")


def test_plan_table_names_every_source_and_its_targets() -> None:
    result = runner.invoke(app, ["plan", "-f", str(RDMA)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "32 sources → 4 engines × TP8" in result.output
    assert "kimi-rl-trainer-3" in result.output
    assert "(balanced)" in result.output


def test_render_yaml_builds_every_object() -> None:
    result = runner.invoke(app, ["render", "-f", str(TCP)])
    assert result.exit_code == 0, result.output
    objects = list(yaml.safe_load_all(result.stdout))
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == [
        "ConfigMap", "NetworkPolicy", "NetworkPolicy", "Pod", "Pod", "Pod", "Pod", "Role", "RoleBinding", "Secret",
        "Service", "ServiceAccount",
    ]  # fmt: skip
    # The fence, and the mesh of its two trainer pods (their rendezvous and collectives; docs/workload-identity.md).
    policies = {o["metadata"]["name"] for o in objects if o["kind"] == "NetworkPolicy"}
    assert policies == {"demo-ingress", "demo-trainer-mesh"}
    # The group's credential is shown without a token: the operator makes one when it creates the Secret.
    (secret,) = [o for o in objects if o["kind"] == "Secret"]
    assert secret["metadata"]["name"] == "demo-credentials" and "data" not in secret
    pods = {o["metadata"]["name"] for o in objects if o["kind"] == "Pod"}
    assert pods == {"demo-trainer-0", "demo-trainer-1", "demo-engine-0-0", "demo-engine-1-0"}


def test_render_names() -> None:
    result = runner.invoke(app, ["render", "-f", str(RDMA), "-o", "name"])
    assert result.exit_code == 0
    assert "pod/kimi-rl-engine-3-0" in result.stdout.split()


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    result = runner.invoke(app, ["plan", "-f", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2
    assert "cannot read" in result.output


def test_file_without_a_group_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "cm.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    result = runner.invoke(app, ["plan", "-f", str(path)])
    assert result.exit_code == 2
    assert "no WeightSyncGroup found" in result.output


def test_unplannable_cap_is_refused(tmp_path: Path) -> None:
    obj = yaml.safe_load(RDMA.read_text())
    obj["spec"]["trainer"]["replicas"] = 1
    obj["spec"]["trainer"]["ranksPerPod"] = 2
    obj["spec"]["transfer"]["maxReplicaShapesPerSource"] = 1
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(obj))
    result = runner.invoke(app, ["plan", "-f", str(path)])
    assert result.exit_code == 2
    assert "cannot plan" in result.output and "at least 4" in result.output


def test_validate_accepts_the_examples_and_names_what_the_operator_would_refuse(tmp_path: Path) -> None:
    for kind in ("tcp", "rdma", "sglang", "vllm", "vllm-live", "vllm-broadcast"):
        example = f"{kind}-group.yaml"
        result = runner.invoke(app, ["validate", "-f", str(TCP.parent / example)])
        assert result.exit_code == 0 and ": valid" in result.output, (example, result.output)
    staged = tmp_path / "staged.yaml"
    example = (TCP.parent / "sglang-group.yaml").read_text()
    staged.write_text(example.replace("targetStaging: live", "targetStaging: staged"))
    result = runner.invoke(app, ["validate", "-f", str(staged)])
    assert result.exit_code == 2
    assert "AdapterLacksCapability" in result.output and "transfer.targetStaging 'staged'" in result.output
    broadcast_staged = tmp_path / "broadcast-staged.yaml"
    broadcast_staged.write_text(
        (TCP.parent / "vllm-broadcast-group.yaml").read_text().replace("targetStaging: live ", "targetStaging: staged")
    )
    result = runner.invoke(app, ["validate", "-f", str(broadcast_staged)])
    assert result.exit_code == 2
    assert "'staged' in transfer.mode 'broadcast' (it supports live)" in result.output


def _bomb(levels: int = 9) -> str:
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, levels):
        name, previous = chr(ord("a") + level), chr(ord("a") + level - 1)
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]")
    return "\n".join(lines) + "\n"


BAD_FILES: dict[str, tuple[bytes | None, str]] = {
    "missing": (None, "No such file or directory"),
    "not YAML": (b"spec: [\n", "not YAML: line 2, column 1: expected the node content"),
    "binary": (b"\x00\xff\xfe\x00binary", "not a text file (byte 1 is not UTF-8)"),
    "YAML bomb": (_bomb().encode(), "line 2, column 8: YAML aliases (*name) are not accepted"),
    "alias inside a template": (
        TCP.read_bytes().replace(b"template:", b"template: &t", 1) + b"x: *t\n",
        "YAML aliases (*name) are not accepted",
    ),
    "oversized": (b"# " + b"x" * (1024 * 1024) + b"\n", "more than 1024 KiB: too big for a WeightSyncGroup file"),
}


@pytest.mark.parametrize("command", ["validate", "plan", "render"])
@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_input_is_one_line_and_exit_code_2(tmp_path: Path, case: str, command: str) -> None:
    content, message = BAD_FILES[case]
    path = tmp_path / "group.yaml"
    if content is not None:
        path.write_bytes(content)
    started = time.monotonic()
    result = runner.invoke(app, [command, "-f", str(path)])
    assert time.monotonic() - started < 2
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1, result.output
    assert result.output.startswith(f"error: cannot read {path}: ") and message in result.output, result.output


def test_a_yaml_bomb_is_refused_by_a_real_process_within_2_s(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb(12))  # 9^11 strings if expanded
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "weightsync_tools.cli.main", "validate", "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert time.monotonic() - started < 2, "the refusal must not build the document"
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "YAML aliases (*name) are not accepted" in done.stderr, done.stderr
