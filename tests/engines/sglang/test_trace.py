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

The SGLang venv is built once (cached); these tests skip only when it cannot be built because the package index is
unreachable, and ``WEIGHTSYNC_REQUIRE_SGLANG=1`` turns that skip into a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import weightsync_engine.trace
from weightsync_agent.targets.sglang.manifest import assemble
from weightsync_testing.sglang_models import ensure_tiny_model

TRACE_SCRIPT = Path(weightsync_engine.trace.__file__)
# The tiny models (weightsync_testing.sglang_models.SHAPE): vocab 512, hidden 128, 2 layers, 8 heads / 4 KV heads,
# head_dim 16, MLP 256.
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP = 512, 128, 2, 8, 4, 16, 256
CASES = [(tp, rank) for tp in (1, 2, 4) for rank in range(tp)]
TIMINGS: dict[str, dict[str, float]] = {}
Traces = dict[tuple[str, int, int], dict[str, Any]]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def engine_python(sglang_py: Path) -> Path:
    """The SGLang venv's python (conftest's ``sglang_py``: skips or fails as the tier does)."""
    return sglang_py


@pytest.fixture(scope="session")
def tiny(engine_python: Path) -> dict[str, Path]:
    return {arch: ensure_tiny_model(engine_python, arch, seed=0, dtype="float32") for arch in ("llama", "qwen3")}


