"""replica_core on small torch modules (no engine): the layout the engines publish, the writes, and the comparison
of everything an engine reads (parameters, buffers, plain tensor attributes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from weightsync_engine import replica_core


class Attention(nn.Module):
    """A parameter, a buffer, and a tensor attribute derived from the parameter after load (as MLA's ``w_kc``)."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16))
        self.register_buffer("cos", torch.zeros(5))
        self.w_kc = torch.zeros(3, 4, dtype=torch.bfloat16)
        self.scale = 0.5  # not a tensor: not state

    def derive(self) -> None:
        self.w_kc = self.kv.data.t().contiguous()


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.norm = nn.Parameter(torch.ones(3))


def filled(seed: int) -> Model:
    model = Model()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator).to(param.dtype))
    model.attn.derive()
    return model


def test_the_layout_is_the_parameters_in_order_with_their_bytes() -> None:
    assert replica_core.loader_layout(Model()) == [  # named_parameters(): a module's own first
        {"name": "norm", "dtype": "float32", "shape": [3], "nbytes": 12},
        {"name": "attn.kv", "dtype": "bfloat16", "shape": [4, 3], "nbytes": 24},
    ]


def test_state_names_parameters_buffers_and_tensor_attributes() -> None:
    kinds = {(kind, name) for kind, name, _ in replica_core.state(torch, Model())}
    expected = {("parameter", "attn.kv"), ("parameter", "norm"), ("buffer", "attn.cos"), ("attribute", "attn.w_kc")}
    assert kinds == expected


def test_written_parameters_with_the_derivation_rerun_equal_the_reference() -> None:
    engine, replica = filled(1), filled(2)
    assert replica_core.write_parameters(torch, replica, engine) == []
    assert replica_core.differences(torch, engine, filled(2)) == ["attribute attn.w_kc: the bytes differ"]  # stale
    engine.attn.derive()  # the engine's end-of-session processing
    assert replica_core.differences(torch, engine, filled(2)) == []


def test_every_kind_of_difference_is_named() -> None:
    got, want = filled(3), filled(3)
    got.attn.cos[2] = 1.0
    got.norm.data[0] = float("nan")
    want.norm.data[0] = float("nan")  # the same NaN bytes: equal
    got.attn.w_kc = got.attn.w_kc.float()
    del want.attn.scale
    want.attn.extra = torch.zeros(1)
    assert replica_core.differences(torch, got, want) == [
        "buffer attn.cos: the bytes differ",
        "attribute attn.w_kc: torch.float32[3, 4] against torch.bfloat16[3, 4]",
        "attribute attn.extra: only in the reference",
    ]


def test_a_parameter_of_another_shape_or_missing_is_not_written() -> None:
    engine, replica = filled(4), filled(5)
    replica.norm = nn.Parameter(torch.ones(4))
    before = engine.norm.data.clone()
    assert replica_core.write_parameters(torch, replica, engine) == ["norm"]
    assert torch.equal(engine.norm.data, before)
    del replica.norm
    assert replica_core.write_parameters(torch, replica, engine) == ["norm"]


def test_packed_offsets_are_aligned_and_in_order() -> None:
    layout, size = replica_core.packed(
        [{"name": "a", "nbytes": 3}, {"name": "b", "nbytes": 64}, {"name": "c", "nbytes": 1}]
    )
    assert [e["offset"] for e in layout] == [0, 64, 128]
    assert size == 192


def test_a_bound_replica_is_loaded_straight_into_a_shared_file(tmp_path: Path) -> None:
    """The parameters become views of a file mapped shared: what the loader writes is in the file, for any other
    process that maps it (the source publishes from it)."""
    model = filled(6)
    kept = {name: param.data.clone() for name, param in model.named_parameters()}
    size = replica_core.packed(replica_core.loader_layout(model))[1]
    path = tmp_path / "replica"
    buffer = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
    layout = replica_core.bind(torch, model, buffer)
    assert all(torch.equal(param.data, kept[name]) for name, param in model.named_parameters())  # values kept
    with torch.no_grad():  # a loader writing into the parameters
        model.attn.kv.data[1:3].copy_(torch.full((2, 3), 7.0))
        model.norm.data.fill_(2.0)
    replica_core.check_bound(model, buffer, layout)
    mapped = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)  # as another process sees it
    for entry in layout:
        param = dict(model.named_parameters())[entry["name"]]
        held = mapped[entry["offset"] : entry["offset"] + entry["nbytes"]].view(param.dtype).view(param.shape)
        assert torch.equal(held, param.data), entry["name"]


def test_a_loader_that_replaces_a_parameters_tensor_is_refused_by_name() -> None:
    model = filled(7)
    buffer = torch.zeros(replica_core.packed(replica_core.loader_layout(model))[1], dtype=torch.uint8)
    layout = replica_core.bind(torch, model, buffer)
    model.norm.data = torch.ones(3)  # a new tensor: the buffer no longer holds what the engine loaded
    with pytest.raises(replica_core.ReplicaError, match=r"^norm: the loader replaced the parameter's tensor"):
        replica_core.check_bound(model, buffer, layout)
    with pytest.raises(replica_core.ReplicaError, match="holds 8 bytes"):
        replica_core.bind(torch, filled(8), torch.zeros(8, dtype=torch.uint8))


def test_a_parameter_the_loader_never_wrote_is_the_engines_own() -> None:
    """Filled with the sentinel before the load, a parameter whose bytes are all still the sentinel was written by
    no HF tensor: it is named, never written into the engine, and left out of the comparison."""
    replica, engine = filled(9), filled(10)
    buffer = torch.zeros(replica_core.packed(replica_core.loader_layout(replica))[1], dtype=torch.uint8)
    layout = replica_core.bind(torch, replica, buffer)
    buffer.fill_(replica_core.SENTINEL)
    with torch.no_grad():  # the load writes attn.kv only
        replica.attn.kv.data.copy_(filled(11).attn.kv.data)
    own = frozenset(replica_core.unwritten(buffer, layout))
    assert own == {"norm"}
    kept = engine.norm.data.clone()
    assert replica_core.write_parameters(torch, replica, engine, skip=own) == []
    assert torch.equal(engine.norm.data, kept)
    engine.attn.derive()
    want = filled(11)
    assert replica_core.differences(torch, engine, want, ignore=own) == []
    assert replica_core.differences(torch, engine, want) == ["parameter norm: the bytes differ"]


def test_feeds_group_by_decoder_layer_in_the_order_their_first_feed_comes_and_the_rest_goes_last() -> None:
    names = [
        "lm_head.weight",
        "model.layers.1.mlp.experts.0.up_proj.weight",
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.10.mlp.gate.weight",
        "model.embed_tokens.weight",
        "transformer.h.3.attn.c_attn.weight",
        "model.norm.weight",
    ]
    assert replica_core.layer_groups(names) == [[1, 3], [2], [4], [6], [0, 5, 7]]
    assert replica_core.layer_groups(["model.norm.weight"]) == [[0]]
    assert replica_core.layer_groups([]) == []
