"""Which of stock vLLM's architectures weightsync can sync: the registry coverage table.

The table is docs/engines/vllm-coverage.md. The method is the SGLang survey's
(:mod:`weightsync_testing.sglang_coverage`), on the path weightsync takes into vLLM.

For every architecture in vLLM's model registry that ``transformers`` can build as a causal LM here, from its
default config shrunk to a tiny one (``coverage_common.TINY``, shared with the SGLang survey), the engine-venv side
of this file:

1. builds the model with ``transformers`` (seeded random weights) and saves a safetensors checkpoint;
2. **staged path** (the row's status), at :data:`CASES` (one process, the parallel groups faked as
   ``weightsync_engine.vllm.trace_model.build_model`` does): model A loads one set of seeded random HF tensors
   (``load_weights`` + ``process_weights_after_loading``, vLLM's first load) and then takes another set through
   vLLM's layerwise reload (``initialize_layerwise_reload``, ``load_weights``, ``finalize_layerwise_reload``: what
   weightsync's staged path and vLLM's own weight-transfer engines run); model B loads that other set fresh. Every
   parameter, buffer and tensor attribute of A must equal B's, bit for bit;
3. **live path** (detail only): the shard-map trace at the same cases against vLLM's own ``load_weights`` (without
   ``process_weights_after_loading``), bit for bit, as the SGLang survey's trace;
4. for MoE architectures: the staged check at TP 1 again without weightsync's CPU MoE reload fix
   (``weightsync_engine.vllm.cpu_moe_reload``, installed for everything else as weightsync's plugin installs it in
   the server), naming what stock vLLM's reload leaves different; and the staged check with expert parallelism
   (:data:`EP_CASE`).

The survey process turns vLLM's CPU oneDNN linear repacking off (``vllm._custom_ops._supports_onednn = False``, as
the test-only plugin ``tests/engines/vllm/plain_linears_plugin`` does): with it on, ``process_weights_after_loading``
moves every 2-D linear weight into an opaque oneDNN handle and empties ``layer.weight``, so nothing could be
compared; the linears then run ``torch.nn.functional.linear`` on the weight vLLM keeps. The repack after a reload is
covered by the real-server tests, which compare generation with HF.

Statuses: ``synced`` (bit-exact at every case), ``refused`` (vLLM's own reload leaves state differing from a fresh
load, named; or fails), ``mismatch`` (what weightsync itself contributes, the MoE reload fix, leaves an expert
different: a bug to fix), ``not built`` (vLLM cannot build or load it here, or no tiny config).

Two sides in one file, as the SGLang survey: the project side (stdlib only, and ``rich``) runs this file with the
vLLM venv's python and renders the table; the engine side never imports weightsync.

    python -m weightsync_testing.vllm_coverage --python <vllm venv python> --markdown docs/engines/vllm-coverage.md
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
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


_COMMON: Any = _sibling("coverage_common")
#: (TP size, rank) checked per architecture (the SGLang survey's).
CASES: tuple[tuple[int, int], ...] = _COMMON.CASES
#: (TP size, rank) checked again with ``enable_expert_parallel`` for MoE architectures (EP size = TP size).
EP_CASE = (2, 1)
EXPERT_KEYS: tuple[str, ...] = _COMMON.EXPERT_KEYS
STATUSES: tuple[str, ...] = _COMMON.STATUSES
NO_CAUSAL_LM: str = _COMMON.NO_CAUSAL_LM
#: Parameters that weightsync's CPU MoE reload fix re-derives (the CPU experts' prepacked weights).
FIXED_BY_WEIGHTSYNC = (".w13_weight", ".w2_weight")
Rounds = tuple[dict[str, Any], dict[str, Any]]


# ---------------------------------------------------------------- project side


def survey(
    python: str | Path, archs: Sequence[str] = (), timeout: float = 7200.0, progress: bool = True
) -> list[dict[str, Any]]:
    """One row per architecture (``arch``, ``status``, ``reason``, ``live``, ``seconds``, and for MoE
    ``stock_reload_differs`` and ``ep``/``ep_not_built``), streamed from the engine side; a progress bar on stderr."""
    rows: list[dict[str, Any]] = _COMMON.survey(
        __file__, python, archs, engine="vLLM", timeout=timeout, progress=progress
    )
    return rows


def render(rows: Sequence[dict[str, Any]], versions: dict[str, str] | None = None) -> str:
    """The Markdown page: counts, then one row per architecture."""
    cases = ", ".join(f"TP {t} rank {r}" for t, r in CASES)
    intro = [
        "For every architecture in vLLM's model registry that `transformers` builds as a causal LM from its default",
        "config shrunk to a tiny one (the [SGLang survey](sglang-coverage.md)'s: vocab 512, hidden 128, 2 layers,",
        "8 heads / 4 KV heads, head_dim 16, 8 experts; each family's own settings where they ship otherwise), vLLM's",
        f"own model class is built on CPU at {cases} (one process, the parallel groups faked as the",
        "[trace](vllm-trace.md) does) and the **staged path** is checked: a model that loaded seeded random HF",
        "tensors (vLLM's `load_weights` and `process_weights_after_loading`) takes other seeded tensors through",
        "vLLM's layerwise reload (`initialize_layerwise_reload`, `load_weights`, `finalize_layerwise_reload`: what",
        "weightsync's staged path runs), and every parameter, buffer and tensor attribute must then equal, bit for",
        "bit, a fresh model's first load of those tensors (**synced**). **refused**: vLLM's own reload leaves the",
        "named state different from a fresh load (or fails); **mismatch**: what weightsync adds (its CPU MoE reload",
        "fix) leaves a difference. The **live path** (detail): the shard map traced from vLLM's class at the same",
        "ranks must equal vLLM's own `load_weights` bit for bit, as in the SGLang survey.",
        "",
        "Stock vLLM 0.32's CPU MoE experts are not re-prepacked by a reload (`UnquantizedFusedMoEMethod` sets its",
        "kernel up only on the first load), so a reload leaves `w13_weight`/`w2_weight` in the checkpoint layout;",
        "the survey runs with weightsync's gated fix installed (`weightsync_engine/vllm/cpu_moe_reload.py`, as",
        "weightsync's plugin installs it in the server) and, for every MoE architecture, repeats the TP 1 check",
        "without it, to name what stock vLLM's reload leaves different. MoE architectures are also checked with",
        f"expert parallelism (`enable_expert_parallel`, TP {EP_CASE[0]} rank {EP_CASE[1]}: EP {EP_CASE[0]}).",
        "",
        "The survey turns vLLM's CPU oneDNN linear repacking off (`vllm._custom_ops._supports_onednn = False`, as",
        "the test-only plain-linears plugin does): with it on, `process_weights_after_loading` moves every 2-D",
        "linear weight into an opaque oneDNN handle and empties `layer.weight`, so nothing could be compared. The",
        "oneDNN repack after a reload is covered by the real-server tests, which compare generation with HF",
        "(tests/engines/vllm; [vLLM](vllm.md)).",
    ]
    page: str = _COMMON.page(rows, versions, engine="vLLM", module="vllm_coverage", intro=intro, cell=_cell)
    return page


def _cell(row: dict[str, Any]) -> str:
    """A row's detail: the staged path's result, the live path's, and for MoE what stock vLLM leaves different."""
    detail = " ".join(str(row.get("reason") or "").split())
    if row["status"] == "synced":
        last = f"TP {CASES[-1][0]} rank {CASES[-1][1]}"
        detail = (
            "staged: every parameter, buffer and tensor attribute bit-exact after vLLM's layerwise reload "
            f"({row.get('parameters', '?')} parameters on {last})"
        )
    extras = []
    if row.get("live"):
        extras.append(f"live: {row['live']}")
    if row.get("stock_reload_differs"):
        names = row["stock_reload_differs"]
        kinds = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in names}))
        stock = f"stock vLLM's reload (without weightsync's MoE fix) leaves {len(names)} tensors different ({kinds})"
        extras.append(stock + ("; weightsync's fix makes it bit-exact" if row["status"] == "synced" else ""))
    if row.get("ep"):
        extras.append(f"with EP {EP_CASE[0]}: {row['ep']}")
    elif row.get("ep_not_built"):
        extras.append(f"EP not built here: {row['ep_not_built'][:160]}")
    text = "; ".join([detail[:360], *extras]) if detail else "; ".join(extras)
    return text[:720].replace("|", chr(92) + "|")


