"""What the registry coverage surveys of SGLang and vLLM share: the tiny configs, the statuses, the subprocess runner.

:mod:`weightsync_testing.sglang_coverage` and :mod:`weightsync_testing.vllm_coverage` each run as a file with the
engine venv's python (where weightsync is not installed) and load this module beside them by path
(:func:`sibling`); so it imports only the standard library at module level (``rich`` on the project side,
``torch``/``transformers`` passed in on the engine side).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

#: (TP size, rank) checked per architecture: the last rank is where vocab padding and KV-head replication show.
CASES: tuple[tuple[int, int], ...] = ((1, 0), (2, 1), (8, 7))
#: Config keys that make an architecture MoE (its expert count).
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
#: Overrides applied to an architecture's default config, only for keys the config has.
TINY: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_experts": 8,  # at least the largest TP traced: SGLang refuses more MoE-TP ranks than experts
    "num_local_experts": 8,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "pad_token_id": 0,  # default special-token ids beyond the tiny vocab would not build an embedding
    "bos_token_id": 1,
    "eos_token_id": 2,
    "n_embd": 128,
    "n_layer": 2,
    "n_head": 8,
    "n_positions": 512,
    "n_inner": 256,
    "ffn_dim": 256,
    "word_embed_proj_dim": 128,
    "d_model": 128,
    "rotary_dim": 16,
}
#: A replica check's weights: (what the engine held before the round, what the round sends), HF-named.
Rounds = tuple[dict[str, Any], dict[str, Any]]
MAX_PARAMETERS = 50_000_000  # a "tiny" config that is still bigger than this was not shrunk by TINY's keys
STATUSES = ("synced", "refused", "mismatch", "not built")
NO_CAUSAL_LM = "transformers has no causal-LM class of this name"


def sibling(name: str) -> Any:
    """A module beside this file, loaded by path: the engine venv runs these files with no weightsync installed."""
    spec = importlib.util.spec_from_file_location(f"_weightsync_{name}", Path(__file__).with_name(f"{name}.py"))
    if spec is None or spec.loader is None:
        raise ImportError(f"{name}.py is not beside {__file__}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MODELS: Any = sibling("sglang_models")
_DEEPSEEK_CONFIG: dict[str, Any] = MODELS.DEEPSEEK_CONFIG
#: Per model type, what its tiny config also needs to build on CPU.
FAMILY: dict[str, dict[str, Any]] = {
    model_type: dict(_DEEPSEEK_CONFIG) for model_type in ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2")
}
# DeepSeek-V2 routes as its checkpoints' configs say (no aux-loss-free bias, which V3 introduced).
FAMILY["deepseek_v2"] |= {"topk_method": "group_limited_greedy", "scoring_func": "softmax"}
# As the models ship, where transformers' defaults differ from their checkpoints' configs: Gemma-2's config.json
# carries hidden_act beside hidden_activation (SGLang reads hidden_act); OLMo and OLMoE attend with as many KV heads
# as query heads (TINY's grouped 4 would give their per-head k_norm the wrong size). Word embeddings are tied or not
# as each config's default says.
FAMILY |= {
    "gemma2": {"hidden_act": "gelu_pytorch_tanh"},
    "olmo": {"num_key_value_heads": 8},
    "olmoe": {"num_key_value_heads": 8},
}


# ---------------------------------------------------------------- project side


def survey(
    script: str | Path,
    python: str | Path,
    archs: Sequence[str] = (),
    *,
    engine: str,
    timeout: float = 7200.0,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Run ``script``'s engine side (``script engine --trace-script T [ARCH ...]``) with the engine venv's
    ``python``: one row per architecture, streamed as JSON lines; a progress bar on stderr while it runs.
    ``engine`` names the engine in the bar."""
    found = importlib.util.find_spec("weightsync_engine.trace")  # its path only: this side never imports it
    assert found is not None and found.origin is not None, "weightsync_engine is installed with weightsync"
    trace_script = Path(found.origin)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    command = [str(python), "-I", str(script), "engine", "--trace-script", str(trace_script), *archs]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryFile("w+") as log, progress_bar(progress) as bar:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        assert process.stdout is not None
        task = bar.add_task(f"importing {engine}", total=None)
        deadline = time.monotonic() + timeout
        for line in process.stdout:
            message = json.loads(line)
            if "total" in message:
                bar.update(task, total=message["total"], description="architectures")
                continue
            rows.append(message)
            bar.update(task, advance=1, description=f"{message['arch']}: {message['status']}")
            if time.monotonic() > deadline:
                process.kill()
                raise TimeoutError(f"the survey ran past {timeout:.0f} s")
        if process.wait() != 0:
            log.seek(0)
            tail = "\n".join(log.read().strip().splitlines()[-15:])
            raise RuntimeError(f"{Path(script).name} engine failed (exit {process.returncode}):\n{tail}")
    return rows


