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
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest

import weightsync_engine.trace
from weightsync_agent.layout.traced_manifest import assemble
from weightsync_testing.sglang_models import MOE_SHAPE, SHAPE, ensure_tiny_model

TRACE_SCRIPT = Path(weightsync_engine.trace.__file__)
ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")
CASES = [(tp, rank) for tp in (1, 2, 4) for rank in range(tp)]
# The vLLM tier's tiny models (weightsync_testing.sglang_models, head_dim 32: vLLM's CPU attention needs >= 32):
# vocab 512, hidden 128, 2 layers, MLP 256; 8 heads / 4 KV heads of 32, except Qwen2 (no head_dim setting: 4 / 2).
VOCAB, HIDDEN, LAYERS, MLP, HEAD_DIM = SHAPE["vocab_size"], SHAPE["hidden_size"], 2, SHAPE["intermediate_size"], 32
HEADS = {"llama": (8, 4), "qwen2": (4, 2), "qwen3": (8, 4), "qwen3_moe": (8, 4)}
EXPERTS, EXPERT_MLP = MOE_SHAPE["num_experts"], MOE_SHAPE["moe_intermediate_size"]
# No vLLM adapter picks a verify hash yet: weightsync's own bucket hash stands in (the trace does not depend on it).
CHECKSUM = "bucket-xxh3"
TIMINGS: dict[str, dict[str, float]] = {}
Traces = dict[tuple[str, int, int], dict[str, Any]]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def engine_python(vllm_py: Path) -> Path:
    """The vLLM venv's python (conftest's ``vllm_py``: skips or fails as the tier does)."""
    return vllm_py


@pytest.fixture(scope="session")
def tiny(engine_python: Path) -> dict[str, Path]:
    return {arch: ensure_tiny_model(engine_python, arch, seed=0, dtype="float32", head_dim=HEAD_DIM) for arch in ARCHS}