def main(argv: list[str] | None = None) -> int:
    return int(
        _COMMON.main(
            argv,
            prog="vllm_coverage",
            doc=__doc__,
            engine="vLLM",
            python_env="WEIGHTSYNC_VLLM_PYTHON",
            engine_rows=_engine,
            survey=survey,
            render=render,
        )
    )


# ---------------------------------------------------------------- engine-venv side


class _Engine:
    """What the engine side holds once: the trace module, vLLM's names, the MoE reload fix."""

    def __init__(self, trace_script: Path) -> None:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        entry: Any = _COMMON.load_entry(trace_script)
        self.tm: Any = entry.engine_module("vllm")
        self.core: Any = importlib.import_module("weightsync_engine.trace_core")
        self.vl: Any = self.tm.import_vllm()
        self.torch: Any = self.vl.torch
        ops: Any = importlib.import_module("vllm._custom_ops")
        if not hasattr(ops, "_supports_onednn"):
            raise RuntimeError("vllm._custom_ops._supports_onednn is gone: the CPU GEMM dispatch changed")
        ops._supports_onednn = False  # linear weights stay plain tensors (module docstring)
        self.fix: Any = importlib.import_module("weightsync_engine.vllm.cpu_moe_reload")
        self.fix.install()
        self.layerwise: Any = importlib.import_module("vllm.model_executor.model_loader.reload.layerwise")
        self.loader_utils: Any = importlib.import_module("vllm.model_executor.model_loader.utils")
        self.set_config: Any = importlib.import_module("vllm.config").set_current_vllm_config
        self.experts: list[int] = []  # the last staged check's first fused expert parameter's shape

    def build(self, model_dir: Path, tp: int, rank: int, expert_parallel: bool = False) -> tuple[Any, Any]:
        kwargs = {"expert_parallel": True} if expert_parallel else {}
        built: tuple[Any, Any] = self.tm.build_model(
            self.vl, model_dir, tp, rank, "bfloat16", self.core.Workarounds(), **kwargs
        )
        return built

    def first_load(self, model: Any, config: Any, weights: dict[str, Any]) -> None:
        """vLLM's first load: ``load_weights`` then ``process_weights_after_loading``, as ``DefaultModelLoader``."""
        torch = self.torch
        with self.set_config(config), self.vl.set_default_torch_dtype(config.model_config.dtype), torch.no_grad():
            model.load_weights((n, t.clone()) for n, t in weights.items())  # a loader may change its input in place
            self.loader_utils.process_weights_after_loading(model, config.model_config, torch.device("cpu"))

    def reload(self, model: Any, config: Any, weights: dict[str, Any]) -> None:
        """vLLM's layerwise reload: what weightsync's staged path (and vLLM's own weight-transfer engines) run."""
        torch = self.torch
        with self.set_config(config), self.vl.set_default_torch_dtype(config.model_config.dtype), torch.no_grad():
            self.layerwise.initialize_layerwise_reload(model)
            model.load_weights((n, t.clone()) for n, t in weights.items())
            self.layerwise.finalize_layerwise_reload(model, config.model_config)


