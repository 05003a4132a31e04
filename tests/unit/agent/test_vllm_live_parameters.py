"""The plugin's live placement, pure: which parameters can take one-sided writes in place, what is published for
them and what is registered (weightsync_engine/vllm/live_parameters.py; docs/engines/vllm.md, "Live p2p rounds")."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from weightsync_engine.vllm.live_parameters import PlacementRefusedError, Span, live_parameters


def named(**tensors: torch.Tensor) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name.replace("__", "."), torch.nn.Parameter(t, requires_grad=False)) for name, t in tensors.items()]


def test_plain_parameters_are_published_as_pointer_count_and_element_size() -> None:
    block = torch.zeros(100, dtype=torch.bfloat16)
    qkv, norm = block[:64].view(8, 8), block[64:80]
    live = live_parameters(named(model__qkv=qkv, model__norm=norm), quantization=None)
    assert live.device == "cpu"
    assert live.weights_info() == {"model.qkv": [qkv.data_ptr(), 64, 2], "model.norm": [norm.data_ptr(), 16, 2]}
    assert live.spans() == [Span(block.data_ptr(), 80 * 2)]  # adjacent parameters: one registration


def test_a_quantized_model_is_refused_before_anything_is_looked_at() -> None:
    with pytest.raises(PlacementRefusedError, match=r"quantized \(fp8\).*targetStaging: staged"):
        live_parameters(named(w=torch.zeros(4)), quantization="fp8")


@pytest.mark.parametrize(
    ("tensor", "why"),
    [
        (torch.empty(0), "is empty (repacked after loading"),
        (torch.zeros(4, 6).t(), "is not contiguous (stride [1, 6])"),
        (torch.empty(4, 4, device="meta"), "is on the meta device"),
    ],
    ids=["repacked", "strided", "meta"],
)
def test_parameters_that_cannot_take_writes_in_place_are_named_with_why(tensor: torch.Tensor, why: str) -> None:
    with pytest.raises(PlacementRefusedError) as refused:
        live_parameters(named(fine=torch.zeros(3), model__bad=tensor), quantization=None)
    message = str(refused.value)
    assert message.startswith("1 parameter(s) cannot be written in place: model.bad ") and why in message
    assert "fine" not in message and message.endswith("(targetStaging: staged)")


def test_a_long_refusal_names_five_and_counts_the_rest() -> None:
    bad = {f"w{i}": torch.empty(0) for i in range(8)}
    with pytest.raises(PlacementRefusedError, match=r"^8 parameter\(s\).*w4 is empty.*\(and 3 more\)") as refused:
        live_parameters(named(**bad), quantization=None)
    assert "w5" not in str(refused.value)


def test_no_parameters_is_refused() -> None:
    with pytest.raises(PlacementRefusedError, match="no parameters"):
        live_parameters([], quantization=None)


@given(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 50)), min_size=1, max_size=12))
def test_spans_cover_every_parameter_exactly_and_never_touch_each_other(places: list[tuple[int, int]]) -> None:
    """Parameters as views of one arena at arbitrary (possibly overlapping) places: the spans cover every byte of
    every parameter, nothing outside their union, and are disjoint and not adjacent (else they would be one)."""
    arena = torch.zeros(300, dtype=torch.float32)
    params = [(f"p{i}", torch.nn.Parameter(arena[start : start + length], requires_grad=False))
              for i, (start, length) in enumerate(places)]  # fmt: skip
    spans = live_parameters(params, quantization=None).spans()
    base = arena.data_ptr()
    covered = {(s.address - base) // 4 + k for s in spans for k in range(s.nbytes // 4)}
    wanted = {start + k for start, length in places for k in range(length)}
    assert covered == wanted
    ends = [(s.address, s.address + s.nbytes) for s in spans]
    assert all(a_end < b_start for (_, a_end), (b_start, _) in itertools.pairwise(ends))


def test_parameters_replaced_since_they_were_published_are_named() -> None:
    qkv, norm = torch.zeros(8, 8), torch.zeros(8)
    model = named(qkv=qkv, norm=norm)
    live = live_parameters(model, quantization=None)
    assert live.moved(model) == []
    model[1][1].data = torch.zeros(8)  # a reload or an offload gave the parameter new storage
    assert live.moved(model) == ["norm"]
    assert live.moved(model[:1]) == ["norm"]  # a parameter gone
