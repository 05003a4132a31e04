"""Real trainers through real agents: a 2-process FSDP2 trainer (CPU, gloo; examples/trainers/fsdp2_train.py) trains
and syncs two versions into reference engines (TP=2) through the agents and Mooncake TCP; a Megatron-style
tensor-parallel module's converter (examples/trainers/megatron_style_tp.py) gives the engines' HF tensors.

Checked: every engine holds the trained, unsharded weights bit for bit (per-bucket checksums of an independent
resharding) and computes the same logits as the unsharded model; the weights did move in training; and the
helper's extra memory stays within the largest parameter made whole (plus what the converter makes of it),
far below the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sync_helpers import group_spec
from test_agents import assert_engines_hold

from weightsync.api import names
from weightsync.ports import free_port
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.reference_engine.model import full_state

ROOT = Path(__file__).resolve().parents[2]
FSDP2_EXAMPLE = ROOT / "examples" / "trainers" / "fsdp2_train.py"
MEGATRON_EXAMPLE = ROOT / "examples" / "trainers" / "megatron_style_tp.py"
PYTHONPATH = os.pathsep.join(str(ROOT / p) for p in ("", "agent", "operator"))


@pytest.fixture
def group() -> Iterator[LoopbackGroup]:
    spec = group_spec(mode="p2p", protocol="tcp", bucketSizeMiB=1, timeoutSeconds=60, targetStaging="live")
    with LoopbackGroup(spec, group="fsdp2").start() as running:
        yield running


def trainer_env(group: LoopbackGroup, rank: int, world: int, port: int) -> dict[str, str]:
    """Trainer rank ``rank``'s environment: its pod's (without the group's credential: trainer code never holds
    it), plus what torchrun sets."""
    pod = {
        k: v for k, v in group.agent_env(rank).items() if k not in (names.ENV_GROUP_TOKEN, names.ENV_CREDENTIALS_DIR)
    }
    dist = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
    return {**os.environ, **pod, **dist, "PYTHONPATH": PYTHONPATH}


def run_ranks(script: Path, envs: list[dict[str, str]], *args: str, timeout: float = 420) -> list[list[dict[str, Any]]]:
    """Run ``script`` once per rank at the same time; every rank's JSON lines (each must exit 0)."""
    procs = [subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for env in envs]  # fmt: skip
    outputs = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{err[-4000:]}"
            outputs.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return outputs


@pytest.mark.parametrize("stream", [False, True], ids=["stage-then-publish", "streamed"])
def test_an_fsdp2_trainer_syncs_its_trained_weights_through_real_agents(
    group: LoopbackGroup, tmp_path: Path, stream: bool
) -> None:
    port = free_port()
    envs = [trainer_env(group, rank, 2, port) for rank in range(2)]
    saved = tmp_path / "trained.pt"
    extra = ["--stream"] if stream else []
    reports = run_ranks(FSDP2_EXAMPLE, envs, "--steps", "2", "--save", str(saved), *extra)

    for rank, lines in enumerate(reports):
        assert [line["version"] for line in lines] == [1, 2], lines
        for line in lines:
            assert line["ok"], line
            if not stream:  # the outcome names the round's slowest target, for the training log
                assert "slowest target engine " in line["summary"] and "engines paused" in line["summary"], line
            assert line["parameters"] == len(full_state(0)) and line["staged"] > 0, line
            # One parameter made whole at a time: the helper never holds more than the largest one.
            assert line["peak_bytes"] <= line["largest_parameter_bytes"], line
            assert line["peak_bytes"] * 4 < line["model_bytes"], line
        print(f"\nrank {rank}: peak {lines[-1]['peak_bytes']} B of a {lines[-1]['model_bytes']} B model, "
              f"staged {lines[-1]['staged_bytes']} B in {lines[-1]['seconds']} s")  # fmt: skip

    trained: dict[str, torch.Tensor] = torch.load(saved)
    initial = full_state(0)
    assert any(not torch.equal(trained[name], initial[name]) for name in initial), "training changed nothing"
    assert_engines_hold(group, trained, 2)


def test_a_megatron_style_tp_converter_gives_the_engines_the_unsharded_hf_tensors(tmp_path: Path) -> None:
    """Two TP ranks (gloo) each hold Megatron-style shards (fused, interleaved QKV per rank; column- and
    row-parallel linears); the example's converter gathers them over the TP group and names them as HF does.
    Every rank's converted tensors equal the unsharded HF state the shards were cut from."""
    port = free_port()
    envs = [{**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
             "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"} for r in range(2)]  # fmt: skip
    outputs = run_ranks(MEGATRON_EXAMPLE, envs, "--check", "--seed", "7", timeout=180)
    for rank, lines in enumerate(outputs):
        (line,) = lines
        assert line["rank"] == rank and line["equal"] == line["expected"] == len(full_state(7)), line
        # A shard, plus the HF tensors the converter makes of it (TP=2: twice the shard), never the model (in
        # this 2-layer model one layer's MLP is already a tenth of it).
        assert line["peak_bytes"] <= 3 * line["largest_parameter_bytes"], line
        assert line["peak_bytes"] * 3 < line["model_bytes"], line