class _BuildError(Exception):
    """vLLM cannot build or first-load the model here (as opposed to its reload failing)."""


def _engine(trace_script: Path, only: Sequence[str]) -> Iterator[dict[str, Any]]:
    en = _Engine(trace_script)
    transformers: Any = importlib.import_module("transformers")
    registry: Any = importlib.import_module("vllm.model_executor.models.registry").ModelRegistry
    supported = set(registry.get_supported_archs())
    model_type_of: dict[str, str] = _COMMON.causal_lm_types(transformers)
    archs = sorted(only or supported)
    versions = {"vllm": en.vl.version, "transformers": transformers.__version__, "torch": en.torch.__version__}
    yield {"total": len(archs)}
    for arch in archs:
        started = time.monotonic()
        row: dict[str, Any]
        try:
            if arch not in supported:
                row = {"status": "not built", "reason": "not in this vLLM's model registry"}
            elif arch not in model_type_of:
                row = {"status": "not built", "reason": NO_CAUSAL_LM}
            else:
                row = _one(en, transformers, arch, model_type_of[arch])
        except Exception as exc:  # one architecture's failure is its row, never the survey's end
            row = {"status": "not built", "reason": _COMMON.why(exc)}
        finally:
            en.fix.install()  # whatever happened in a check without it
        row.update(arch=arch, seconds=round(time.monotonic() - started, 1), versions=versions)
        yield row


