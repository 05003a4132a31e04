"""The shard-map trace of stock SGLang (weightsync_engine/sglang/trace_model.py; docs/engines/sglang-trace.md).

Runs the trace the way the adapter does (the script, with the SGLang venv's python) on the tiny Llama and Qwen3 at
TP 1, 2 and 4, and checks it three ways: every parameter of the rank is traced and none refused; the parts equal a
hand-written layout of the tiny models (qkv = q rows, k rows, v rows of this rank; gate ‖ up; o/down column shards;
norms whole; embed/lm_head vocab rows); and a differential check inside the SGLang venv: a bf16 replica loaded by
SGLang's own loader from random HF tensors is bit-identical to plain ``narrow``/``cat`` assembly from the parts.
The two manifest extensions are traced and checked the same way: vocab padding on the last rank (trailing rows the
loader zero-fills) and Qwen3-MoE's fused 3-D experts (parts placed at a leading index ``at``). Refusals: a parameter
no HF tensor writes, and on a synthetic replica every kind of load that is not a block copy. The trace's output
also goes through ``manifest.assemble``, its consumer.

The tests vLLM's trace passes too are ``TestSglangTrace``'s, from ``tests/engines/trace_shared.py``; this module
holds SGLang's side of them (:data:`SGLANG`, the fixtures, the hand-written layout) and the tests of SGLang alone.

The SGLang venv is built once (cached); these tests skip only when it cannot be built because the package index is
unreachable, and ``WEIGHTSYNC_REQUIRE_SGLANG=1`` turns that skip into a failure.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from trace_shared import (
    CASES,
    HIDDEN,
    SharedTraceTests,
    TraceEngine,
    Traces,
    TraceServer,
    columns,
    layer_norms,
    part,
    rows,
    whole,
)

from weightsync_agent.targets.sglang.manifest import assemble
from weightsync_testing.sglang_models import ensure_tiny_model

# The tiny models (weightsync_testing.sglang_models.SHAPE): vocab 512, hidden 128, 2 layers, 8 heads / 4 KV heads,
# head_dim 16, MLP 256.
VOCAB, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP = 512, 2, 8, 4, 16, 256


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def tiny(sglang_py: Path) -> dict[str, Path]:
    return {arch: ensure_tiny_model(sglang_py, arch, seed=0, dtype="float32") for arch in ("llama", "qwen3")}


@pytest.fixture(scope="session")
def engine_side(sglang_py: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine-venv helper script (models for the refusal cases, the differential check)."""
    return SGLANG.write_engine_side(tmp_path_factory, ENGINE_SIDE)


@pytest.fixture(scope="session")
def server(sglang_py: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TraceServer]:
    """The trace CLI's ``--serve`` mode in the SGLang venv: SGLang imported once for every trace of the session."""
    running = TraceServer("sglang", sglang_py, tmp_path_factory.mktemp("sglang-trace-server") / "stderr.log")
    yield running
    running.close()


@pytest.fixture(scope="session")
def traces(server: TraceServer, tiny: dict[str, Path]) -> Traces:
    """Every (arch, tp, rank) of CASES traced, bfloat16 (cached for the session)."""
    out: Traces = {}
    for arch, model in tiny.items():
        for tp, rank in CASES:
            out[arch, tp, rank] = trace(server, model, tp, rank, "bfloat16")
    return out


