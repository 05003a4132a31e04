"""Which of stock SGLang's architectures weightsync can sync: the registry coverage table.

The table is docs/engines/sglang-coverage.md.

For every architecture in SGLang's model registry that ``transformers`` can build as a causal LM here, from its
default config shrunk to a tiny one (:data:`TINY`), the engine-venv side of this file:

1. builds the model with ``transformers`` (seeded random weights) and saves a safetensors checkpoint;
2. traces SGLang's own model class at a few (TP, rank) cases (:data:`CASES`) with ``weightsync_engine.sglang.
   trace_model``'s functions (loaded through ``weightsync_engine/trace.py``), in one process;
3. where nothing is refused, loads seeded random HF tensors through SGLang's own loader
   (``DefaultModelLoader.load_weights_and_postprocess``) into a replica of each traced rank and checks every
   parameter against assembly from the traced parts (cut, placed at ``at``, zero padding), bit for bit.

Each architecture ends as ``synced`` (bit-exact at every case), ``refused`` (the trace's first reason, naming
the parameter), ``mismatch`` (the trace accepted what SGLang's load contradicts: a bug to fix), or
``not built`` (no tiny config here: not a causal LM in ``transformers``, a constructor that needs a GPU
kernel, ...). ``synced`` means what a weightsync replica writes is exactly what SGLang's own load puts in
every parameter; the live rounds into a running server are in tests/engines/sglang (Llama, Qwen3).

Two sides in one file, as :mod:`weightsync_testing.sglang_models`: the project side (stdlib only) runs this
file with the SGLang venv's python and renders the table; the engine side never imports weightsync.

    python -m weightsync_testing.sglang_coverage --python <sglang venv python> \
        --markdown docs/engines/sglang-coverage.md
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any


def _sibling(name: str) -> Any:
    """A module beside this file, loaded by path: the engine venv runs this file with no weightsync installed."""
    spec = importlib.util.spec_from_file_location(f"_weightsync_{name}", Path(__file__).with_name(f"{name}.py"))
    if spec is None or spec.loader is None:
        raise ImportError(f"{name}.py is not beside {__file__}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: What this survey shares with vLLM's (weightsync_testing.coverage_common): tiny configs, statuses, the runner.
_COMMON: Any = _sibling("coverage_common")
_MODELS: Any = _COMMON.MODELS
#: (TP size, rank) traced per architecture: the last rank is where vocab padding and KV-head replication show.
CASES: tuple[tuple[int, int], ...] = _COMMON.CASES
#: (TP size, rank, EP size) checked through the engine replica for MoE architectures (SGLang's ``--ep-size``: the
#: 8 experts split over 2 or 8 ranks).
EP_CASES: tuple[tuple[int, int, int], ...] = ((2, 1, 2), (8, 7, 8))
#: (TP size, rank, DP size, EP size) checked with SGLang's DP attention (``--enable-dp-attention --dp-size``:
#: attention split over TP / DP ranks, each DP group whole) through the engine replica, for the MoE architectures EP
#: syncs: DeepSeek-V3 and Kimi-K2 are served so (TP 8, DP 8, EP 8).
DP_CASES: tuple[tuple[int, int, int, int], ...] = ((2, 1, 2, 1), (8, 7, 8, 8))
#: Model types that ship FP8 block checkpoints (DeepSeek-V3, Kimi-K2, Qwen3 and Qwen3-MoE's FP8 releases): also checked
#: as an FP8 block target from BF16 trainer tensors, quantized by weightsync's quantizer, at every case above.
FP8_FAMILIES = ("deepseek_v3", "kimi_k2", "qwen3", "qwen3_moe")
#: The tiny models' FP8 block: it must divide every quantized weight at every case (the MoE experts' 64 rows over 8
#: TP ranks are 8); the published checkpoints use 128 x 128.
FP8_BLOCK = (8, 8)
#: Config keys that make an architecture MoE (its expert count).
EXPERT_KEYS: tuple[str, ...] = _COMMON.EXPERT_KEYS
#: Overrides applied to an architecture's default config, only for keys the config has.
TINY: dict[str, Any] = _COMMON.TINY
#: Per model type, what its tiny config also needs to build on CPU.
FAMILY: dict[str, dict[str, Any]] = _COMMON.FAMILY
#: A replica check's weights: (what the engine held before the round, what the round sends), HF-named.
Rounds = tuple[dict[str, Any], dict[str, Any]]
MAX_PARAMETERS: int = _COMMON.MAX_PARAMETERS
STATUSES: tuple[str, ...] = _COMMON.STATUSES
NO_CAUSAL_LM: str = _COMMON.NO_CAUSAL_LM
#: SGLang's ``--custom-weight-loader`` value that runs its own alias rebind in a round (engine/weightsync_engine/sglang/
#: aliases.py ``LOADER_PATH``; spelled here too: the project side does not import the engine root).
REBIND_LOADER = "weightsync_engine.sglang.aliases.rebind_parameter_aliases"


# ---------------------------------------------------------------- project side


def survey(
    python: str | Path, archs: Sequence[str] = (), timeout: float = 7200.0, progress: bool = True
) -> list[dict[str, Any]]:
    """One row per architecture (``arch``, ``status``, ``reason``, ``cases``, ``seconds``), streamed from the engine
    side; a progress bar on stderr while it runs."""
    rows: list[dict[str, Any]] = _COMMON.survey(
        __file__, python, archs, engine="SGLang", timeout=timeout, progress=progress
    )
    return rows


def render(rows: Sequence[dict[str, Any]], versions: dict[str, str] | None = None) -> str:
    """The Markdown page: counts, then one row per architecture."""
    cases = ", ".join(f"TP {t} rank {r}" for t, r in CASES)
    intro = [
        "For every architecture in SGLang's model registry that `transformers` builds as a causal LM from its default",
        "config shrunk to a tiny one (vocab 512, hidden 128, 2 layers, 8 heads / 4 KV heads, head_dim 16, 8 experts;",
        "word embeddings tied as the config's default says, and each family's own settings where they ship otherwise),",
        f"the shard map is traced from SGLang's own model class at {cases}, and where nothing is refused, SGLang's own",
        "loader (`DefaultModelLoader.load_weights_and_postprocess`) loads seeded random HF tensors into each traced",
        "rank, which must equal, bit for bit and parameter by parameter, the assembly from the traced parts that a",
        "weightsync replica writes (**trace**). Where the trace refuses, the **engine replica** is checked at the same",
        "ranks: SGLang's own `load_weights` on the source, its parameters written into an engine that held other",
        "weights, SGLang's own end-of-session processing; every parameter, buffer and tensor attribute must then equal",
        "SGLang's own full load, bit for bit; such a row also says whether a source loads the feed a decoder layer",
        "at a time and gives each layer back (`load_weights` one layer at a time, in reverse order, leaves the bytes",
        "one call does; [engine replicas](engine-replicas.md)).",
        "MoE architectures are also checked with expert parallelism "
        f"({', '.join(f'TP {t} rank {r} EP {e}' for t, r, e in EP_CASES)}) through the engine replica, and those EP",
        "syncs with SGLang's DP attention ("
        + ", ".join(f"TP {t} rank {r} DP {d}" + (f" EP {e}" if e > 1 else "") for t, r, d, e in DP_CASES)
        + "). The families",
        f"that ship FP8 block checkpoints ({', '.join(FP8_FAMILIES)}) are also checked as an FP8 block target",
        f"({FP8_BLOCK[0]} x {FP8_BLOCK[1]} blocks): the checkpoint and both rounds quantized from BF16 by weightsync's",
        "quantizer, through the engine replica at every case, against SGLang's own load of the FP8 checkpoint.",
        "A trace whose only refusals are buffers SGLang's own `_rebind_parameter_aliases` re-derives (Gemma-2's",
        "`gemma_weight`) is checked with that rebind after the writes (a server started with weightsync's custom",
        "weight loader, [sglang](sglang.md#derived-buffers-gemma-2)): every parameter, buffer and tensor attribute",
        "against SGLang's own full load. Live rounds into a running SGLang server are tested for Llama, Qwen3,",
        "DeepSeek-V3 and Gemma-2 ([testing](sglang-testing.md)); the methods are in [trace](sglang-trace.md) and",
        "[engine replicas](engine-replicas.md).",
    ]
    page: str = _COMMON.page(rows, versions, engine="SGLang", module="sglang_coverage", intro=intro, cell=_cell)
    return page


def _cell(row: dict[str, Any]) -> str:
    """A row's detail: which path syncs it and how it was checked, or why not."""
    detail = " ".join(str(row.get("reason") or "").split()).replace("|", "\\|")
    last = f"TP {CASES[-1][0]} rank {CASES[-1][1]}"
    if row["status"] == "synced" and row.get("path") == "engine replica":
        detail = (
            f"engine replica: every parameter, buffer and tensor attribute bit-exact after SGLang's "
            f"end-of-session processing ({row.get('parameters', '?')} parameters on {last}); the trace refuses "
            f"{detail[:160]}"
        )
        layerwise = str(row.get("layerwise") or "")
        if layerwise.endswith(" groups"):
            detail += f"; its feed loads a layer at a time ({layerwise})"
        elif layerwise:
            detail += f"; its feed loads at once (a layer at a time {layerwise})"
    elif row["status"] == "synced" and row.get("rebind"):
        rebound = row["rebind"]
        detail = (
            f"trace, into a server started with `--custom-weight-loader {REBIND_LOADER}` (refused without it): every "
            f"parameter bit-exact ({row.get('parameters', '?')} on {last}); SGLang's own `_rebind_parameter_aliases` "
            f"after the writes re-derives {len(rebound)} buffers ({rebound[0]}, ...): every parameter, buffer and "
            "tensor attribute bit-exact after SGLang's end-of-session processing"
        )
    elif row["status"] == "synced":
        detail = f"trace: every parameter bit-exact ({row.get('parameters', '?')} on {last})"
    if row.get("ep"):
        detail += f"; with EP {' and '.join(str(e) for e in row['ep'])}: engine replica, bit-exact"
    elif row.get("ep_not_built"):
        detail += f"; EP not built here: {row['ep_not_built']}"
    if row.get("dp_not_built"):
        detail += f"; DP attention not built here: {row['dp_not_built'][:160]}"
    elif row.get("dp"):
        detail += f"; with DP attention ({', '.join(row['dp'])}): engine replica, bit-exact"
    if row.get("fp8_not_built"):
        detail += f"; FP8 block target not built here: {row['fp8_not_built'][:160]}"
    elif row.get("fp8"):
        detail += f"; FP8 block target from BF16 ({', '.join(row['fp8'])}): engine replica, bit-exact"
    return detail[:760]


