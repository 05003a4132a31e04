"""The shard-map trace of stock vLLM (weightsync_engine/vllm/trace_model.py; docs/engines/vllm-trace.md).

Traces vLLM's own model classes for the tiny Llama, Qwen2, Qwen3 and Qwen3-MoE at TP 1, 2 and 4, every rank, and
checks them three ways, as the SGLang trace's tests do: every parameter of the rank is traced and none refused; the
parts equal a hand-written layout (qkv = q rows, k rows, v rows of this rank, biases too, KV heads replicated when
there are fewer than T (Qwen2 at TP 4); gate ‖ up; o/down column shards; norms whole; embed/lm_head vocab rows;
Qwen3-MoE's experts fused as vLLM's FusedMoE holds them, 3-D with a leading expert index ``at``); and a
differential check inside the vLLM venv: a bf16 model loaded by vLLM's own ``load_weights`` from seeded random HF
tensors is bit-identical to plain ``narrow``/``cat`` assembly from the parts. Vocab padding (vocab 500 at TP 2) is
traced and checked the same way. The trace's output also goes through ``layout.traced_manifest.assemble``, its
consumer (shared with SGLang).

vLLM's import dominates a trace's wall time, so each architecture's 7 ranks are traced in one process (the script's
``run``, as the CLI calls it; the script replaces its own group placeholders between ranks), and one trace runs
through the CLI as the adapter will run it and must equal the in-process one. The vLLM venv comes from
``$WEIGHTSYNC_VLLM_PYTHON`` or is built (conftest); ``WEIGHTSYNC_REQUIRE_VLLM=1`` turns a skip into a failure.
No vLLM server is started.

The tests SGLang's trace passes too are ``TestVllmTrace``'s, from ``tests/engines/trace_shared.py``; this module
holds vLLM's side of them (:data:`VLLM`, the fixtures, the hand-written layout) and the tests of vLLM alone.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
from trace_shared import CASES, HIDDEN, SharedTraceTests, TraceEngine, Traces, columns, layer_norms, part, rows, whole

from weightsync_agent.layout.traced_manifest import assemble
from weightsync_testing.sglang_models import MOE_SHAPE, SHAPE, ensure_tiny_model

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")
# The vLLM tier's tiny models (weightsync_testing.sglang_models, head_dim 32: vLLM's CPU attention needs >= 32):
# vocab 512, hidden 128, 2 layers, MLP 256; 8 heads / 4 KV heads of 32, except Qwen2 (no head_dim setting: 4 / 2).
VOCAB, LAYERS, MLP, HEAD_DIM = SHAPE["vocab_size"], 2, SHAPE["intermediate_size"], 32
HEADS = {"llama": (8, 4), "qwen2": (4, 2), "qwen3": (8, 4), "qwen3_moe": (8, 4)}
EXPERTS, EXPERT_MLP = MOE_SHAPE["num_experts"], MOE_SHAPE["moe_intermediate_size"]
# No vLLM adapter picks a verify hash yet: weightsync's own bucket hash stands in (the trace does not depend on it).
CHECKSUM = "bucket-xxh3"


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def tiny(vllm_py: Path) -> dict[str, Path]:
    return {arch: ensure_tiny_model(vllm_py, arch, seed=0, dtype="float32", head_dim=HEAD_DIM) for arch in ARCHS}


@pytest.fixture(scope="session")
def engine_side(vllm_py: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine-venv helper script (several ranks traced in one process, the differential check)."""
    return VLLM.write_engine_side(tmp_path_factory, ENGINE_SIDE)