@pytest.fixture(scope="session")
def derived(
    sglang_py: Path, engine_side: Path, tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Models for the refusal cases: vocab 500 (padding at TP 2), a checkpoint missing one norm, a tiny Qwen3-MoE."""
    root = tmp_path_factory.mktemp("trace-models")
    out = {"vocab500": root / "vocab500", "missing": root / "missing", "moe": root / "moe", "moe4": root / "moe4"}
    SGLANG.run_helper(sglang_py, engine_side, "derive", str(tiny["llama"]), str(out["vocab500"]), "--vocab", "500")
    drop = "model.layers.1.post_attention_layernorm.weight"
    SGLANG.run_helper(sglang_py, engine_side, "derive", str(tiny["llama"]), str(out["missing"]), "--drop", drop)
    SGLANG.run_helper(sglang_py, engine_side, "moe", str(out["moe"]))
    SGLANG.run_helper(sglang_py, engine_side, "glm4moe", str(out["moe4"]))
    return out


@pytest.fixture
def vocab500(server: TraceServer, derived: dict[str, Path]) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """The vocab-500 model and its TP 2 traces of rank 0 and rank 1."""
    model = derived["vocab500"]
    return model, trace(server, model, 2, 0, "bfloat16"), trace(server, model, 2, 1, "bfloat16")


# ---------------------------------------------------------------- running things


def trace(runner: TraceServer | Path, model: Path, tp: int, rank: int, dtype: str, *extra: str) -> dict[str, Any]:
    """One trace, by the session's trace server or (given the venv's python) the CLI, as the adapter runs it."""
    started = time.monotonic()
    args = ("--model", str(model), "--tp", str(tp), "--rank", str(rank), "--dtype", dtype, *extra)
    done = runner.run(*args) if isinstance(runner, TraceServer) else SGLANG.run_trace(runner, *args)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr  # SGLang's own output stays out of the way on success
    result: dict[str, Any] = json.loads(done.stdout)
    wall = time.monotonic() - started
    SGLANG.timings[f"{model.name} TP{tp} r{rank}"] = {"wall": round(wall, 2), **result["seconds"]}
    print(f"\ntrace {model.name} TP{tp} r{rank}: {wall:.1f} s wall, {result['seconds']}", file=sys.stderr)
    return result


# ---------------------------------------------------------------- the hand-written layout


def expected_layout(arch: str, tp: int, rank: int) -> dict[str, dict[str, Any]]:
    """``{name: {"shape", "cat_dim", "parts"}}`` of the tiny models, written out by hand, in SGLang's order."""
    q_rows, kv_rows, mlp = HEADS * HEAD_DIM // tp, KV_HEADS * HEAD_DIM // tp, MLP // tp
    vocab = VOCAB // tp  # 512 is a multiple of 64 (SGLang's vocab padding) times every tp here: no padding
    out = {"model.embed_tokens.weight": rows("model.embed_tokens.weight", [VOCAB, HIDDEN], vocab, rank)}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        if arch == "qwen3":
            out[p + "self_attn.q_norm.weight"] = whole(p + "self_attn.q_norm.weight", [HEAD_DIM])
            out[p + "self_attn.k_norm.weight"] = whole(p + "self_attn.k_norm.weight", [HEAD_DIM])
        out[p + "self_attn.qkv_proj.weight"] = {
            "shape": [q_rows + 2 * kv_rows, HIDDEN],
            "cat_dim": 0,
            "parts": [
                part(p + "self_attn.q_proj.weight", [HEADS * HEAD_DIM, HIDDEN], 0, rank * q_rows, q_rows),
                part(p + "self_attn.k_proj.weight", [KV_HEADS * HEAD_DIM, HIDDEN], 0, rank * kv_rows, kv_rows),
                part(p + "self_attn.v_proj.weight", [KV_HEADS * HEAD_DIM, HIDDEN], 0, rank * kv_rows, kv_rows),
            ],
        }
        o_full = [HIDDEN, HEADS * HEAD_DIM]
        out[p + "self_attn.o_proj.weight"] = columns(p + "self_attn.o_proj.weight", o_full, q_rows, tp, rank)
        out[p + "mlp.gate_up_proj.weight"] = {
            "shape": [2 * mlp, HIDDEN],
            "cat_dim": 0,
            "parts": [
                part(p + "mlp.gate_proj.weight", [MLP, HIDDEN], 0, rank * mlp, mlp),
                part(p + "mlp.up_proj.weight", [MLP, HIDDEN], 0, rank * mlp, mlp),
            ],
        }
        out[p + "mlp.down_proj.weight"] = columns(p + "mlp.down_proj.weight", [HIDDEN, MLP], mlp, tp, rank)
        out.update(layer_norms(p))
    out["model.norm.weight"] = whole("model.norm.weight", [HIDDEN])
    out["lm_head.weight"] = rows("lm_head.weight", [VOCAB, HIDDEN], vocab, rank)
    return out