def main(argv: list[str] | None = None) -> int:
    return int(
        _COMMON.main(
            argv,
            prog="sglang_coverage",
            doc=__doc__,
            engine="SGLang",
            python_env="WEIGHTSYNC_SGLANG_PYTHON",
            engine_rows=_engine,
            survey=survey,
            render=render,
        )
    )


# ---------------------------------------------------------------- engine-venv side


def _engine(trace_script: Path, only: Sequence[str]) -> Iterator[dict[str, Any]]:
    # The entry script registers the engine root from its own directory (SGLang's Python does not have it).
    entry: Any = _COMMON.load_entry(trace_script)
    tm: Any = entry.engine_module("sglang")
    sg = tm.import_sglang()
    torch = sg.torch
    transformers: Any = importlib.import_module("transformers")
    registry: Any = importlib.import_module("sglang.srt.models.registry").ModelRegistry
    model_type_of: dict[str, str] = _COMMON.causal_lm_types(transformers)
    archs = sorted(only or registry.models)
    versions = {"sglang": sg.version, "transformers": transformers.__version__, "torch": torch.__version__}
    yield {"total": len(archs)}
    for arch in archs:
        started = time.monotonic()
        try:
            row = _one(tm, sg, transformers, arch, model_type_of.get(arch))
        except Exception as exc:  # one architecture's failure is its row, never the survey's end
            row = {"status": "not built", "reason": _why(exc)}
        row.update(arch=arch, seconds=round(time.monotonic() - started, 1), versions=versions)
        row.pop("trace", None)
        yield row