@pytest.fixture(scope="session")
def traces(vllm_py: Path, engine_side: Path, tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Traces:
    """Every (arch, tp, rank) of CASES traced in bfloat16, one process per architecture (cached for the session);
    plus (``llama-auto``, 1, 0): the tiny Llama with ``--dtype auto``."""
    root = tmp_path_factory.mktemp("vllm-traces")
    out: Traces = {}
    for arch, model in tiny.items():
        jobs = [{"tp": tp, "rank": rank, "dtype": "bfloat16"} for tp, rank in CASES]
        if arch == "llama":
            jobs.append({"tp": 1, "rank": 0, "dtype": "auto"})
        (root / f"{arch}.json").write_text(json.dumps(jobs))
        started = time.monotonic()
        results = VLLM.run_helper(vllm_py, engine_side, "trace", str(model), str(root / f"{arch}.json"))
        wall = time.monotonic() - started
        print(f"\n{arch}: {len(jobs)} traces in one process, {wall:.1f} s wall", file=sys.stderr)
        VLLM.timings[f"{arch} (one process, {len(jobs)} traces)"] = {"wall": round(wall, 2)}
        for job, result in zip(jobs, results, strict=True):
            key = (arch if job["dtype"] == "bfloat16" else f"{arch}-auto", job["tp"], job["rank"])
            out[key] = result
            VLLM.timings[f"{key[0]} TP{key[1]} r{key[2]}"] = result["seconds"]
            print(f"trace {key[0]} TP{key[1]} r{key[2]}: {result['seconds']}", file=sys.stderr)
    return out


@pytest.fixture
def vocab500(
    vllm_py: Path, engine_side: Path, tiny: dict[str, Path], tmp_path: Path
) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """The tiny Llama cut to vocab 500, and its TP 2 traces of rank 0 and rank 1, in one process."""
    model = tmp_path / "tiny-llama-vocab500"
    VLLM.run_helper(vllm_py, engine_side, "derive", str(tiny["llama"]), str(model), "500")
    (tmp_path / "jobs.json").write_text(json.dumps([{"tp": 2, "rank": r, "dtype": "bfloat16"} for r in (0, 1)]))
    first, last = VLLM.run_helper(vllm_py, engine_side, "trace", str(model), str(tmp_path / "jobs.json"))
    print(f"\ntrace vocab500 TP2 r0: {first['seconds']}, r1: {last['seconds']}", file=sys.stderr)
    return model, first, last


def load_trace_module() -> Any:
    """The trace's vLLM module in this venv (no vLLM import happens at load): for its gate."""
    return importlib.import_module("weightsync_engine.vllm.trace_model")


# ---------------------------------------------------------------- the hand-written layout


def expected_layout(arch: str, tp: int, rank: int) -> dict[str, dict[str, Any]]:
    """``{name: {"shape", "cat_dim", "parts"}}`` of the tiny models as vLLM holds them, written out by hand."""
    heads, kv_heads = HEADS[arch]
    q_full, kv_full = heads * HEAD_DIM, kv_heads * HEAD_DIM
    q_rows, mlp, vocab = q_full // tp, MLP // tp, VOCAB // tp  # vocab: no padding here
    # KV heads: split when there are at least T of them; else each head is replicated on T / kv_heads ranks (Qwen2 at
    # TP 4: 2 KV heads, rank r holds head r // 2).
    kv_rows = HEAD_DIM * max(kv_heads // tp, 1)
    kv_start = rank * kv_rows if kv_heads >= tp else rank // (tp // kv_heads) * HEAD_DIM

    def fused(p: str, names: list[str], full: list[list[int]], n: list[int], suffix: str, start: list[int]) -> Any:
        """Row shards of several HF tensors, one after the other along dim 0 (qkv_proj, gate_up_proj)."""
        pieces = [part(p + s + suffix, f, 0, a, k) for s, f, k, a in zip(names, full, n, start, strict=True)]
        return {"shape": [sum(n), *full[0][1:]], "cat_dim": 0, "parts": pieces}

    qkv_rows, qkv_start = [q_rows, kv_rows, kv_rows], [rank * q_rows, kv_start, kv_start]

    out = {"model.embed_tokens.weight": rows("model.embed_tokens.weight", [VOCAB, HIDDEN], vocab, rank)}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        qkv = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
        out[p + "self_attn.qkv_proj.weight"] = fused(
            p, qkv, [[q_full, HIDDEN], [kv_full, HIDDEN], [kv_full, HIDDEN]], qkv_rows, ".weight", qkv_start
        )
        if arch == "qwen2":
            out[p + "self_attn.qkv_proj.bias"] = fused(
                p, qkv, [[q_full], [kv_full], [kv_full]], qkv_rows, ".bias", qkv_start
            )
        out[p + "self_attn.o_proj.weight"] = columns(p + "self_attn.o_proj.weight", [HIDDEN, q_full], q_rows, tp, rank)
        if arch in ("qwen3", "qwen3_moe"):
            out[p + "self_attn.q_norm.weight"] = whole(p + "self_attn.q_norm.weight", [HEAD_DIM])
            out[p + "self_attn.k_norm.weight"] = whole(p + "self_attn.k_norm.weight", [HEAD_DIM])
        if arch == "qwen3_moe":
            out.update(expected_experts(p + "mlp.", tp, rank))
        else:
            out[p + "mlp.gate_up_proj.weight"] = fused(
                p,
                ["mlp.gate_proj", "mlp.up_proj"],
                [[MLP, HIDDEN], [MLP, HIDDEN]],
                [mlp, mlp],
                ".weight",
                [rank * mlp] * 2,
            )
            out[p + "mlp.down_proj.weight"] = columns(p + "mlp.down_proj.weight", [HIDDEN, MLP], mlp, tp, rank)
        out.update(layer_norms(p))
    out["model.norm.weight"] = whole("model.norm.weight", [HIDDEN])
    out["lm_head.weight"] = rows("lm_head.weight", [VOCAB, HIDDEN], vocab, rank)
    return out


def expected_experts(p: str, tp: int, rank: int) -> dict[str, dict[str, Any]]:
    """vLLM's FusedMoE (no expert parallelism; 0.32 names it ``experts.routed_experts``): ``w13_weight [E, 2·I/T, H]``
    is expert e's gate rows then up rows of this rank at ``[e]``; ``w2_weight [E, H, I/T]`` expert e's down_proj
    column shard at ``[e]``; the router whole."""
    mlp = EXPERT_MLP // tp
    w13 = [
        part(f"{p}experts.{e}.{proj}.weight", [EXPERT_MLP, HIDDEN], 0, rank * mlp, mlp, at=(e,))
        for e in range(EXPERTS)
        for proj in ("gate_proj", "up_proj")
    ]
    down = [f"{p}experts.{e}.down_proj.weight" for e in range(EXPERTS)]
    if tp == 1:  # whole tensors: nothing sliced, so the trace concatenates along the first dim it can
        w2 = {
            "shape": [EXPERTS, HIDDEN, EXPERT_MLP],
            "cat_dim": 1,
            "parts": [part(d, [HIDDEN, EXPERT_MLP], 0, 0, HIDDEN, at=(e,)) for e, d in enumerate(down)],
        }
    else:
        w2 = {
            "shape": [EXPERTS, HIDDEN, mlp],
            "cat_dim": 2,
            "parts": [part(d, [HIDDEN, EXPERT_MLP], 1, rank * mlp, mlp, at=(e,)) for e, d in enumerate(down)],
        }
    return {
        p + "gate.weight": {
            "shape": [EXPERTS, HIDDEN],
            "cat_dim": 0,
            "parts": [part(p + "gate.weight", [EXPERTS, HIDDEN], 0, 0, EXPERTS)],
        },
        p + "experts.routed_experts.w13_weight": {"shape": [EXPERTS, 2 * mlp, HIDDEN], "cat_dim": 1, "parts": w13},
        p + "experts.routed_experts.w2_weight": w2,
    }


# ---------------------------------------------------------------- the tests both engines pass

VLLM = TraceEngine(
    name="vllm",
    python="vllm_py",
    version="0.32.0",
    archs=ARCHS,
    expected_layout=expected_layout,
    ordered=False,  # the hand-written layout is not in vLLM's named_parameters() order
    layers={"total": LAYERS, "traced": 1, "representative": {"1": 0}},  # layer 1 is layer 0's map
    loaded={"not_loaded": []},
    workarounds=frozenset({"fake_parallel_groups", "rope_cache_cleared"}),
    groups=lambda tp, rank: {"_TP": [rank, tp], "_PP": [0, 1]},
    groups_read=lambda arch: {"_TP", "_PP"} | ({"_DP", "_EP", "_PCP"} if arch == "qwen3_moe" else set()),
    layered=(),
    failure_note="(vLLM's output: ",
    assemble=lambda rank, trace, weights_info: assemble(
        0, rank, trace, "127.0.0.1:1234", weights_info, checksum=CHECKSUM
    ),
)


class TestVllmTrace(SharedTraceTests):
    engine = VLLM


# ---------------------------------------------------------------- tests of vLLM alone


def test_the_cli_equals_the_in_process_trace(vllm_py: Path, tiny: dict[str, Path], traces: Traces) -> None:
    """The script as the adapter runs it (its own process, the CLI): same output as ``run`` in a shared process."""
    started = time.monotonic()
    model = str(tiny["qwen3"])
    done = VLLM.run_trace(vllm_py, "--model", model, "--tp", "2", "--rank", "1", "--dtype", "bfloat16")
    wall = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr  # vLLM's own output stays out of the way on success
    result = json.loads(done.stdout)
    VLLM.timings["qwen3 TP2 r1 (CLI)"] = {"wall": round(wall, 2), **result["seconds"]}
    print(f"\ntrace qwen3 TP2 r1 (CLI): {wall:.1f} s wall, {result['seconds']}", file=sys.stderr)
    shared = traces["qwen3", 2, 1]
    for key in ("tensors", "refused", "unused_sources", "layers", "dtype", "vllm_version"):
        assert result[key] == shared[key], key


def test_auto_dtype_resolves_as_vllm_cpu_does(traces: Traces) -> None:
    """``--dtype auto`` on a float32 checkpoint is bfloat16 on vLLM's CPU platform (its first supported dtype)."""
    result = traces["llama-auto", 1, 0]
    assert result["dtype"] == "bfloat16"
    assert result["refused"] == []


def test_the_consumer_assembles_a_manifest_from_the_trace(traces: Traces) -> None:
    qkv = VLLM.manifest(1, traces["qwen3", 2, 1]).by_name()["model.layers.1.self_attn.qkv_proj.weight"]
    assert [(p.source.split(".")[-2], p.start, p.length) for p in qkv.parts] == [
        ("q_proj", 128, 128),
        ("k_proj", 64, 64),
        ("v_proj", 64, 64),
    ]
    moe = VLLM.manifest(3, traces["qwen3_moe", 4, 3])
    assert moe.by_name()["model.layers.1.mlp.experts.routed_experts.w13_weight"].lead == 1


def test_missing_vllm_internals_are_refused_by_name() -> None:
    """The gate on what the trace fakes: a vLLM without them is a one-line error naming each, not a wrong trace."""
    tm = load_trace_module()
    vl = types.SimpleNamespace(
        version="9.9.9",
        EngineArgs=object,
        initialize_model=None,
        set_default_torch_dtype=object,
        parallel_state=types.SimpleNamespace(_TP=None, _PP=None),
        rope_cache=None,
    )
    with pytest.raises(tm.TraceError) as caught:
        tm.check_internals(vl)
    message = str(caught.value)
    assert message.startswith("vLLM 9.9.9 lacks what the trace needs (initialize_model, parallel_state._DP"), message
    assert "rotary_embedding._ROPE_DICT" in message and message.endswith("validated against vLLM 0.32.0")


# ---------------------------------------------------------------- the engine-venv side (run with vLLM's python)

# After trace_shared.ENGINE_SIDE (``tm``, ``diff``): several ranks traced in one process, vLLM's load, vocab cut.
ENGINE_SIDE = r'''
def import_engine():
    return tm.import_vllm()


def load(vl, model, weights):
    """vLLM's own load path (DefaultModelLoader.load_weights: model.load_weights over the checkpoint, then every
    parameter must be reported loaded); process_weights_after_loading is not run (CPU repacks linear weights)."""
    loaded = model.load_weights(weights)
    return {"not_loaded": sorted(n for n, _ in model.named_parameters() if n not in loaded)}


def trace(model_dir, jobs_file):
    """Each job traced by the script's own ``run`` (what its CLI calls), in this one process."""
    results = []
    for job in json.loads(Path(jobs_file).read_text()):
        started = time.monotonic()
        result = tm.run(Path(model_dir), job["tp"], job["rank"], job["dtype"])
        result["seconds"]["wall"] = round(time.monotonic() - started, 2)
        results.append(result)
    return results


def derive(src, out, vocab):
    """The model at ``src`` with its vocabulary cut to ``vocab`` rows (config and embeddings; tokenizer as is)."""
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, out)
    config = json.loads((Path(out) / "config.json").read_text())
    config["vocab_size"] = vocab
    (Path(out) / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(Path(src) / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = tensors[name][:vocab].contiguous()
    save_file(tensors, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})


command, args = sys.argv[2], sys.argv[3:]
if command == "derive":
    derive(args[0], args[1], int(args[2]))
    print("null")
elif command == "trace":
    print(json.dumps(trace(args[0], args[1])))
elif command == "diff":
    print(json.dumps(diff(args[0], args[1])))
'''