# ---------------------------------------------------------------- the tests both engines pass

SGLANG = TraceEngine(
    name="sglang",
    python="sglang_py",
    version="0.5.23",
    archs=("llama", "qwen3"),
    expected_layout=expected_layout,
    ordered=True,
    layers=None,
    loaded={"loader": "DefaultModelLoader.load_weights_and_postprocess"},
    workarounds=frozenset({"fake_parallel_groups", "vllm_custom_ops_placeholder"}),
    groups=lambda tp, rank: {"tp_group": [rank, tp], "world_group": [rank, tp]},
    groups_read=lambda arch: {"tp_group", "pp_group"},
    layered=("vllm_custom_ops_placeholder",),  # this machine has no GPU: the gate opens
    failure_note=None,
    assemble=lambda rank, trace, weights_info: assemble(0, rank, trace, "127.0.0.1:1234", weights_info, device="cpu"),
)


class TestSglangTrace(SharedTraceTests):
    engine = SGLANG


# ---------------------------------------------------------------- tests of SGLang alone


def test_auto_dtype_resolves_as_sglang_does(sglang_py: Path, server: TraceServer, tiny: dict[str, Path]) -> None:
    """``--dtype auto`` on a float32 checkpoint is float16 in SGLang's ModelConfig (not float32, not bfloat16).
    The CLI, as the adapter runs it, prints what ``--serve`` answers (all but the times): each served trace runs
    in a fresh fork of the imported engine, its workarounds applied and used again."""
    cli = trace(sglang_py, tiny["qwen3"], 2, 1, "auto")
    assert cli["dtype"] == "float16"
    assert {t["dtype"] for t in cli["tensors"]} == {"float16"}
    assert cli["refused"] == []
    served = trace(server, tiny["qwen3"], 2, 1, "auto")
    assert {**served, "seconds": None} == {**cli, "seconds": None}
    assert served["seconds"]["import"] < 1.0  # imported once, before the fork


def test_the_trace_server_refuses_bad_requests_and_goes_on(server: TraceServer, tiny: dict[str, Path]) -> None:
    """A bad request to ``--serve`` is one stderr line and exit 2, as on the CLI; the next request is traced."""
    for args in (("--tp", "x"), ("--model", "m", "--tp", "2", "--rank", "2")):
        done = server.run(*args)
        assert done.returncode == 2 and done.stdout == "" and done.stderr.startswith("trace_model: "), done
    assert trace(server, tiny["qwen3"], 1, 0, "bfloat16")["refused"] == []


def test_the_consumer_assembles_a_manifest_from_the_trace(traces: Traces) -> None:
    built = SGLANG.manifest(1, traces["qwen3", 2, 1])
    qkv = built.by_name()["model.layers.0.self_attn.qkv_proj.weight"]
    assert [(p.source.split(".")[-2], p.start, p.length) for p in qkv.parts] == [
        ("q_proj", 64, 64),
        ("k_proj", 32, 32),
        ("v_proj", 32, 32),
    ]
    assert built.checksum == "tensor-sha256-8"


def test_a_parameter_no_hf_tensor_writes_is_refused(server: TraceServer, derived: dict[str, Path]) -> None:
    result = trace(server, derived["missing"], 1, 0, "bfloat16", "--full-layers")
    assert result["refused"] == [
        {"name": "model.layers.1.post_attention_layernorm.weight", "reason": "no HF tensor in the checkpoint writes it"}
    ]
    assert len(result["tensors"]) == len(expected_layout("llama", 1, 0)) - 1