def _one(tm: Any, sg: Any, transformers: Any, arch: str, model_type: str | None) -> dict[str, Any]:
    torch = sg.torch
    if arch not in sg_registry_archs(sg):
        return {"status": "not built", "reason": "not in this SGLang's model registry"}
    if model_type is None:
        return {"status": "not built", "reason": NO_CAUSAL_LM}
    with tempfile.TemporaryDirectory(prefix="weightsync-coverage-") as work:
        model_dir = Path(work)
        defaults = _COMMON.tiny_checkpoint(torch, transformers, arch, model_type, model_dir)
        if isinstance(defaults, str):
            return {"status": "not built", "reason": defaults}
        sources = tm.read_checkpoint(model_dir)
        # (what the engine held before a replica round: other seeded weights, what the round sends)
        rounds: Rounds = _COMMON.seeded_rounds(torch, sources)
        values = rounds[1]
        traced: dict[tuple[int, int], list[dict[str, Any]]] = {}
        rebound: set[str] = set()  # buffers the trace leaves to SGLang's own rebind (Gemma-2's gemma_weight)
        for tp, rank in CASES:
            try:
                found = _trace(tm, sg, model_dir, sources, tp, rank)
            except tm.TraceError as exc:
                return {"status": "not built", "reason": f"TP {tp}: {exc}"}
            except Exception as exc:  # SGLang's constructor cannot build it here (CPU, no kernels)
                return {"status": "not built", "reason": f"TP {tp}: {_why(exc)}"}
            if isinstance(found, str):
                refusal = f"TP {tp} rank {rank}: {found}"
                row = _with_ep(sg, model_dir, rounds, defaults, _replica(sg, model_dir, rounds, refusal))
                return _with_fp8(sg, model_dir, rounds, model_type, _with_dp(sg, model_dir, rounds, row))
            traced[tp, rank], rederived = found
            rebound |= set(rederived)
        parameters = 0
        for (tp, rank), tensors in traced.items():
            bad = _differential(tm, sg, model_dir, values, tp, rank, tensors)
            if bad:
                return {"status": "mismatch", "reason": f"TP {tp} rank {rank}: SGLang's load differs in {bad[:3]}"}
            parameters = len(tensors)
        synced = {"status": "synced", "reason": "", "parameters": parameters, "path": "trace"}
        if rebound:
            synced = _with_rebind(sg, model_dir, rounds, sorted(rebound), synced)
        row = _with_dp(sg, model_dir, rounds, _with_ep(sg, model_dir, rounds, defaults, synced))
        return _with_fp8(sg, model_dir, rounds, model_type, row)


