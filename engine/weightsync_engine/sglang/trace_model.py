"""Trace how stock SGLang cuts one TP rank's parameters from the full Hugging Face tensors. Standalone.

Run with the ENGINE's Python (the one SGLang is installed in), through the engine root's one entry point; it imports
only the standard library, ``torch``, ``sglang`` (which brings ``transformers``) and the engine-independent trace core
(``weightsync_engine/trace_core.py``: stdlib and torch only), never another weightsync root::

    python weightsync_engine/trace.py sglang --model DIR --tp T --rank R --dtype DTYPE

prints one JSON object on stdout (``tensors``: per SGLang parameter, in ``named_parameters()`` order,
the parts it concatenates along ``cat_dim``, each a slice of one HF tensor; ``refused``: every
parameter or buffer that is not such a block copy, with the reason; a buffer SGLang's own alias rebind re-derives
is marked ``rederived_by``, :func:`mark_rederived`). The consumer is
``weightsync_agent.targets.sglang.manifest.assemble``. On a real error (bad model directory, SGLang not
importable, a checkpoint tensor SGLang cannot load) it exits 1 with one line on stderr.

Method (docs/engines/sglang-trace.md; the trace itself is the core's, shared with the vLLM trace): build
SGLang's own model class for (T, R) on CPU in float32, so small integer codes are exact; then for each HF
tensor of the checkpoint (names and shapes from the safetensors headers; no values are read) and each of its
dims, fill every parameter with NaN, feed a tensor whose value is ``index along that dim + 1`` through the
model's own ``load_weights``, and record for every element written which source coordinate it came from.
A (parameter, HF tensor) pair is accepted only as a pure rectangular translation; a parameter is emitted only
when such blocks tile it completely along one dim. A last pass per HF tensor loads seeded random values and
checks that the accepted blocks reproduce them bit for bit (so no load-time transform — scaling, ``+1``, a
cast — hides behind a translation). Anything else is refused, never guessed.

Engine dtype and per-parameter dtypes come from a second build of the model class in the engine's dtype
(``--dtype auto`` resolves as SGLang's ``ModelConfig`` does: a float32 checkpoint becomes float16).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from weightsync_engine import trace_core as core
from weightsync_engine.sglang import aliases

#: The engine's name in the trace's help and messages.
ENGINE = "SGLang"
#: The SGLang release this trace (and its workarounds) was written and checked against.
VALIDATED_SGLANG = "0.5.23"

# The core's names this module, its tests' engine-side helpers and the coverage survey
# (weightsync_testing/sglang_coverage.py, which imports this module in SGLang's Python through trace.py) use.
TraceError = core.TraceError
Workarounds = core.Workarounds
read_checkpoint = core.read_checkpoint
trace_replica = core.trace_replica
param_layout = core.param_layout
dtype_name = core.dtype_name


# ---------------------------------------------------------------- importing SGLang


def import_sglang() -> types.SimpleNamespace:
    """The SGLang (and torch) names the trace uses; a missing package is a one-line TraceError."""
    m = core.import_engine(
        "SGLang",
        "sglang",
        {
            "torch": "torch",
            "sglang": "sglang",
            "runtime_context": "sglang.srt.runtime_context",
            "server_args": "sglang.srt.server_args",
            "dp_attention": "sglang.srt.layers.dp_attention",
            "model_config": "sglang.srt.configs.model_config",
            "load_config": "sglang.srt.configs.load_config",
            "loader": "sglang.srt.model_loader.loader",
            "loader_utils": "sglang.srt.model_loader.utils",
            "arg_utils": "sglang.srt.arg_groups.arg_utils",
            "parallel_fields": "sglang.srt.arg_groups.fields.parallel",
        },
    )
    torch, sglang, runtime_context = m["torch"], m["sglang"], m["runtime_context"]
    version = getattr(sglang, "__version__", None)
    if version is None:
        version = importlib.import_module("importlib.metadata").version("sglang")
    return types.SimpleNamespace(
        torch=torch,
        version=str(version),
        reset_context=runtime_context.reset_context,
        publish=runtime_context.publish,
        get_parallel=runtime_context.get_parallel,
        SpawnRanks=runtime_context.SpawnRanks,
        ServerArgs=m["server_args"].ServerArgs,
        initialize_dp_attention_flags=m["dp_attention"].initialize_dp_attention_flags,
        ModelConfig=m["model_config"].ModelConfig,
        LoadConfig=m["load_config"].LoadConfig,
        initialize_model=m["loader"]._initialize_model,
        quantization_config=m["loader"]._get_quantization_config,
        set_default_torch_dtype=m["loader_utils"].set_default_torch_dtype,
        Derived=m["arg_utils"].Derived,
        Parallel=m["parallel_fields"].Parallel,
    )


#: What ``trace.py --serve`` imports once, before it forks a child per trace.
IMPORT = import_sglang


# ---------------------------------------------------------------- workarounds (gated, each recorded)


FAKE_GROUPS_WHY = (
    "SGLang's model constructors read process-group handles from get_parallel() (pp_group, moe_tp_group, "
    "tp_group.cpu_group, ...) that only torch.distributed initialisation writes; the trace builds one rank "
    "alone, so each unwritten *_group gets a placeholder carrying only rank_in_group/world_size (from the "
    "published topology) and cpu_group=device_group=None. No collective runs: load_weights of these "
    "layers only slices."
)
VLLM_WHY = (
    "RotaryEmbedding.__init__ imports vllm._custom_ops.rotary_embedding as its fallback kernel when the "
    "platform is neither CUDA/HIP nor SGLang's CPU engine (a CPU-only host); vLLM is absent, so a "
    "placeholder module is in sys.modules only while the model is constructed. Its rotary_embedding "
    "raises if called; the trace never runs forward."
)


def fake_parallel_groups(sg: types.SimpleNamespace, tp: int, rank: int, workarounds: Workarounds) -> None:
    """Workaround 1: placeholder handles for every process group that has not been written."""
    parallel = sg.get_parallel()
    names = [n for n, d in vars(sg.Parallel).items() if isinstance(d, sg.Derived) and n.endswith("_group")]
    faked: dict[str, Any] = {}
    placement: dict[str, list[int]] = {}
    for name in names:
        try:
            handle = getattr(parallel, name)
        except RuntimeError:  # "parallel name ... has not been written in this process"
            handle = None
        if handle is not None:
            for attr in ("cpu_group", "device_group"):
                if not hasattr(handle, attr):
                    setattr(handle, attr, None)
            continue
        group = name.removesuffix("_group")
        size, index = _readable(parallel, f"{group}_size"), _readable(parallel, f"{group}_rank")
        if group == "world":
            size, index = tp, rank
        if not isinstance(size, int) or not isinstance(index, int):
            size, index = 1, 0
        faked[name] = core.PlaceholderGroup(name, index, size)
        placement[name] = [index, size]
    entry = workarounds.note("fake_parallel_groups", FAKE_GROUPS_WHY, applied=bool(faked))
    entry["groups"] = placement
    if faked:
        parallel.override_permanently(**faked)
    # Assert the topology the layers will read is the one asked for.
    got = (parallel.tp_rank, parallel.tp_size)
    if got != (rank, tp):
        raise TraceError(f"SGLang's published topology says TP rank {got[0]} of {got[1]}, asked for {rank} of {tp}")


def _finish_groups_note(workarounds: Workarounds) -> None:
    entry = workarounds.entries.get("fake_parallel_groups")
    if entry is not None:
        entry["read"] = sorted(set(entry.get("read", [])) | core.PlaceholderGroup.read)
        entry["used"] = bool(entry["read"])


def _readable(parallel: Any, name: str) -> Any:
    try:
        return getattr(parallel, name)
    except (AttributeError, RuntimeError, ValueError):
        return None


@contextlib.contextmanager
def vllm_placeholder(workarounds: Workarounds) -> Iterator[None]:
    """Workaround 2: a placeholder ``vllm._custom_ops`` during construction, only where SGLang would import it."""
    entry = workarounds.note("vllm_custom_ops_placeholder", VLLM_WHY)
    rotary = importlib.import_module("sglang.srt.layers.rotary_embedding.base")
    takes_vllm_path = not any(
        getattr(rotary, flag, False) for flag in ("_is_cuda", "_is_hip", "_is_cpu", "_is_xpu", "_is_npu", "_is_musa")
    )
    if not takes_vllm_path or "vllm" in sys.modules or importlib.util.find_spec("vllm") is not None:
        yield
        return

    def rotary_embedding(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("weightsync trace placeholder vllm._custom_ops.rotary_embedding was called")

    package = types.ModuleType("vllm")
    package.__path__ = []
    ops = types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = rotary_embedding  # type: ignore[attr-defined]
    package._custom_ops = ops  # type: ignore[attr-defined]
    sys.modules["vllm"], sys.modules["vllm._custom_ops"] = package, ops
    entry["applied"] = True
    try:
        yield
    finally:
        sys.modules.pop("vllm._custom_ops", None)
        sys.modules.pop("vllm", None)
    entry["placeholder"] = rotary_embedding


def _finish_vllm_note(model: Any, workarounds: Workarounds) -> None:
    entry = workarounds.entries.get("vllm_custom_ops_placeholder")
    placeholder = entry.pop("placeholder", None) if entry else None
    if entry is None or placeholder is None:
        return
    layers = [m for m in model.modules() if getattr(m, "fallback_rotary_embedding", None) is placeholder]
    entry["used"] = bool(layers)
    entry["layers"] = len(layers)


# ---------------------------------------------------------------- building the model


def build_model(
    sg: types.SimpleNamespace,
    model_dir: Path,
    tp: int,
    rank: int,
    dtype: str,
    workarounds: Workarounds,
    *,
    layers: int | None = None,
    device: str = "cpu",
    ep: int = 1,
    dp: int = 1,
    quantized: bool = False,
) -> tuple[Any, Any]:
    """SGLang's model class for TP rank ``rank`` of ``tp`` on CPU, weights uninitialised; (model, ModelConfig).

    ``layers`` overrides ``num_hidden_layers`` (SGLang's own ``json_model_override_args``); ``device="meta"``
    builds names, shapes and dtypes without memory; ``ep`` is SGLang's ``--ep-size`` (experts split over ``ep``
    of the ``tp`` ranks, as SGLang publishes the MoE groups from it); ``dp`` > 1 is SGLang's DP attention
    (``--enable-dp-attention --dp-size dp``: attention split over ``tp / dp`` ranks, each DP group whole);
    ``quantized``: build a quantized checkpoint's model with its quantization config, as SGLang's loader does (the
    engine replica; the trace refuses them)."""
    torch = sg.torch
    sg.reset_context()
    override = json.dumps({"num_hidden_layers": layers}) if layers is not None else "{}"
    args = sg.ServerArgs(
        model_path=str(model_dir),
        device="cpu",
        tp_size=tp,
        ep_size=ep,
        **({"enable_dp_attention": True, "dp_size": dp} if dp > 1 else {}),
        load_format="dummy",
        dtype=dtype,
        json_model_override_args=override,
    )
    sg.publish(args, role="scheduler", ranks=sg.SpawnRanks(world_rank=rank))
    sg.initialize_dp_attention_flags(args)
    fake_parallel_groups(sg, tp, rank, workarounds)
    config = sg.ModelConfig.from_server_args(args)
    if config.quantization and not quantized:
        raise TraceError(f"quantized checkpoints ({config.quantization}) are not traced yet")
    load_config = sg.LoadConfig(load_format="dummy")
    quant_config = sg.quantization_config(config, load_config) if config.quantization else None
    with vllm_placeholder(workarounds), sg.set_default_torch_dtype(config.dtype), torch.device(device):
        model = sg.initialize_model(config, load_config, quant_config)
    _finish_vllm_note(model, workarounds)
    _finish_groups_note(workarounds)
    if getattr(model, "secondary_weights", ()):
        raise TraceError("the model loads weights from secondary sources, which the trace does not follow")
    return model.eval(), config


def run(model_dir: Path, tp: int, rank: int, dtype: str, reduce_layers: bool = True) -> dict[str, Any]:
    started = time.monotonic()
    sources = read_checkpoint(model_dir)
    sg = import_sglang()
    imported = time.monotonic()
    quantization = (json.loads((model_dir / "config.json").read_text()).get("quantization_config") or {}).get(
        "quant_method"
    )
    if quantization:
        # Its weights are not cuts of the trainer's tensors: refused as a whole, so that an engine replica (which
        # quantizes as the checkpoint does) takes the rank.
        reason = f"a quantized checkpoint ({quantization}): its weights are not cuts of the trainer's tensors"
        traced = {"tensors": [], "refused": [{"name": "(every parameter)", "reason": reason}],
                  "seconds": {"build": 0.0, "trace": 0.0}}  # fmt: skip
        return core.run_output("sglang_version", sg.version, tp, rank, traced, Workarounds(), started=started,
                               imported=imported)  # fmt: skip
    workarounds = Workarounds()
    traced_model: list[Any] = []  # the float32 replica the core traces (built once, on CPU)

    def build(build_dtype: str, layers: int | None, device: str) -> tuple[Any, str]:
        model, config = build_model(sg, model_dir, tp, rank, build_dtype, workarounds, layers=layers, device=device)
        if device == "cpu":
            traced_model[:] = [model]
        return model, dtype_name(config.dtype)

    traced = core.trace_layers(sg.torch, build, sources, dtype, ENGINE, reduce_layers)
    traced["refused"] = mark_rederived(sg.torch, traced_model[0], sources, traced)
    return core.run_output(
        "sglang_version", sg.version, tp, rank, traced, workarounds, started=started, imported=imported
    )


def mark_rederived(torch: Any, model: Any, sources: dict[str, tuple[int, ...]], traced: dict[str, Any]) -> list[Any]:
    """The trace's refusals, each buffer that SGLang's own ``_rebind_parameter_aliases`` re-derives marked
    ``rederived_by`` (``aliases.rederived_buffers``, checked on ``model``, the traced replica, loaded with the traced
    layers' HF tensors). Still refusals: a round accepts them only into a server that runs the rebind
    (``--custom-weight-loader``, ``aliases.LOADER_PATH``), which the agent knows and the trace does not."""
    refused: list[Any] = traced["refused"]
    if not any(core.BUFFER_CHANGED in str(r.get("reason", "")) for r in refused):
        return refused
    keep = int(traced["layers"]["traced"])
    loaded = {n: s for n, s in sources.items() if (core.layer_of(n) or 0) < keep}
    representative = {int(k): int(v) for k, v in traced["layers"]["representative"].items()}
    return aliases.mark(refused, set(aliases.rederived_buffers(torch, model, loaded)), representative)