def progress_bar(enabled: bool) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description:<48}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*columns, console=Console(stderr=True), disable=not enabled)


def counts(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Rows per status, in :data:`STATUSES` order."""
    return {s: sum(1 for r in rows if r["status"] == s) for s in STATUSES}


def page(
    rows: Sequence[dict[str, Any]],
    versions: dict[str, str] | None,
    *,
    engine: str,
    module: str,
    intro: Sequence[str],
    cell: Callable[[dict[str, Any]], str],
) -> str:
    """A coverage page: title, how it was generated, ``intro`` (the method), the counts, one row per architecture in
    status then name order (its detail from ``cell``, already escaped and cut), and the architectures that have no
    causal-LM class in ``transformers``, listed by name."""
    lines = [
        f"# Stock {engine}: which architectures weightsync syncs",
        "",
        f"Generated by `python -m weightsync_testing.{module}` (do not edit by hand)"
        + (f" with {', '.join(f'{k} {v}' for k, v in sorted(versions.items()))}" if versions else "")
        + ".",
        "",
        *intro,
        "",
        "| status | architectures |",
        "|---|---|",
        *(f"| {status} | {n} |" for status, n in counts(rows).items()),
        "",
        "| architecture | status | detail |",
        "|---|---|---|",
    ]
    unmapped = sorted(r["arch"] for r in rows if r.get("reason") == NO_CAUSAL_LM)
    for row in sorted(rows, key=lambda r: (STATUSES.index(r["status"]), r["arch"])):
        if row.get("reason") != NO_CAUSAL_LM:
            lines.append(f"| `{row['arch']}` | {row['status']} | {cell(row)} |")
    if unmapped:
        lines += [
            "",
            f"Also not built: {len(unmapped)} architectures for which `transformers` has no causal-LM class of the "
            f"same name (vision-language, embedding, reward and audio models, {engine}-only names): "
            + ", ".join(f"`{a}`" for a in unmapped)
            + ".",
        ]
    return "\n".join(lines) + "\n"


def main(
    argv: list[str] | None,
    *,
    prog: str,
    doc: str | None,
    engine: str,
    python_env: str,
    engine_rows: Callable[[Path, Sequence[str]], Iterator[dict[str, Any]]],
    survey: Callable[[str, Sequence[str]], list[dict[str, Any]]],
    render: Callable[[Sequence[dict[str, Any]], dict[str, str] | None], str],
) -> int:
    """A survey's command line, both sides: ``engine`` (internal: the engine venv streams one JSON row per
    architecture), or survey through it and write the table (``--markdown``), the rows (``--json``), or render rows
    written before (``--from-json``)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0] if doc else None)
    sub = parser.add_subparsers(dest="command")
    side = sub.add_parser("engine", help="(internal) the engine-venv side: one JSON line per architecture")
    side.add_argument("--trace-script", type=Path, required=True)
    side.add_argument("archs", nargs="*")
    parser.add_argument("--python", default=os.environ.get(python_env), help=f"the {engine} venv's python")
    parser.add_argument("--arch", action="append", default=[], help="only this architecture (repeatable)")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--from-json", type=Path, help="render rows written by --json instead of surveying")
    args = parser.parse_args(argv)
    if args.command == "engine":
        # Engines log to stdout: the rows get a private copy of it, and everything else goes to stderr.
        rows_out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
        for message in engine_rows(args.trace_script, args.archs):
            print(json.dumps(message), file=rows_out, flush=True)
        return 0
    if not args.from_json and not args.python:
        parser.error(f"--python (or {python_env}) must name the {engine} venv's python")
    try:
        rows = json.loads(args.from_json.read_text()) if args.from_json else survey(args.python, args.arch)
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"{prog}: {' '.join(str(exc).split())[:500]}", file=sys.stderr)
        return 1
    versions = rows[0].get("versions") if rows else None
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(render(rows, versions))
    print(", ".join(f"{n} {s}" for s, n in counts(rows).items()))
    return 0