MOE_EXPERTS, MOE_MLP = 4, 64


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fused_moe_experts_are_traced(
    sglang_py: Path, server: TraceServer, engine_side: Path, derived: dict[str, Path], tmp_path: Path, tp: int
) -> None:
    """Qwen3-MoE: expert e's 2-D gate/up/down HF tensors land in ``param[e]`` of 3-D ``[E, rows, cols]`` parameters
    (SGLang's FusedMoE): parts with ``at = (e,)``, gate ‖ up along dim 1 of w13, down's column shard along dim 2 of
    w2. Every parameter is traced, and SGLang's own load equals the assembly on every rank."""
    traced = {(tp, rank): trace(server, derived["moe"], tp, rank, "bfloat16") for rank in range(tp)}
    mlp, layer = MOE_MLP // tp, "model.layers.0.mlp."
    for (_, rank), result in traced.items():
        assert result["refused"] == [], result["refused"]
        got = {t["name"]: t for t in result["tensors"]}
        w13, w2 = got[layer + "experts.w13_weight"], got[layer + "experts.w2_weight"]
        assert (w13["shape"], w13["cat_dim"]) == ([MOE_EXPERTS, 2 * mlp, HIDDEN], 1)
        assert w13["parts"] == [
            part(f"{layer}experts.{e}.{proj}.weight", [MOE_MLP, HIDDEN], 0, rank * mlp, mlp, at=(e,))
            for e in range(MOE_EXPERTS)
            for proj in ("gate_proj", "up_proj")
        ]
        down = [f"{layer}experts.{e}.down_proj.weight" for e in range(MOE_EXPERTS)]
        if tp == 1:  # whole tensors: nothing sliced, so the trace concatenates along the first dim it can
            assert (w2["shape"], w2["cat_dim"]) == ([MOE_EXPERTS, HIDDEN, MOE_MLP], 1)
            assert w2["parts"] == [part(d, [HIDDEN, MOE_MLP], 0, 0, HIDDEN, at=(e,)) for e, d in enumerate(down)]
        else:
            assert (w2["shape"], w2["cat_dim"]) == ([MOE_EXPERTS, HIDDEN, mlp], 2)
            assert w2["parts"] == [part(d, [HIDDEN, MOE_MLP], 1, rank * mlp, mlp, at=(e,)) for e, d in enumerate(down)]
        assert got[layer + "gate.weight"]["parts"] == [part(layer + "gate.weight", [MOE_EXPERTS, HIDDEN], 0, 0, 4)]
        assert SGLANG.manifest(rank, result).by_name()[layer + "experts.w13_weight"].lead == 1
    SGLANG.differential(sglang_py, engine_side, derived["moe"], traced, tmp_path)


def test_a_layer_reduced_trace_equals_the_full_one(server: TraceServer, derived: dict[str, Path]) -> None:
    """GLM-4-MoE with 4 layers, the first dense and the rest MoE: the trace builds and traces the first 2 (one of each
    kind, alike in the checkpoint and in the engine's full layout, built on the meta device), moves layer 1's map to
    layers 2 and 3, and the result equals tracing all 4 layers."""
    reduced = trace(server, derived["moe4"], 2, 1, "bfloat16")
    full = trace(server, derived["moe4"], 2, 1, "bfloat16", "--full-layers")
    assert reduced["layers"] == {"total": 4, "traced": 2, "representative": {"2": 1, "3": 1}}
    assert full["layers"] == {"total": 4, "traced": 4, "representative": {}}
    assert reduced["refused"] == full["refused"] == []
    assert reduced["unused_sources"] == full["unused_sources"] == []
    assert reduced["tensors"] == full["tensors"]
    names = {t["name"] for t in reduced["tensors"]}
    assert "model.layers.3.mlp.experts.w13_weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names


# ---------------------------------------------------------------- refusals on a synthetic replica (no SGLang)


def load_trace_module() -> Any:
    return importlib.import_module("weightsync_engine.sglang.trace_model")