@pytest.fixture(scope="session")
def engine_side(engine_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine-venv helper script (models for the refusal cases, the differential check)."""
    path = tmp_path_factory.mktemp("trace-helper") / "trace_helper.py"
    path.write_text(ENGINE_SIDE)
    return path


@pytest.fixture(scope="session")
def traces(engine_python: Path, tiny: dict[str, Path]) -> Traces:
    """Every (arch, tp, rank) of CASES traced with the CLI, bfloat16 (cached for the session)."""
    out: Traces = {}
    for arch, model in tiny.items():
        for tp, rank in CASES:
            out[arch, tp, rank] = trace(engine_python, model, tp, rank, "bfloat16")
    return out


@pytest.fixture(scope="session")
def derived(
    engine_python: Path, engine_side: Path, tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Models for the refusal cases: vocab 500 (padding at TP 2), a checkpoint missing one norm, a tiny Qwen3-MoE."""
    root = tmp_path_factory.mktemp("trace-models")
    out = {"vocab500": root / "vocab500", "missing": root / "missing", "moe": root / "moe", "moe4": root / "moe4"}
    engine(engine_python, engine_side, "derive", str(tiny["llama"]), str(out["vocab500"]), "--vocab", "500")
    drop = "model.layers.1.post_attention_layernorm.weight"
    engine(engine_python, engine_side, "derive", str(tiny["llama"]), str(out["missing"]), "--drop", drop)
    engine(engine_python, engine_side, "moe", str(out["moe"]))
    engine(engine_python, engine_side, "glm4moe", str(out["moe4"]))
    return out


# ---------------------------------------------------------------- running things


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def run_trace(python: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [str(python), str(TRACE_SCRIPT), "sglang", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env or clean_env(), timeout=300, check=False)


def trace(python: Path, model: Path, tp: int, rank: int, dtype: str, *extra: str) -> dict[str, Any]:
    started = time.monotonic()
    done = run_trace(python, "--model", str(model), "--tp", str(tp), "--rank", str(rank), "--dtype", dtype, *extra)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr  # SGLang's own output stays out of the way on success
    result: dict[str, Any] = json.loads(done.stdout)
    wall = time.monotonic() - started
    TIMINGS[f"{model.name} TP{tp} r{rank}"] = {"wall": round(wall, 2), **result["seconds"]}
    print(f"\ntrace {model.name} TP{tp} r{rank}: {wall:.1f} s wall, {result['seconds']}", file=sys.stderr)
    return result


def engine(python: Path, helper: Path, *args: str) -> Any:
    done = subprocess.run(
        [str(python), str(helper), str(TRACE_SCRIPT), *args],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else None


# ---------------------------------------------------------------- the hand-written layout


def part(source: str, full: list[int], dim: int, start: int, length: int, at: tuple[int, ...] = ()) -> dict[str, Any]:
    return {"source": source, "full_shape": full, "dim": dim, "start": start, "length": length, "at": list(at)}


def expected_layout(arch: str, tp: int, rank: int) -> dict[str, dict[str, Any]]:
    """``{name: {"shape", "cat_dim", "parts"}}`` of the tiny models, written out by hand, in SGLang's order."""
    q_rows, kv_rows, mlp = HEADS * HEAD_DIM // tp, KV_HEADS * HEAD_DIM // tp, MLP // tp
    vocab = VOCAB // tp  # 512 is a multiple of 64 (SGLang's vocab padding) times every tp here: no padding

    def whole(name: str, n: int) -> dict[str, Any]:
        return {"shape": [n], "cat_dim": 0, "parts": [part(name, [n], 0, 0, n)]}

    def rows(name: str, full: list[int], n: int) -> dict[str, Any]:
        return {"shape": [n, full[1]], "cat_dim": 0, "parts": [part(name, full, 0, rank * n, n)]}

    def columns(name: str, full: list[int], n: int) -> dict[str, Any]:
        if tp == 1:  # a whole tensor: the trace names no sliced dim, so dim 0 and cat_dim 0
            return {"shape": full, "cat_dim": 0, "parts": [part(name, full, 0, 0, full[0])]}
        return {"shape": [full[0], n], "cat_dim": 1, "parts": [part(name, full, 1, rank * n, n)]}

    out = {"model.embed_tokens.weight": rows("model.embed_tokens.weight", [VOCAB, HIDDEN], vocab)}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        if arch == "qwen3":
            out[p + "self_attn.q_norm.weight"] = whole(p + "self_attn.q_norm.weight", HEAD_DIM)
            out[p + "self_attn.k_norm.weight"] = whole(p + "self_attn.k_norm.weight", HEAD_DIM)
        out[p + "self_attn.qkv_proj.weight"] = {
            "shape": [q_rows + 2 * kv_rows, HIDDEN],
            "cat_dim": 0,
            "parts": [
                part(p + "self_attn.q_proj.weight", [HEADS * HEAD_DIM, HIDDEN], 0, rank * q_rows, q_rows),
                part(p + "self_attn.k_proj.weight", [KV_HEADS * HEAD_DIM, HIDDEN], 0, rank * kv_rows, kv_rows),
                part(p + "self_attn.v_proj.weight", [KV_HEADS * HEAD_DIM, HIDDEN], 0, rank * kv_rows, kv_rows),
            ],
        }
        out[p + "self_attn.o_proj.weight"] = columns(p + "self_attn.o_proj.weight", [HIDDEN, HEADS * HEAD_DIM], q_rows)
        out[p + "mlp.gate_up_proj.weight"] = {
            "shape": [2 * mlp, HIDDEN],
            "cat_dim": 0,
            "parts": [
                part(p + "mlp.gate_proj.weight", [MLP, HIDDEN], 0, rank * mlp, mlp),
                part(p + "mlp.up_proj.weight", [MLP, HIDDEN], 0, rank * mlp, mlp),
            ],
        }
        out[p + "mlp.down_proj.weight"] = columns(p + "mlp.down_proj.weight", [HIDDEN, MLP], mlp)
        out[p + "input_layernorm.weight"] = whole(p + "input_layernorm.weight", HIDDEN)
        out[p + "post_attention_layernorm.weight"] = whole(p + "post_attention_layernorm.weight", HIDDEN)
    out["model.norm.weight"] = whole("model.norm.weight", HIDDEN)
    out["lm_head.weight"] = rows("lm_head.weight", [VOCAB, HIDDEN], vocab)
    return out


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize(("tp", "rank"), CASES, ids=[f"tp{t}-r{r}" for t, r in CASES])
def test_trace_matches_the_hand_written_layout(traces: Traces, arch: str, tp: int, rank: int) -> None:
    result = traces[arch, tp, rank]
    assert (result["sglang_version"], result["tp_size"], result["tp_rank"]) == ("0.5.23", tp, rank)
    assert result["dtype"] == "bfloat16"
    assert result["refused"] == []
    assert result["unused_sources"] == []
    expected = expected_layout(arch, tp, rank)
    got = {t["name"]: {"shape": t["shape"], "cat_dim": t["cat_dim"], "parts": t["parts"]} for t in result["tensors"]}
    assert list(got) == list(expected)  # every parameter, in named_parameters() order
    for name, want in expected.items():
        assert got[name] == want, name
    assert {t["padding"] for t in result["tensors"]} == {0}
    assert {t["dtype"] for t in result["tensors"]} == {"bfloat16"}


def differential(
    engine_python: Path, engine_side: Path, model: Path, traced: dict[tuple[int, int], dict[str, Any]], tmp_path: Path
) -> None:
    """Inside the SGLang venv: a bf16 replica per (tp, rank), loaded by SGLang's own loader from seeded random HF
    tensors, equals assembly from the traced parts (narrow, place, zero padding), bit for bit, for every parameter."""
    jobs = []
    for (tp, rank), result in traced.items():
        path = tmp_path / f"trace-{model.name}-{tp}-{rank}.json"
        path.write_text(json.dumps(result))
        jobs.append({"tp": tp, "rank": rank, "trace": str(path)})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    results = engine(engine_python, engine_side, "diff", str(model), str(tmp_path / "jobs.json"))
    assert len(results) == len(traced)
    for result in results:
        where = f"{model.name} TP{result['tp']} r{result['rank']}"
        assert result["untraced"] == [], where
        assert result["mismatched"] == [], where
        assert result["checked"] == len(traced[result["tp"], result["rank"]]["tensors"]) > 0, where
        assert result["loader"] == "DefaultModelLoader.load_weights_and_postprocess", where


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_differential_sglang_load_equals_assembly_from_parts(
    engine_python: Path, engine_side: Path, tiny: dict[str, Path], traces: Traces, tmp_path: Path, arch: str
) -> None:
    differential(engine_python, engine_side, tiny[arch], {c: traces[(arch, *c)] for c in CASES}, tmp_path)


def test_auto_dtype_resolves_as_sglang_does(engine_python: Path, tiny: dict[str, Path]) -> None:
    """``--dtype auto`` on a float32 checkpoint is float16 in SGLang's ModelConfig (not float32, not bfloat16)."""
    result = trace(engine_python, tiny["qwen3"], 2, 1, "auto")
    assert result["dtype"] == "float16"
    assert {t["dtype"] for t in result["tensors"]} == {"float16"}
    assert result["refused"] == []


def test_workarounds_are_reported_and_used(traces: Traces) -> None:
    for (arch, tp, rank), result in traces.items():
        entries = {w["name"]: w for w in result["workarounds"]}
        assert set(entries) == {"fake_parallel_groups", "vllm_custom_ops_placeholder"}, (arch, tp, rank)
        groups = entries["fake_parallel_groups"]
        assert groups["applied"] and groups["used"]
        assert groups["groups"]["tp_group"] == [rank, tp]
        assert groups["groups"]["world_group"] == [rank, tp]
        assert {"tp_group", "pp_group"} <= set(groups["read"])
        rotary = entries["vllm_custom_ops_placeholder"]  # this machine has no GPU: the gate opens
        assert rotary["applied"] and rotary["used"] and rotary["layers"] >= 1


def test_the_consumer_assembles_a_manifest_from_the_trace(traces: Traces) -> None:
    result = traces["qwen3", 2, 1]
    manifest = assemble(0, 1, result, "127.0.0.1:1234", fake_weights_info(result), device="cpu")
    qkv = manifest.by_name()["model.layers.0.self_attn.qkv_proj.weight"]
    assert [(p.source.split(".")[-2], p.start, p.length) for p in qkv.parts] == [
        ("q_proj", 64, 64),
        ("k_proj", 32, 32),
        ("v_proj", 32, 32),
    ]
    assert manifest.checksum == "tensor-sha256-8"


def test_vocab_padding_on_the_last_rank_is_traced(
    engine_python: Path, engine_side: Path, derived: dict[str, Path], tmp_path: Path
) -> None:
    """Vocab 500 at TP 2: SGLang pads to 512, 256 rows a rank; rank 1 holds 244 real rows and 12 that load_weights
    zero-fills. Those are the entry's ``padding``: the replica holds zeros there, as the engine does."""
    first = trace(engine_python, derived["vocab500"], 2, 0, "bfloat16")
    last = trace(engine_python, derived["vocab500"], 2, 1, "bfloat16")
    assert first["refused"] == last["refused"] == []
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        head = {t["name"]: t for t in first["tensors"]}[name]
        assert (head["shape"], head["parts"], head["padding"]) == (
            [256, HIDDEN],
            [part(name, [500, HIDDEN], 0, 0, 256)],
            0,
        )
        tail = {t["name"]: t for t in last["tensors"]}[name]
        assert (tail["shape"], tail["parts"], tail["padding"]) == (
            [256, HIDDEN],
            [part(name, [500, HIDDEN], 0, 256, 244)],
            12,
        )
    differential(engine_python, engine_side, derived["vocab500"], {(2, 0): first, (2, 1): last}, tmp_path)
    manifest = assemble(0, 1, last, "127.0.0.1:1234", fake_weights_info(last), device="cpu")
    assert manifest.by_name()["lm_head.weight"].padding == 12


def test_a_parameter_no_hf_tensor_writes_is_refused(engine_python: Path, derived: dict[str, Path]) -> None:
    result = trace(engine_python, derived["missing"], 1, 0, "bfloat16", "--full-layers")
    assert result["refused"] == [
        {"name": "model.layers.1.post_attention_layernorm.weight", "reason": "no HF tensor in the checkpoint writes it"}
    ]
    assert len(result["tensors"]) == len(expected_layout("llama", 1, 0)) - 1


MOE_EXPERTS, MOE_MLP = 4, 64


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fused_moe_experts_are_traced(
    engine_python: Path, engine_side: Path, derived: dict[str, Path], tmp_path: Path, tp: int
) -> None:
    """Qwen3-MoE: expert e's 2-D gate/up/down HF tensors land in ``param[e]`` of 3-D ``[E, rows, cols]`` parameters
    (SGLang's FusedMoE): parts with ``at = (e,)``, gate ‖ up along dim 1 of w13, down's column shard along dim 2 of
    w2. Every parameter is traced, and SGLang's own load equals the assembly on every rank."""
    traced = {(tp, rank): trace(engine_python, derived["moe"], tp, rank, "bfloat16") for rank in range(tp)}
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
        manifest = assemble(0, rank, result, "127.0.0.1:1234", fake_weights_info(result), device="cpu")
        assert manifest.by_name()[layer + "experts.w13_weight"].lead == 1
    differential(engine_python, engine_side, derived["moe"], traced, tmp_path)


def test_a_layer_reduced_trace_equals_the_full_one(engine_python: Path, derived: dict[str, Path]) -> None:
    """GLM-4-MoE with 4 layers, the first dense and the rest MoE: the trace builds and traces the first 2 (one of each
    kind, alike in the checkpoint and in the engine's full layout, built on the meta device), moves layer 1's map to
    layers 2 and 3, and the result equals tracing all 4 layers."""
    reduced = trace(engine_python, derived["moe4"], 2, 1, "bfloat16")
    full = trace(engine_python, derived["moe4"], 2, 1, "bfloat16", "--full-layers")
    assert reduced["layers"] == {"total": 4, "traced": 2, "representative": {"2": 1, "3": 1}}
    assert full["layers"] == {"total": 4, "traced": 4, "representative": {}}
    assert reduced["refused"] == full["refused"] == []
    assert reduced["unused_sources"] == full["unused_sources"] == []
    assert reduced["tensors"] == full["tensors"]
    names = {t["name"] for t in reduced["tensors"]}
    assert "model.layers.3.mlp.experts.w13_weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names


def fake_weights_info(result: dict[str, Any]) -> dict[str, list[int]]:
    """What SGLang would publish for the traced rank, at made-up addresses (``[data_ptr, numel, element_size]``)."""
    weights_info, address = {}, 1 << 20
    for entry in result["tensors"]:
        numel = 1
        for n in entry["shape"]:
            numel *= n
        weights_info[entry["name"]] = [address, numel, 2]
        address += numel * 2 + 64
    return weights_info


def test_bad_model_dir_is_one_stderr_line(engine_python: Path, tmp_path: Path) -> None:
    done = run_trace(engine_python, "--model", str(tmp_path / "nope"), "--tp", "1", "--rank", "0", "--dtype", "auto")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "does not exist" in done.stderr, done.stderr
    done = run_trace(engine_python, "--model", str(tmp_path), "--tp", "2", "--rank", "2")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--rank 2 is not a rank of --tp 2" in done.stderr


def test_sglang_import_failure_names_the_package(engine_python: Path, tiny: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "sglang.py").write_text("raise ModuleNotFoundError(\"No module named 'sglang'\", name='sglang')\n")
    env = {**clean_env(), "PYTHONPATH": str(tmp_path)}
    done = run_trace(engine_python, "--model", str(tiny["llama"]), "--tp", "1", "--rank", "0", env=env)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("trace_model: cannot import sglang"), done.stderr


def test_timings_are_reported(traces: Traces) -> None:
    for key, result in traces.items():
        seconds = result["seconds"]
        assert 0 < seconds["total"] < 120, (key, seconds)
    print("\n" + json.dumps(TIMINGS, indent=1), file=sys.stderr)


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

ENGINE_SIDE = r'''
"""Engine-venv helper for test_trace.py: argv[1] is weightsync_engine/trace.py (SGLang's trace_model through it, for
its build recipe)."""
import importlib.util, json, sys, time
from pathlib import Path

spec = importlib.util.spec_from_file_location("weightsync_engine_trace", sys.argv[1])
entry = importlib.util.module_from_spec(spec)
spec.loader.exec_module(entry)
tm = entry.engine_module("sglang")


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


def diff(model_dir, jobs_file):
    sg = tm.import_sglang()
    torch = sg.torch
    loader = __import__("sglang.srt.model_loader.loader", fromlist=["DefaultModelLoader"])
    shapes = tm.read_checkpoint(Path(model_dir))
    generator = torch.Generator().manual_seed(7)
    sources = {n: torch.randn(s, generator=generator).to(torch.bfloat16) for n, s in shapes.items()}
    results = []
    for job in json.loads(Path(jobs_file).read_text()):
        started = time.monotonic()
        trace = json.loads(Path(job["trace"]).read_text())
        model, _ = tm.build_model(sg, Path(model_dir), job["tp"], job["rank"], "bfloat16", tm.Workarounds())
        with torch.no_grad():
            for p in model.parameters():
                p.data.fill_(float("nan"))
        # SGLang's own load path (what DefaultModelLoader.load_model runs after building the model).
        weights = ((n, t.clone()) for n, t in sources.items())  # a loader may change its input in place
        loader.DefaultModelLoader.load_weights_and_postprocess(model, weights, torch.device("cpu"))
        traced = {t["name"]: t for t in trace["tensors"]}
        untraced, mismatched, checked = [], [], 0
        for name, param in model.named_parameters():
            entry = traced.get(name)
            if entry is None:
                untraced.append(name)
                continue
            # Assembled here, independently of weightsync's own code: per destination sub-tensor (``at``),
            # the parts concatenated along cat_dim, then zero padding.
            groups = {}
            for p in entry["parts"]:
                piece = sources[p["source"]].narrow(p["dim"], p["start"], p["length"])
                groups.setdefault(tuple(p["at"]), []).append(piece)
            built = torch.zeros(entry["shape"], dtype=torch.bfloat16)
            for at, pieces in groups.items():
                dim = entry["cat_dim"] - len(at)
                block = torch.cat(pieces, dim=dim)
                (built[at] if at else built).narrow(dim, 0, block.shape[dim]).copy_(block)
            same = (
                list(param.shape) == entry["shape"] == list(built.shape)
                and str(param.dtype).removeprefix("torch.") == entry["dtype"]
                and torch.equal(param.data.view(torch.int16), built.view(torch.int16))
            )
            checked += 1
            if not same:
                mismatched.append(name)
        results.append({
            "tp": job["tp"], "rank": job["rank"], "checked": checked, "untraced": untraced,
            "mismatched": mismatched, "loader": "DefaultModelLoader.load_weights_and_postprocess",
            "seconds": round(time.monotonic() - started, 2),
        })
    return results


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
