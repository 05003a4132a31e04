"""What the vLLM broadcast adapter tells vLLM's nccl backend (pure): the join's ``init_info`` and each chunk's
``update_info``, as vLLM 0.32's ``NCCLWeightTransferInitInfo`` and ``NCCLWeightTransferUpdateInfo`` read them."""

from __future__ import annotations

import base64
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync_agent.targets.adapter import FullTensor
from weightsync_agent.targets.vllm.nccl_adapter import init_info_payload, update_info_payload
from weightsync_agent.transport.nccl_uid_group import rendezvous_of

UID = bytes(range(128))
TOLD = rendezvous_of(UID)


@given(offset=st.integers(1, 64), ranks=st.integers(1, 8), extra=st.integers(0, 64), shuffle=st.randoms())
def test_one_member_per_tp_rank_from_any_offset_in_any_order(
    offset: int, ranks: int, extra: int, shuffle: random.Random
) -> None:
    members = [{"group_rank": offset + r, "ranks": [r]} for r in range(ranks)]
    shuffle.shuffle(members)
    world = offset + ranks + extra
    payload = init_info_payload(TOLD, world, members, ranks)
    assert payload == {
        "nccl_unique_id_b64": base64.b64encode(UID).decode(),
        "rank_offset": offset,
        "world_size": world,
        "packed": False,
    }


@pytest.mark.parametrize(
    ("members", "ranks"),
    [
        ([{"group_rank": 1, "ranks": [0, 1]}], 2),  # one member for the whole engine: vLLM joins per rank
        ([{"group_rank": 1, "ranks": [0]}, {"group_rank": 3, "ranks": [1]}], 2),  # not consecutive
        ([{"group_rank": 1, "ranks": [1]}, {"group_rank": 2, "ranks": [0]}], 2),  # ranks out of order
        ([{"group_rank": 1, "ranks": [0]}], 2),  # a rank missing
    ],
)
def test_members_vllm_cannot_be_are_refused(members: list[dict[str, object]], ranks: int) -> None:
    with pytest.raises(ValueError, match="one group rank per TP rank"):
        init_info_payload(TOLD, 4, members, ranks)


def test_only_a_unique_id_rendezvous_is_accepted() -> None:
    with pytest.raises(ValueError, match="joins by an NCCL unique id"):
        init_info_payload("tcp://10.0.0.1:29500", 2, [{"group_rank": 1, "ranks": [0]}], 1)


def test_a_chunk_is_announced_in_broadcast_order() -> None:
    tensors = [FullTensor("b.weight", "bfloat16", (4, 2)), FullTensor("a.bias", "float32", (4,))]
    assert update_info_payload(tensors) == {
        "names": ["b.weight", "a.bias"],
        "dtype_names": ["bfloat16", "float32"],
        "shapes": [[4, 2], [4]],
    }
