"""``weightsync simulate`` through typer's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from weightsync_tools.cli.main import app

runner = CliRunner()


def test_json_for_a_preset_has_the_published_configuration() -> None:
    result = runner.invoke(app, ["simulate", "--preset", "kimi-k2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["broadcast_s"] > data["p2p_s"] > data["ours_s"] > 0
    assert data["published"] == {
        "broadcast_s": 53.2791,
        "p2p_s": 7.2273,
        "source": "radixark/miles docs/advanced/p2p-weight-transfer.md (notes §1.10)",
    }
    assert abs(data["relative_error"]["broadcast"]) <= 0.25
    assert data["geometry"]["engines"] == 8
    assert "engine lock-step" in data["broadcast"]["phases"]
    assert data["hardware"]["nic_gbps"] == 400.0


def test_table_lists_every_preset_and_overrides_apply() -> None:
    result = runner.invoke(app, ["simulate"], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    for preset in ("kimi-k2", "glm-5", "qwen3-235b"):
        assert preset in result.output
    slow = runner.invoke(app, ["simulate", "--preset", "qwen3-235b", "--json", "--nic-gbps", "100"])
    fast = runner.invoke(app, ["simulate", "--preset", "qwen3-235b", "--json", "--set", "nic_gbps=800"])
    assert json.loads(slow.stdout)["p2p_s"] > json.loads(fast.stdout)["p2p_s"]
    scaled = json.loads(runner.invoke(app, ["simulate", "--preset", "glm-5", "--json", "--scale", "2"]).stdout)
    assert scaled["scale"] == 2 and "published" not in scaled


def test_bad_input_exits_2() -> None:
    assert runner.invoke(app, ["simulate", "--preset", "gpt-9"]).exit_code == 2
    assert runner.invoke(app, ["simulate", "--set", "nic_gbps"]).exit_code == 2
    assert runner.invoke(app, ["simulate", "--set", "nic_gbps=fast"]).exit_code == 2
    assert runner.invoke(app, ["simulate", "--set", "nic_gbps=0"]).exit_code == 2


def test_plot_writes_a_small_png(tmp_path: Path) -> None:
    path = tmp_path / "sim.png"
    result = runner.invoke(app, ["simulate", "--preset", "qwen3-235b", "--json", "--plot", str(path)])
    assert result.exit_code == 0, result.output
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size < 200_000


def test_testbed_json_is_the_prediction_next_to_the_measurement() -> None:
    from weightsync_tools.simulate.testbed import TESTBED_RUNS

    result = runner.invoke(app, ["simulate", "--testbed", "A", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["fitted"] is True and data["layout"] == {"trainers": 4, "engines": 2, "tp": 2}
    expected = TESTBED_RUNS["A"].predict().to_dict()
    assert data["modelled"] == expected
    assert set(data["measured"]) == {"broadcast_s", "p2p_s"} == set(data["relative_error"])
    assert all(abs(e) <= 0.15 for e in data["relative_error"].values())
    assert data["hardware"]["collective"] == "binomial"


def test_testbed_table_says_b_is_a_prediction_and_unknown_names_exit_2() -> None:
    result = runner.invoke(app, ["simulate", "--testbed", "B"], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "prediction" in result.output and "Miles-style" in result.output
    assert runner.invoke(app, ["simulate", "--testbed", "C"]).exit_code == 2