def synthetic_trace() -> tuple[list[dict[str, Any]], dict[str, str], list[str]]:
    """A replica whose ``load_weights`` does each thing the trace must accept or refuse, traced with the same code
    (``trace_replica``) that traces SGLang's model; torch only, so it runs in the project venv."""
    torch = pytest.importorskip("torch")
    tm = load_trace_module()
    sources = {
        "a": (4, 6), "b": (4, 2), "c": (8, 3), "t": (4, 6), "i": (8, 4), "n": (4,), "g": (4,), "r": (4,),
        "p": (3, 4), "o1": (2, 2), "o2": (2, 2), "e0": (2, 3), "e1": (2, 3), "skip": (2,), "tied": (2, 2),
        "rep": (2,), "h": (3, 4), "k": (3, 4), "kv": (4, 2),
    }  # fmt: skip
    params = {
        "ab": (4, 8), "c": (4, 3), "t": (6, 4), "i": (8, 4), "n": (4,), "g": (4,), "r": (4,), "p": (4, 4),
        "o": (2, 2), "e": (2, 2, 3), "u": (3,), "t1": (2, 2), "t2": (2, 2), "rep": (2,), "h": (4, 4), "k": (4, 4),
        "kv": (4, 2),
    }  # fmt: skip

    def copy(name: str, index: Any = slice(None)) -> Any:
        return lambda m, x: getattr(m, name).data[index].copy_(x)

    loaders = {
        "a": copy("ab", (slice(None), slice(0, 6))),  # a ‖ b along dim 1
        "b": copy("ab", (slice(None), slice(6, 8))),
        "c": lambda m, x: m.c.data.copy_(x[4:8]),  # a row shard
        "t": lambda m, x: m.t.data.copy_(x.t()),  # a transpose
        "i": lambda m, x: m.i.data.copy_(torch.cat([x[0::2], x[1::2]])),  # an interleave
        "n": lambda m, x: (m.n.data.copy_(x), m.nb.copy_(x + 1)),  # a buffer derived at load time
        "g": lambda m, x: m.g.data.copy_(x + 1),  # a load-time offset (Gemma-style)
        "r": lambda m, x: m.r.data.copy_(x.round_()),  # in place; exact on integer codes, not on real values
        "p": lambda m, x: (m.p.data[:3].copy_(x), m.p.data[3:].fill_(0)),  # padding rows, zero-filled
        "h": lambda m, x: (m.h.data[1:].copy_(x), m.h.data[:1].fill_(0)),  # zero-filled rows first: not padding
        "k": lambda m, x: m.k.data[:3].copy_(x),  # trailing rows left as they were: unknown values
        # MLA-style: a plain tensor attribute derived from a parameter at load time (DeepSeek's w_kc)
        "kv": lambda m, x: (m.kv.data.copy_(x), setattr(m, "w_kc", m.kv.data.t().contiguous())),
        "o1": copy("o"),  # two HF tensors onto the same elements
        "o2": copy("o"),
        "e0": copy("e", 0),  # 2-D blocks into a 3-D parameter
        "e1": copy("e", 1),
        "skip": lambda m, x: None,  # an HF tensor the model ignores
        "tied": lambda m, x: (m.t1.data.copy_(x), m.t2.data.copy_(x)),  # one HF tensor, two parameters
        "rep": lambda m, x: setattr(m.rep, "data", x.clone()),  # re-allocates the parameter's storage
    }

    module: Any = torch.nn.Module

    class Replica(module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            for name, shape in params.items():
                self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape), requires_grad=False))
            self.register_buffer("nb", torch.ones(4), persistent=False)

        def load_weights(self, weights: Any) -> None:
            for name, tensor in weights:
                loaders[name](self, tensor)

    layout = {name: ("bfloat16", list(shape), True) for name, shape in params.items()}
    tensors, refused, unused = tm.trace_replica(torch, Replica(), sources, layout)
    return tensors, {r["name"]: r["reason"] for r in refused}, unused