def _one(en: _Engine, transformers: Any, arch: str, model_type: str) -> dict[str, Any]:
    torch = en.torch
    with tempfile.TemporaryDirectory(prefix="weightsync-vllm-coverage-") as work:
        model_dir = Path(work)
        defaults = _COMMON.tiny_checkpoint(torch, transformers, arch, model_type, model_dir)
        if isinstance(defaults, str):
            return {"status": "not built", "reason": defaults}
        sources = en.core.read_checkpoint(model_dir)
        rounds: Rounds = _COMMON.seeded_rounds(torch, sources)
        parameters = 0
        row: dict[str, Any] = {}
        for tp, rank in CASES:
            case = f"TP {tp} rank {rank}"
            try:
                differences, parameters = _staged(en, model_dir, rounds, tp, rank)
            except _BuildError as exc:
                return {"status": "not built", "reason": f"{case}: {exc}"}
            except Exception as exc:  # vLLM's reload itself fails on a model it loaded
                row = {"status": "refused", "reason": f"{case}: vLLM's layerwise reload fails: {_COMMON.why(exc)}"}
                break
            if differences:
                row = {"status": _blame(differences, en.fix), "reason": f"{case}: {_first(differences)}"}
                break
        else:
            row = {"status": "synced", "reason": "", "parameters": parameters}
        row["live"] = _live(en, model_dir, sources, rounds[1])
        if any(defaults.get(key) for key in EXPERT_KEYS):
            row |= _moe(en, model_dir, rounds)
        return row


def _blame(differences: list[str], fix: Any) -> str:
    """``mismatch`` when only what weightsync's MoE fix re-derives differs with the fix on, else ``refused``."""
    fixed = [d for d in differences if d.split(" ")[1].endswith(FIXED_BY_WEIGHTSYNC)]
    return "mismatch" if fixed and len(fixed) == len(differences) and fix.wanted() is None else "refused"


def _first(differences: list[str]) -> str:
    """``"parameter X differs after vLLM's layerwise reload (how); also Y, Z (and N more)"``."""
    name, how = differences[0].split(": ", 1)
    others = [d.split(": ", 1)[0].split(" ", 1)[1] for d in differences[1:]]
    also = f"; also {', '.join(others[:2])}" + (f" (and {len(others) - 2} more)" if len(others) > 2 else "")
    return f"{name} differs after vLLM's layerwise reload ({how}){also if others else ''}"


def _moe(en: _Engine, model_dir: Path, rounds: Rounds) -> dict[str, Any]:
    """``stock_reload_differs``: what the TP 1 staged check leaves different without weightsync's fix; ``ep`` (or
    ``ep_not_built``): the staged check with expert parallelism."""
    extra: dict[str, Any] = {}
    en.fix.uninstall()
    try:
        differences, _ = _staged(en, model_dir, rounds, 1, 0)
        extra["stock_reload_differs"] = [d.split(" ", 1)[1].split(":")[0] for d in differences]
    except Exception as exc:  # recorded, never the row's status: the row is about the path weightsync runs
        extra["stock_reload_differs"] = [f"(not checked: {_COMMON.why(exc)})"]
    finally:
        en.fix.install()
    tp, rank = EP_CASE
    try:
        differences, _ = _staged(en, model_dir, rounds, tp, rank, expert_parallel=True)
        extra["ep_experts"] = en.experts  # the first fused expert parameter's shape (experts held by the rank first)
    except Exception as exc:  # vLLM cannot build or load this EP layout here: said, not hidden
        extra["ep_not_built"] = f"TP {tp} rank {rank}: {_COMMON.why(exc)}"
        return extra
    extra["ep"] = "bit-exact" if not differences else f"{_first(differences)}"
    return extra


def _staged(
    en: _Engine, model_dir: Path, rounds: Rounds, tp: int, rank: int, expert_parallel: bool = False
) -> tuple[list[str], int]:
    """(what differs between a reloaded model and a fresh load: ``"parameter NAME: why"`` ..., parameter count)."""
    old, new = rounds
    try:
        reloaded, config = en.build(model_dir, tp, rank, expert_parallel)
        en.first_load(reloaded, config, old)
        fresh, fresh_config = en.build(model_dir, tp, rank, expert_parallel)
        en.first_load(fresh, fresh_config, new)
    except Exception as exc:
        raise _BuildError(_COMMON.why(exc)) from exc
    en.reload(reloaded, config, new)
    want, got = _state(en.torch, fresh), _state(en.torch, reloaded)
    en.experts = next((list(t.shape) for n, t in want.items() if n.endswith(".w13_weight") and t.dim() == 3), [])
    differences = [f"{name}: not after the reload" for name in want if name not in got]
    differences += [f"{name}: not in a fresh load" for name in got if name not in want]
    for name, tensor in want.items():
        if name in got and not _same(en.torch, got[name], tensor):
            differences.append(f"{name}: {_how(got[name], tensor)}")
    return differences, sum(1 for name in want if name.startswith("parameter "))


