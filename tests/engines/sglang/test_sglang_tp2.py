"""A TP=2 stock SGLang server (tiny Qwen3) starts on CPU, publishes one Mooncake session per rank with the
rank's shards, used all three workarounds in both ranks, and generates what HF computes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sglang_helpers import expected_numels, generate, start, transfer_info

from weightsync_testing import sglang_cpu
from weightsync_testing.server_process import retire
from weightsync_testing.sglang_models import hf_greedy
from weightsync_testing.sglang_server import SglangProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp2(sglang_py: Path, tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SglangProcess]:
    proc = start(sglang_py, tiny_qwen3, tmp_path_factory.mktemp("sglang-tp2"), tp=2)
    try:
        yield proc
    finally:
        retire(proc.stop)


def test_tp2_publishes_two_sessions_with_rank_shards(tp2: SglangProcess, tiny_qwen3: Path) -> None:
    sessions = []
    for rank in (0, 1):
        session, weights = transfer_info(tp2, rank)
        sessions.append(session)
        assert {name: numel for name, (_p, numel, _s) in weights.items()} == expected_numels(tiny_qwen3, 2)
    assert len(set(sessions)) == 2
    assert tp2.request("GET", "/remote_instance_transfer_engine_info?rank=2")[0] == 400
    status, answer = tp2.request("POST", "/weights_checker", {"action": "checksum"})
    assert status == 200 and answer["success"] is True, answer
    ranks = sorted(info["tp_rank"] for r in answer["ranks"] for info in r["parallelism_info"])
    assert ranks == [0, 1]


def test_tp2_used_all_three_workarounds_in_both_ranks(tp2: SglangProcess) -> None:
    assert tp2.workarounds == [
        sglang_cpu.ROTARY_VLLM_PLACEHOLDER,
        sglang_cpu.REGISTER_PER_PARAMETER,
        sglang_cpu.NO_PYNCCL,
    ]
    used = {(e["workaround"], e["pid"]) for e in tp2.workaround_events() if e["event"] == "used"}
    pids = {pid for _name, pid in used}
    assert len(pids) == 2, used
    assert used == {(name, pid) for name in tp2.workarounds for pid in pids}


def test_tp2_greedy_generate_equals_hf(tp2: SglangProcess, sglang_py: Path, tiny_qwen3: Path) -> None:
    prompts = [[1, 5, 9, 100, 200], [1, 77]]
    served = generate(tp2, prompts, 8)
    expected = hf_greedy(sglang_py, tiny_qwen3, prompts, 8)
    assert [a["output_ids"] for a in served] == [e["output_ids"] for e in expected]