def test_synthetic_replica_accepts_block_copies_only() -> None:
    tensors, refused, unused = synthetic_trace()
    got = {t["name"]: t for t in tensors}
    assert list(got) == ["ab", "c", "n", "p", "e", "t1", "t2", "kv"]
    assert got["ab"]["cat_dim"] == 1
    assert got["ab"]["parts"] == [part("a", [4, 6], 1, 0, 6), part("b", [4, 2], 1, 0, 2)]
    assert got["c"]["parts"] == [part("c", [8, 3], 0, 4, 4)] and got["c"]["dtype"] == "bfloat16"
    assert (got["p"]["parts"], got["p"]["padding"]) == ([part("p", [3, 4], 0, 0, 3)], 1)
    assert got["e"]["parts"] == [part("e0", [2, 3], 0, 0, 2, at=(0,)), part("e1", [2, 3], 0, 0, 2, at=(1,))]
    assert got["e"]["cat_dim"] == 1
    assert got["t1"]["parts"] == got["t2"]["parts"] == [part("tied", [2, 2], 0, 0, 2)]
    assert unused == ["skip"]
    assert set(refused) == {"t", "i", "g", "r", "h", "k", "o", "u", "rep", "nb", "w_kc"}
    assert "kv" in got  # the parameter itself is a plain copy; what it feeds is not


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("t", "from t: a transposed copy"),
        ("i", "from i: not a rectangular block copy (interleaved, strided or reordered)"),
        ("g", "from g: the values that land are not copies of source elements"),
        ("r", "r's values change on the way in"),
        ("h", "uncovered rows [0, 1) of 4 along dim 0: no HF tensor writes them (load_weights zero-fills them), and"),
        ("k", "uncovered rows [3, 4) of 4 along dim 0 (padding): no HF tensor writes them and load_weights leaves"),
        ("o", "4 element(s) written by more than one HF tensor (o1, o2)"),
        ("u", "no HF tensor in the checkpoint writes it"),
        ("rep", "load_weights(rep) replaced or re-allocated it"),
        ("nb", "buffer changed by load_weights(n)"),
        ("w_kc", "derived by load_weights(kv) into a tensor attribute (not a parameter)"),
    ],
)
def test_synthetic_replica_refusals_name_the_reason(name: str, reason: str) -> None:
    _, refused, _ = synthetic_trace()
    assert refused[name].startswith(reason), refused[name]


# ---------------------------------------------------------------- the engine-venv side (run with SGLang's python)

# After trace_shared.ENGINE_SIDE (``tm``, ``diff``): the models for the refusal cases and SGLang's load.
ENGINE_SIDE = r'''
def import_engine():
    return tm.import_sglang()


def load(sg, model, weights):
    """SGLang's own load path (what DefaultModelLoader.load_model runs after building the model)."""
    loader = __import__("sglang.srt.model_loader.loader", fromlist=["DefaultModelLoader"])
    loader.DefaultModelLoader.load_weights_and_postprocess(model, weights, sg.torch.device("cpu"))
    return {"loader": "DefaultModelLoader.load_weights_and_postprocess"}


def derive(src, out, vocab=None, drop=None):
    from safetensors.torch import load_file, save_file
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(src) / "config.json").read_text())
    tensors = load_file(str(Path(src) / "model.safetensors"))
    if vocab is not None:
        config["vocab_size"] = vocab
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensors[name] = tensors[name][:vocab].contiguous()
    if drop is not None:
        del tensors[drop]
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def moe(out):
    import torch, transformers
    config = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=4, head_dim=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=512, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def glm4moe(out):
    """GLM-4-MoE, 4 layers: layer 0 dense (first_k_dense_replace), layers 1-3 MoE with a shared expert."""
    import torch, transformers
    wanted = dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=16, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=512,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    known = transformers.Glm4MoeConfig().to_dict()
    config = transformers.Glm4MoeConfig(**{k: v for k, v in wanted.items() if k in known})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out)

command, args = sys.argv[2], sys.argv[3:]
if command == "derive":
    derive(args[0], args[1], vocab=int(args[3]) if "--vocab" in args else None,
           drop=args[3] if "--drop" in args else None)
elif command == "moe":
    moe(args[0])
elif command == "glm4moe":
    glm4moe(args[0])
elif command == "diff":
    print(json.dumps(diff(args[0], args[1])))
'''