# ---------------------------------------------------------------- engine-venv side


def causal_lm_types(transformers: Any) -> dict[str, str]:
    """``{architecture name: model type}`` for every class ``transformers`` builds as a causal LM."""
    mapping: Any = importlib.import_module("transformers.models.auto.modeling_auto").MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    model_type_of: dict[str, str] = {}
    for model_type, names in mapping.items():
        for name in names if isinstance(names, (list, tuple)) else [names]:
            model_type_of.setdefault(name, model_type)
    return model_type_of


def tiny_checkpoint(
    torch: Any, transformers: Any, arch: str, model_type: str, model_dir: Path, family: dict[str, Any] | None = None
) -> dict[str, Any] | str:
    """Save ``arch``'s tiny model (seeded random weights, bfloat16, safetensors) in ``model_dir``: its default
    config as a dict, or why it is not built (still too big). ``family`` replaces :data:`FAMILY`'s entry."""
    defaults: dict[str, Any] = transformers.CONFIG_MAPPING[model_type]().to_dict()
    shrink = {k: v for k, v in TINY.items() if k in defaults}
    extra = FAMILY.get(model_type, {}) if family is None else family
    # Only the overrides: everything else (per-layer type lists included) follows from them as the config computes.
    config = transformers.CONFIG_MAPPING[model_type](**{**shrink, **extra}, architectures=[arch])
    if "torch_dtype" in defaults or hasattr(config, "torch_dtype"):
        config.torch_dtype = "bfloat16"
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in meta.parameters())
    if count > MAX_PARAMETERS:
        return f"the shrunk config still has {count:,} parameters"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(str(model_dir), safe_serialization=True)
    return defaults


def seeded_rounds(torch: Any, sources: dict[str, tuple[int, ...]]) -> Rounds:
    """(what the engine held before a round, what the round sends): seeded random bfloat16 HF tensors."""
    generator = torch.Generator().manual_seed(7)
    values = {n: torch.randn(s, generator=generator).to(torch.bfloat16) for n, s in sources.items()}
    generator = torch.Generator().manual_seed(11)
    return {n: torch.randn(t.shape, generator=generator).to(t.dtype) for n, t in values.items()}, values


def why(exc: BaseException) -> str:
    """``Type: first line (at file:line in function)``, the innermost frame: where the engine or transformers gave
    up."""
    detail = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    if frames:
        frame = frames[-1]
        path = Path(frame.filename)
        short = (
            "/".join(path.parts[path.parts.index("site-packages") + 1 :])
            if "site-packages" in path.parts
            else path.name
        )
        where = f" (at {short}:{frame.lineno} in {frame.name})"
    return f"{type(exc).__name__}: {detail}{where}" if detail else f"{type(exc).__name__}{where}"


def load_entry(trace_script: Path) -> Any:
    """``weightsync_engine/trace.py`` loaded by path: it registers the engine root from its own directory (the
    engine's Python does not have it)."""
    spec = importlib.util.spec_from_file_location("weightsync_engine_trace", trace_script)
    assert spec is not None and spec.loader is not None
    entry: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    return entry