def _with_rebind(sg: Any, model_dir: Path, rounds: Rounds, rebound: list[str], row: dict[str, Any]) -> dict[str, Any]:
    """A trace whose only refusals are buffers SGLang's own ``_rebind_parameter_aliases`` re-derives (``rebind``:
    synced into a server started with weightsync's custom weight loader, ``aliases.LOADER_PATH``; refused without it):
    the whole round checked at every case, the rebind between the writes and SGLang's end-of-session processing
    (``replica_model.check(with_rebind=True)``; the written parameters are the traced ones, bit-exact above), every
    parameter, buffer and tensor attribute against SGLang's own full load; else what :func:`_check` says."""
    for tp, rank in CASES:
        checked = _check(sg, model_dir, rounds, tp, rank, with_rebind=True)
        if isinstance(checked, tuple):
            status, detail = checked
            return {"status": status, "reason": f"trace with SGLang's rebind: TP {tp} rank {rank}: {detail}"}
    return {**row, "rebind": rebound}


def _with_ep(sg: Any, model_dir: Path, rounds: Rounds, defaults: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """A synced MoE architecture, also checked with expert parallelism (:data:`EP_CASES`) through the engine
    replica: ``ep`` lists the EP sizes synced, ``ep_not_built`` says why SGLang could not build one here, or the
    row becomes what :func:`_check` says."""
    if row["status"] != "synced" or not any(defaults.get(key) for key in EXPERT_KEYS):
        return row
    experts: dict[str, list[int]] = {}
    for tp, rank, ep in EP_CASES:
        try:
            checked = _check(sg, model_dir, rounds, tp, rank, ep)
        except Exception as exc:  # SGLang cannot build or load this EP layout here (CPU): said, not hidden
            return {**row, "ep_not_built": f"TP {tp} rank {rank} EP {ep}: {_why(exc)}"}
        if isinstance(checked, tuple):
            status, detail = checked
            return {"status": status, "reason": f"engine replica: TP {tp} rank {rank} EP {ep}: {detail}"}
        fused = [p["shape"] for p in checked["layout"] if ".experts." in p["name"] and len(p["shape"]) == 3]
        experts[str(ep)] = fused[0] if fused else []
    # ``ep_experts``: per EP size, the first fused expert parameter's shape (experts held by the rank first).
    return {**row, "ep": [ep for _, _, ep in EP_CASES], "ep_experts": experts}


def _with_dp(sg: Any, model_dir: Path, rounds: Rounds, row: dict[str, Any]) -> dict[str, Any]:
    """A MoE architecture EP syncs, also checked with DP attention (:data:`DP_CASES`) through the engine replica:
    ``dp`` lists the cases synced, ``dp_not_built`` says why SGLang could not build one here, or the row becomes what
    :func:`_check` says."""
    if row["status"] != "synced" or not row.get("ep"):
        return row
    checks = [
        (f"TP {tp} rank {rank} DP {dp}" + (f" EP {ep}" if ep > 1 else ""),
         functools.partial(_check, sg, model_dir, rounds, tp, rank, ep, dp=dp))
        for tp, rank, dp, ep in DP_CASES
    ]  # fmt: skip
    return _more_cases(row, "dp", "engine replica with DP attention", checks)


def _more_cases(
    row: dict[str, Any], key: str, what: str, checks: Sequence[tuple[str, Callable[[], Any]]]
) -> dict[str, Any]:
    """A synced row checked at more cases (``(case, check)``, each a :func:`_check`): ``key`` lists the cases that are
    bit-exact, ``<key>_not_built`` says why SGLang could not build one here (CPU: said, not hidden), and a difference
    becomes the row's status, named ``what: case: detail``."""
    done: list[str] = []
    for case, check in checks:
        try:
            checked = check()
        except Exception as exc:
            return {**row, key: done, f"{key}_not_built": f"{case}: {_why(exc)}"}
        if isinstance(checked, tuple):
            status, detail = checked
            return {"status": status, "reason": f"{what}: {case}: {detail}"}
        done.append(case)
    return {**row, key: done}


def _with_fp8(sg: Any, model_dir: Path, rounds: Rounds, model_type: str, row: dict[str, Any]) -> dict[str, Any]:
    """A synced architecture of :data:`FP8_FAMILIES`, also checked as an FP8 block target: the checkpoint and both
    rounds quantized by weightsync's quantizer (:data:`FP8_BLOCK`), through the engine replica at every case (a
    quantized checkpoint always takes it), against SGLang's own load of the FP8 checkpoint. ``fp8`` lists the cases
    that are bit-exact; ``fp8_not_built`` says why SGLang could not build one here; a difference is the row's."""
    if row["status"] != "synced" or model_type not in FP8_FAMILIES:
        return row
    old, new = rounds
    quantized = (_MODELS.fp8_state(old, FP8_BLOCK), _MODELS.fp8_state(new, FP8_BLOCK))
    with tempfile.TemporaryDirectory(prefix="weightsync-coverage-fp8-") as work:
        fp8_dir = Path(work)
        _MODELS.fp8_checkpoint(model_dir, fp8_dir, FP8_BLOCK)
        checks = [
            (f"TP {tp} rank {rank}" + (f" EP {ep}" if ep > 1 else ""),
             functools.partial(_check, sg, fp8_dir, quantized, tp, rank, ep, keeps=KV_CACHE_SCALES))
            for tp, rank, ep in [*((t, r, 1) for t, r in CASES), *(EP_CASES if row.get("ep") else ())]
        ]  # fmt: skip
        return _more_cases(row, "fp8", "FP8 block target: engine replica", checks)


#: What an FP8 checkpoint without KV-cache scales leaves to the engine: SGLang's own load keeps these parameters'
#: defaults (the KV cache unscaled), and so does a round (``EngineReplica.kept``).
KV_CACHE_SCALES = (".k_scale", ".v_scale")


def _check(
    sg: Any,
    model_dir: Path,
    rounds: Rounds,
    tp: int,
    rank: int,
    ep: int = 1,
    keeps: tuple[str, ...] = (),
    *,
    dp: int = 1,
    with_rebind: bool = False,
) -> Any:
    """``replica_model.check`` at one case, ``rounds`` = (what the engine held, what the round sends): its result when
    everything is bit-exact, else ``(status, detail)``: ``refused`` when a parameter is written by no HF tensor
    (the engine would keep its own values: never synced silently) or when only derived state (buffers, tensor
    attributes) is left stale by SGLang's session (the engine derives it in ``load_weights``, which one-sided
    writes do not run, and its end-of-session processing does not re-derive it); ``mismatch`` for a parameter
    that differs (a bug to fix). ``keeps``: name suffixes of unwritten parameters the engine keeps as its own load
    does (:data:`KV_CACHE_SCALES` of an FP8 target). ``with_rebind``: SGLang's alias rebind runs after the writes
    (weightsync's custom weight loader, :func:`_with_rebind`)."""
    rm: Any = importlib.import_module("weightsync_engine.sglang.replica_model")
    old, new = rounds
    checked = rm.check(sg, model_dir, tp, rank, "bfloat16", old, new, ep=ep, dp=dp, with_rebind=with_rebind)
    found = checked["differences"]
    own = [name for name in checked["unwritten"] if not name.endswith(keeps)]  # endswith(()) is False: keeps all

    def first(items: list[str]) -> str:
        return f"{items[0]} (and {len(items) - 1} more)" if len(items) > 1 else items[0]

    if [d for d in found if d.startswith("parameter ")]:
        return "mismatch", first(found)
    if own:
        return "refused", f"parameter {first(own)}: no HF tensor writes it (the engine would keep its own values)"
    if found:
        return "refused", f"{first(found)}: derived in load_weights and not re-derived by SGLang's session"
    return checked


def _replica(sg: Any, model_dir: Path, rounds: Rounds, refusal: str) -> dict[str, Any]:
    """Where the trace refuses: the engine-replica path at every case (``replica_model.check``: SGLang's own
    ``load_weights`` on the source, the loader layout written into an engine that held other weights, SGLang's
    end-of-session processing), against SGLang's own full load. ``synced`` (with ``rederived``: what the end of the
    session had to re-derive) when every parameter, buffer and tensor attribute is bit-exact at every case;
    otherwise what :func:`_check` says, or ``refused`` when SGLang's own load fails on a rank."""
    checked: Any = None
    rederived: set[str] = set()
    for tp, rank in CASES:
        try:
            checked = _check(sg, model_dir, rounds, tp, rank)
        except Exception as exc:  # the engine's own load fails on this rank: no replica either
            return {"status": "refused", "reason": f"{refusal}; engine replica: TP {tp} rank {rank}: {_why(exc)}"}
        if isinstance(checked, tuple):
            status, detail = checked
            reason = f"engine replica: TP {tp} rank {rank}: {detail}"
            return {"status": status, "reason": f"{refusal}; {reason}" if status == "refused" else reason}
        # At some ranks a derived attribute is a view of the parameter (DeepSeek's w_vc with one head per rank):
        # the writes update it, and only the other ranks show it stale before the end of the session.
        rederived |= {d.split(":")[0] for d in checked["before_end"]}
    return {"status": "synced", "reason": refusal, "parameters": checked["parameters"], "path": "engine replica",
            "rederived": sorted(rederived), "layerwise": _layerwise(sg, model_dir, rounds)}  # fmt: skip


def _layerwise(sg: Any, model_dir: Path, rounds: Rounds) -> str:
    """Whether a source may load this model's feed a decoder layer at a time and give each layer back (what the
    engine pod's layout check decides, ``replica_model.layerwise_difference``), at the last case: ``"N groups"``, or
    why not."""
    rm: Any = importlib.import_module("weightsync_engine.sglang.replica_model")
    tp, rank = CASES[-1]
    _, found = rm.checked_layer_groups(sg, model_dir, tp, rank, "bfloat16", rounds[1])
    return str(found)


def _why(exc: BaseException) -> str:
    """``Type: first line (at file:line in function)``, the innermost frame: where SGLang or transformers gave up."""
    why: str = _COMMON.why(exc)
    return why


def sg_registry_archs(sg: Any) -> set[str]:
    return set(importlib.import_module("sglang.srt.models.registry").ModelRegistry.models)


def _trace(tm: Any, sg: Any, model_dir: Path, sources: dict[str, Any], tp: int, rank: int) -> Any:
    """(the traced tensors of (tp, rank), the refused buffers SGLang's own rebind re-derives), or the first refusal as a
    string when anything else is refused."""
    aliases: Any = importlib.import_module("weightsync_engine.sglang.aliases")
    workarounds = tm.Workarounds()
    engine_model, _ = tm.build_model(sg, model_dir, tp, rank, "bfloat16", workarounds)
    layout = tm.param_layout(engine_model)
    del engine_model
    model, _ = tm.build_model(sg, model_dir, tp, rank, "float32", workarounds)
    tensors, refused, _ = tm.trace_replica(sg.torch, model, sources, layout, "bfloat16")
    if refused and any(tm.core.BUFFER_CHANGED in r["reason"] for r in refused):
        # The trace's own marking (trace_model.mark_rederived), on the traced replica with every layer.
        refused = aliases.mark(refused, set(aliases.rederived_buffers(sg.torch, model, sources)), {})
    rebound = [r["name"] for r in refused if r.get("rederived_by")]
    refused = [r for r in refused if not r.get("rederived_by")]
    if refused:
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        return f"{refused[0]['name']}: {refused[0]['reason']}{more}"
    return tensors, rebound


def _differential(
    tm: Any, sg: Any, model_dir: Path, values: dict[str, Any], tp: int, rank: int, tensors: list[dict[str, Any]]
) -> list[str]:
    """Parameters where SGLang's own load differs from assembly from the traced parts (empty: bit-exact)."""
    torch = sg.torch
    loader: Any = importlib.import_module("sglang.srt.model_loader.loader")
    model, _ = tm.build_model(sg, model_dir, tp, rank, "bfloat16", tm.Workarounds())
    with torch.no_grad():
        for param in model.parameters():
            param.data.fill_(float("nan"))
    weights = ((n, t.clone()) for n, t in values.items())  # a loader may change its input in place
    loader.DefaultModelLoader.load_weights_and_postprocess(model, weights, torch.device("cpu"))
    traced = {t["name"]: t for t in tensors}
    bad = []
    for name, param in model.named_parameters():
        entry = traced.get(name)
        if entry is None:
            bad.append(name)
            continue
        built = torch.zeros(entry["shape"], dtype=getattr(torch, entry["dtype"]))
        along: dict[tuple[int, ...], int] = {}
        for part in entry["parts"]:  # assembled here, independently of weightsync's own placement code
            at = tuple(part["at"])
            dim = entry["cat_dim"] - len(at)
            piece = values[part["source"]].narrow(part["dim"], part["start"], part["length"])
            (built[at] if at else built).narrow(dim, along.get(at, 0), piece.shape[dim]).copy_(piece)
            along[at] = along.get(at, 0) + piece.shape[dim]
        same = (
            list(param.shape) == entry["shape"]
            and param.dtype == built.dtype
            and torch.equal(param.data.contiguous().reshape(-1).view(torch.uint8), built.reshape(-1).view(torch.uint8))
        )
        if not same:
            bad.append(name)
    return bad


if __name__ == "__main__":
    # Run as a file with the engine's python, this directory is sys.path[0]: nothing here may shadow a module.
    if sys.path and Path(sys.path[0] or os.curdir).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    sys.exit(main())