@pytest.fixture(scope="session")
def engine_side(engine_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine-venv helper script (several ranks traced in one process, the differential check)."""
    path = tmp_path_factory.mktemp("vllm-trace-helper") / "vllm_trace_helper.py"
    path.write_text(ENGINE_SIDE)
    return path


@pytest.fixture(scope="session")
def traces(
    engine_python: Path, engine_side: Path, tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Traces:
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
        results = engine(engine_python, engine_side, "trace", str(model), str(root / f"{arch}.json"))
        wall = time.monotonic() - started
        print(f"\n{arch}: {len(jobs)} traces in one process, {wall:.1f} s wall", file=sys.stderr)
        TIMINGS[f"{arch} (one process, {len(jobs)} traces)"] = {"wall": round(wall, 2)}
        for job, result in zip(jobs, results, strict=True):
            key = (arch if job["dtype"] == "bfloat16" else f"{arch}-auto", job["tp"], job["rank"])
            out[key] = result
            TIMINGS[f"{key[0]} TP{key[1]} r{key[2]}"] = result["seconds"]
            print(f"trace {key[0]} TP{key[1]} r{key[2]}: {result['seconds']}", file=sys.stderr)
    return out


# ---------------------------------------------------------------- running things


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def run_trace(python: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [str(python), str(TRACE_SCRIPT), "vllm", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env or clean_env(), timeout=300, check=False)


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
    return json.loads(done.stdout.strip().splitlines()[-1])


def load_trace_module() -> Any:
    """The trace's vLLM module in this venv (no vLLM import happens at load): for its gate."""
    return importlib.import_module("weightsync_engine.vllm.trace_model")


# ---------------------------------------------------------------- the hand-written layout


def part(source: str, full: list[int], dim: int, start: int, length: int, at: tuple[int, ...] = ()) -> dict[str, Any]:
    return {"source": source, "full_shape": full, "dim": dim, "start": start, "length": length, "at": list(at)}


def expected_layout(arch: str, tp: int, rank: int) -> dict[str, dict[str, Any]]:
    """``{name: {"shape", "cat_dim", "parts"}}`` of the tiny models as vLLM holds them, written out by hand."""
    heads, kv_heads = HEADS[arch]
    q_full, kv_full = heads * HEAD_DIM, kv_heads * HEAD_DIM
    q_rows, mlp, vocab = q_full // tp, MLP // tp, VOCAB // tp  # vocab: no padding here
    # KV heads: split when there are at least T of them; else each head is replicated on T / kv_heads ranks (Qwen2 at
    # TP 4: 2 KV heads, rank r holds head r // 2).
    kv_rows = HEAD_DIM * max(kv_heads // tp, 1)
    kv_start = rank * kv_rows if kv_heads >= tp else rank // (tp // kv_heads) * HEAD_DIM

    def whole(name: str, full: list[int]) -> dict[str, Any]:
        return {"shape": full, "cat_dim": 0, "parts": [part(name, full, 0, 0, full[0])]}

    def rows(name: str, full: list[int], n: int) -> dict[str, Any]:
        return {"shape": [n, *full[1:]], "cat_dim": 0, "parts": [part(name, full, 0, rank * n, n)]}

    def columns(name: str, full: list[int], n: int) -> dict[str, Any]:
        if tp == 1:  # a whole tensor: the trace names no sliced dim, so dim 0 and cat_dim 0
            return whole(name, full)
        return {"shape": [full[0], n], "cat_dim": 1, "parts": [part(name, full, 1, rank * n, n)]}

    def fused(p: str, names: list[str], full: list[list[int]], n: list[int], suffix: str, start: list[int]) -> Any:
        """Row shards of several HF tensors, one after the other along dim 0 (qkv_proj, gate_up_proj)."""
        pieces = [part(p + s + suffix, f, 0, a, k) for s, f, k, a in zip(names, full, n, start, strict=True)]
        return {"shape": [sum(n), *full[0][1:]], "cat_dim": 0, "parts": pieces}

    qkv_rows, qkv_start = [q_rows, kv_rows, kv_rows], [rank * q_rows, kv_start, kv_start]

    out = {"model.embed_tokens.weight": rows("model.embed_tokens.weight", [VOCAB, HIDDEN], vocab)}
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
        out[p + "self_attn.o_proj.weight"] = columns(p + "self_attn.o_proj.weight", [HIDDEN, q_full], q_rows)
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
            out[p + "mlp.down_proj.weight"] = columns(p + "mlp.down_proj.weight", [HIDDEN, MLP], mlp)
        out[p + "input_layernorm.weight"] = whole(p + "input_layernorm.weight", [HIDDEN])
        out[p + "post_attention_layernorm.weight"] = whole(p + "post_attention_layernorm.weight", [HIDDEN])
    out["model.norm.weight"] = whole("model.norm.weight", [HIDDEN])
    out["lm_head.weight"] = rows("lm_head.weight", [VOCAB, HIDDEN], vocab)
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


def fake_weights_info(result: dict[str, Any]) -> dict[str, list[int]]:
    """Addresses for the traced rank as an engine would publish them (``[data_ptr, numel, element_size]``)."""
    weights_info, address = {}, 1 << 20
    for entry in result["tensors"]:
        numel = 1
        for n in entry["shape"]:
            numel *= n
        weights_info[entry["name"]] = [address, numel, 2]
        address += numel * 2 + 64
    return weights_info


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("tp", "rank"), CASES, ids=[f"tp{t}-r{r}" for t, r in CASES])
def test_trace_matches_the_hand_written_layout(traces: Traces, arch: str, tp: int, rank: int) -> None:
    result = traces[arch, tp, rank]
    assert (result["vllm_version"], result["tp_size"], result["tp_rank"]) == ("0.32.0", tp, rank)
    assert result["dtype"] == "bfloat16"
    assert result["refused"] == []
    assert result["unused_sources"] == []
    assert result["layers"] == {"total": LAYERS, "traced": 1, "representative": {"1": 0}}  # layer 1 is layer 0's map
    expected = expected_layout(arch, tp, rank)
    got = {t["name"]: {"shape": t["shape"], "cat_dim": t["cat_dim"], "parts": t["parts"]} for t in result["tensors"]}
    assert sorted(got) == sorted(expected)  # every parameter (order: vLLM's named_parameters())
    for name, want in expected.items():
        assert got[name] == want, name
    assert {t["padding"] for t in result["tensors"]} == {0}
    assert {t["dtype"] for t in result["tensors"]} == {"bfloat16"}


def differential(
    engine_python: Path, engine_side: Path, model: Path, traced: dict[tuple[int, int], dict[str, Any]], tmp_path: Path
) -> None:
    """Inside the vLLM venv: a bf16 model per (tp, rank), built as vLLM builds it and loaded by its own
    ``load_weights`` from seeded random HF tensors (every parameter reported loaded, as DefaultModelLoader checks),
    equals assembly from the traced parts (narrow, place, zero padding), bit for bit, for every parameter."""
    jobs = []
    for (tp, rank), result in traced.items():
        path = tmp_path / f"trace-{model.name}-{tp}-{rank}.json"
        path.write_text(json.dumps(result))
        jobs.append({"tp": tp, "rank": rank, "trace": str(path)})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    started = time.monotonic()
    results = engine(engine_python, engine_side, "diff", str(model), str(tmp_path / "jobs.json"))
    print(f"\ndifferential {model.name}: {len(jobs)} ranks in {time.monotonic() - started:.1f} s", file=sys.stderr)
    assert len(results) == len(traced)
    for result in results:
        where = f"{model.name} TP{result['tp']} r{result['rank']}"
        assert result["not_loaded"] == [], where
        assert result["untraced"] == [], where
        assert result["mismatched"] == [], where
        assert result["checked"] == len(traced[result["tp"], result["rank"]]["tensors"]) > 0, where


@pytest.mark.parametrize("arch", ARCHS)
def test_differential_vllm_load_equals_assembly_from_parts(
    engine_python: Path, engine_side: Path, tiny: dict[str, Path], traces: Traces, tmp_path: Path, arch: str
) -> None:
    differential(engine_python, engine_side, tiny[arch], {c: traces[(arch, *c)] for c in CASES}, tmp_path)


def test_vocab_padding_on_the_last_rank_is_traced(
    engine_python: Path, engine_side: Path, tiny: dict[str, Path], tmp_path: Path
) -> None:
    """Vocab 500 at TP 2: vLLM pads to 512 (a multiple of 64), 256 rows a rank; rank 1 holds 244 real rows and 12
    that load_weights zero-fills. Those are the entry's ``padding``: the model holds zeros there."""
    model = tmp_path / "tiny-llama-vocab500"
    engine(engine_python, engine_side, "derive", str(tiny["llama"]), str(model), "500")
    (tmp_path / "jobs.json").write_text(json.dumps([{"tp": 2, "rank": r, "dtype": "bfloat16"} for r in (0, 1)]))
    first, last = engine(engine_python, engine_side, "trace", str(model), str(tmp_path / "jobs.json"))
    print(f"\ntrace vocab500 TP2 r0: {first['seconds']}, r1: {last['seconds']}", file=sys.stderr)
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
    (tmp_path / "diff").mkdir()
    differential(engine_python, engine_side, model, {(2, 0): first, (2, 1): last}, tmp_path / "diff")
    manifest = assemble(0, 1, last, "127.0.0.1:1234", fake_weights_info(last), checksum=CHECKSUM)
    assert manifest.by_name()["lm_head.weight"].padding == 12


def test_the_cli_equals_the_in_process_trace(engine_python: Path, tiny: dict[str, Path], traces: Traces) -> None:
    """The script as the adapter runs it (its own process, the CLI): same output as ``run`` in a shared process."""
    started = time.monotonic()
    done = run_trace(engine_python, "--model", str(tiny["qwen3"]), "--tp", "2", "--rank", "1", "--dtype", "bfloat16")
    wall = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr  # vLLM's own output stays out of the way on success
    result = json.loads(done.stdout)
    TIMINGS["qwen3 TP2 r1 (CLI)"] = {"wall": round(wall, 2), **result["seconds"]}
    print(f"\ntrace qwen3 TP2 r1 (CLI): {wall:.1f} s wall, {result['seconds']}", file=sys.stderr)
    shared = traces["qwen3", 2, 1]
    for key in ("tensors", "refused", "unused_sources", "layers", "dtype", "vllm_version"):
        assert result[key] == shared[key], key


def test_auto_dtype_resolves_as_vllm_cpu_does(traces: Traces) -> None:
    """``--dtype auto`` on a float32 checkpoint is bfloat16 on vLLM's CPU platform (its first supported dtype)."""
    result = traces["llama-auto", 1, 0]
    assert result["dtype"] == "bfloat16"
    assert result["refused"] == []


def test_workarounds_are_reported_and_used(traces: Traces) -> None:
    for (arch, tp, rank), result in traces.items():
        entries = {w["name"]: w for w in result["workarounds"]}
        assert set(entries) == {"fake_parallel_groups", "rope_cache_cleared"}, (arch, tp, rank)
        groups = entries["fake_parallel_groups"]
        assert groups["applied"] and groups["used"]
        assert groups["groups"]["_TP"] == [rank, tp]
        assert groups["groups"]["_PP"] == [0, 1]
        assert {"_TP", "_PP"} <= set(groups["read"])
        if arch == "qwen3_moe":
            assert {"_DP", "_EP", "_PCP"} <= set(groups["read"]), groups["read"]


def test_the_consumer_assembles_a_manifest_from_the_trace(traces: Traces) -> None:
    result = traces["qwen3", 2, 1]
    manifest = assemble(0, 1, result, "127.0.0.1:1234", fake_weights_info(result), checksum=CHECKSUM)
    qkv = manifest.by_name()["model.layers.1.self_attn.qkv_proj.weight"]
    assert [(p.source.split(".")[-2], p.start, p.length) for p in qkv.parts] == [
        ("q_proj", 128, 128),
        ("k_proj", 64, 64),
        ("v_proj", 64, 64),
    ]
    moe = traces["qwen3_moe", 4, 3]
    manifest = assemble(0, 3, moe, "127.0.0.1:1234", fake_weights_info(moe), checksum=CHECKSUM)
    assert manifest.by_name()["model.layers.1.mlp.experts.routed_experts.w13_weight"].lead == 1


def test_bad_arguments_are_one_stderr_line(engine_python: Path, tmp_path: Path) -> None:
    done = run_trace(engine_python, "--model", str(tmp_path / "nope"), "--tp", "1", "--rank", "0", "--dtype", "auto")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "does not exist" in done.stderr, done.stderr
    assert "(vLLM's output: " in done.stderr
    done = run_trace(engine_python, "--model", str(tmp_path), "--tp", "2", "--rank", "2")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--rank 2 is not a rank of --tp 2" in done.stderr


def test_vllm_import_failure_names_the_package(engine_python: Path, tiny: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "vllm.py").write_text("raise ModuleNotFoundError(\"No module named 'vllm'\", name='vllm')\n")
    env = {**clean_env(), "PYTHONPATH": str(tmp_path)}
    done = run_trace(engine_python, "--model", str(tiny["llama"]), "--tp", "1", "--rank", "0", env=env)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("trace_model: cannot import vllm"), done.stderr


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


def test_timings_are_reported(traces: Traces) -> None:
    for key, result in traces.items():
        assert 0 < result["seconds"]["total"] < 120, (key, result["seconds"])
    print("\n" + json.dumps(TIMINGS, indent=1), file=sys.stderr)


# ---------------------------------------------------------------- the engine-venv side (run with vLLM's python)

ENGINE_SIDE = r'''
"""Engine-venv helper for test_vllm_trace.py: argv[1] is weightsync_engine/trace.py (vLLM's trace_model through it,
for its run and build recipe)."""
import importlib.util, json, sys, time
from pathlib import Path

spec = importlib.util.spec_from_file_location("weightsync_engine_trace", sys.argv[1])
entry = importlib.util.module_from_spec(spec)
spec.loader.exec_module(entry)
tm = entry.engine_module("vllm")


def trace(model_dir, jobs_file):
    """Each job traced by the script's own ``run`` (what its CLI calls), in this one process."""
    results = []
    for job in json.loads(Path(jobs_file).read_text()):
        started = time.monotonic()
        result = tm.run(Path(model_dir), job["tp"], job["rank"], job["dtype"])
        result["seconds"]["wall"] = round(time.monotonic() - started, 2)
        results.append(result)
    return results


def diff(model_dir, jobs_file):
    vl = tm.import_vllm()
    torch = vl.torch
    shapes = tm.core.read_checkpoint(Path(model_dir))
    generator = torch.Generator().manual_seed(7)
    sources = {n: torch.randn(s, generator=generator).to(torch.bfloat16) for n, s in shapes.items()}
    results = []
    for job in json.loads(Path(jobs_file).read_text()):
        started = time.monotonic()
        trace = json.loads(Path(job["trace"]).read_text())
        model, _ = tm.build_model(vl, Path(model_dir), job["tp"], job["rank"], "bfloat16", tm.core.Workarounds())
        with torch.no_grad():
            for p in model.parameters():
                p.data.fill_(float("nan"))
        # vLLM's own load path (DefaultModelLoader.load_weights: model.load_weights over the checkpoint, then every
        # parameter must be reported loaded); process_weights_after_loading is not run (CPU repacks linear weights).
        weights = ((n, t.clone()) for n, t in sources.items())  # a loader may change its input in place
        loaded = model.load_weights(weights)
        not_loaded = sorted(n for n, _ in model.named_parameters() if n not in loaded)
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
            "tp": job["tp"], "rank": job["rank"], "checked": checked, "untraced": untraced, "not_loaded": not_loaded,
            "mismatched": mismatched, "seconds": round(time.monotonic() - started, 2),
        })
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
