"""Which way a stock SGLang server's ranks are synced, from its /server_info (targets/sglang/parallelism.py): the
trace for TP only, the engine replica with expert parallelism or DP attention, a refusal for what one engine cannot
be."""

from __future__ import annotations

from typing import Any

import pytest

from weightsync_agent.layout.manifest import ManifestError
from weightsync_agent.targets.sglang.parallelism import MAX_RANKS, Parallelism


@pytest.mark.parametrize(
    ("info", "want", "traced"),
    [
        ({}, Parallelism(1, 1, 1), True),
        ({"tp_size": 8, "ep_size": 1, "dp_size": 1, "enable_dp_attention": False}, Parallelism(8, 1, 1), True),
        ({"tp_size": 2, "ep_size": 2}, Parallelism(2, 2, 1), False),  # experts split by expert
        ({"tp_size": 8, "ep_size": 8, "dp_size": 8, "enable_dp_attention": True}, Parallelism(8, 8, 8), False),
        ({"tp_size": 4, "dp_size": 2, "enable_dp_attention": True}, Parallelism(4, 1, 2), False),
        ({"tp_size": 4, "dp_size": 1, "enable_dp_attention": True}, Parallelism(4, 1, 1), True),  # one DP group
        # SGLang 0.5.23's own /server_info of --tp 2 --dp-size 2 --enable-dp-attention (measured): attn_dp_size.
        (
            {"tp_size": 2, "dp_size": 1, "attn_dp_size": 2, "enable_dp_attention": True, "ep_size": 1},
            Parallelism(2, 1, 2),
            False,
        ),
        ({"tp_size": 2, "dp_size": 1, "attn_dp_size": 2, "enable_dp_attention": False}, Parallelism(2, 1, 1), True),
    ],
)
def test_tp_only_is_traced_and_expert_parallelism_or_dp_attention_goes_through_the_engine_replica(
    info: dict[str, Any], want: Parallelism, traced: bool
) -> None:
    got = Parallelism.of(info, "engine 0")
    assert got == want and got.traced is traced


@pytest.mark.parametrize(
    ("info", "says"),
    [
        ({"tp_size": 2, "dp_size": 2}, "data-parallel replicas in one server"),
        ({"tp_size": 4, "dp_size": 2, "attn_dp_size": 2, "enable_dp_attention": True}, "2 data-parallel replicas"),
        ({"tp_size": 6, "dp_size": 4, "enable_dp_attention": True}, "does not divide the TP size 6"),
        ({"tp_size": 4, "ep_size": 3}, "EP size 3 does not divide"),
        ({"tp_size": 0}, "tp_size is 0"),
        ({"tp_size": MAX_RANKS + 1}, f"not a size from 1 to {MAX_RANKS}"),
        ({"ep_size": "2"}, "ep_size is '2'"),
        ({"dp_size": True}, "dp_size is True"),
    ],
)
def test_what_one_engine_cannot_be_or_a_malformed_size_is_refused_by_name(info: dict[str, Any], says: str) -> None:
    with pytest.raises(ManifestError, match=says) as refused:
        Parallelism.of(info, "engine 3")
    assert str(refused.value).startswith("engine 3: ")


def test_it_says_what_the_server_runs() -> None:
    assert str(Parallelism(8, 8, 8)) == "TP 8, EP 8, DP attention 8" and str(Parallelism(2)) == "TP 2"