def _state(torch: Any, model: Any) -> dict[str, Any]:
    """Every parameter, buffer and tensor attribute (a module attribute that is a tensor), by kind and name."""
    state = {f"parameter {n}": p for n, p in model.named_parameters(remove_duplicate=False)}
    state |= {f"buffer {n}": b for n, b in model.named_buffers(remove_duplicate=False)}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for key, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                state[f"attribute {prefix}.{key}" if prefix else f"attribute {key}"] = value
    return state


def _same(torch: Any, a: Any, b: Any) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(
        torch.equal(
            a.detach().reshape(-1).contiguous().view(torch.uint8), b.detach().reshape(-1).contiguous().view(torch.uint8)
        )
    )


def _how(got: Any, want: Any) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{got.dtype}{list(got.shape)}, a fresh load {want.dtype}{list(want.shape)}"
    return "bytes differ"


def _live(en: _Engine, model_dir: Path, sources: dict[str, Any], values: dict[str, Any]) -> str:
    """The live path at every case: the trace's shard map against vLLM's own ``load_weights``."""
    for tp, rank in CASES:
        case = f"TP {tp} rank {rank}"
        try:
            traced = _trace(en, model_dir, sources, tp, rank)
        except Exception as exc:  # the trace cannot build it here
            return f"trace not built at {case}: {_COMMON.why(exc)}"
        if isinstance(traced, str):
            return f"the trace refuses {traced} ({case})"
        bad = _differential(en, model_dir, values, tp, rank, traced)
        if bad:
            return f"trace mismatch at {case}: {', '.join(bad[:3])}" + (
                f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
            )
    return "trace bit-exact"


def _trace(en: _Engine, model_dir: Path, sources: dict[str, Any], tp: int, rank: int) -> Any:
    """The traced tensors of (tp, rank), or the first refusal as a string."""
    tm, vl = en.tm, en.vl
    workarounds = en.core.Workarounds()
    layout_model, _ = tm.build_model(vl, model_dir, tp, rank, "bfloat16", workarounds, device="meta")
    layout = en.core.param_layout(layout_model)
    del layout_model
    model, _ = tm.build_model(vl, model_dir, tp, rank, "float32", workarounds)
    tensors, refused, _ = en.core.trace_replica(en.torch, model, sources, layout, "bfloat16", tm.ENGINE)
    if refused:
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        return f"{refused[0]['name']}: {refused[0]['reason']}{more}"
    return tensors


def _differential(
    en: _Engine, model_dir: Path, values: dict[str, Any], tp: int, rank: int, tensors: list[dict[str, Any]]
) -> list[str]:
    """Parameters where vLLM's own ``load_weights`` differs from assembly from the traced parts, with how (empty:
    bit-exact). Parameters are read after the load: one that ``load_weights`` creates is not in the trace's map."""
    torch = en.torch
    model, config = en.build(model_dir, tp, rank)
    with en.set_config(config), torch.no_grad():
        for param in model.parameters():
            param.data.fill_(float("nan"))
        model.load_weights((n, t.clone()) for n, t in values.items())
    traced = {t["name"]: t for t in tensors}
    bad = []
    for name, param in model.named_parameters():
        entry = traced.get(name)
        if entry is None:  # vLLM's load made it (the trace reads the parameters before loading) or it is untraced
            bad.append(f"{name} (vLLM's load writes it; not in the trace's map)")
            continue
        built = torch.zeros(entry["shape"], dtype=getattr(torch, entry["dtype"]))
        along: dict[tuple[int, ...], int] = {}
        for part in entry["parts"]:  # assembled here, independently of weightsync's own placement code
            at = tuple(part["at"])
            dim = entry["cat_dim"] - len(at)
            piece = values[part["source"]].narrow(part["dim"], part["start"], part["length"])
            (built[at] if at else built).narrow(dim, along.get(at, 0), piece.shape[dim]).copy_(piece)
            along[at] = along.get(at, 0) + piece.shape[dim]
        if not _same(torch, param.data, built):
            bad.append(f"{name} (bytes differ)")
    return bad


if __name__ == "__main__":
    # Run as a file with the engine's python, this directory is sys.path[0]: nothing here may shadow a module.
    if sys.path and Path(sys.path[0] or os.curdir).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    sys.exit(main())
