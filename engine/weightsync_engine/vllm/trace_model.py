"""Trace how stock vLLM cuts one TP rank's parameters from the full Hugging Face tensors. Standalone.

Run with the ENGINE's Python (the one vLLM is installed in), through the engine root's one entry point; it imports
only the standard library, ``torch``, ``vllm`` (which brings ``transformers``) and the engine-independent trace core
(``weightsync_engine/trace_core.py``: stdlib and torch only), never another weightsync root::

    python weightsync_engine/trace.py vllm --model DIR --tp T --rank R --dtype DTYPE

prints one JSON object on stdout, the schema of the SGLang trace (``weightsync_engine/sglang/trace_model.py``) with
``vllm_version`` in place of ``sglang_version``: ``tensors`` per vLLM parameter, in ``named_parameters()`` order,
with the parts it concatenates along ``cat_dim``; ``refused`` with reasons. The consumer is the manifest assembly
shared by the engines (``weightsync_agent.layout.traced_manifest.assemble``). On a real error it exits 1 with one
line on stderr.

Method (docs/engines/vllm-trace.md): the core's index-code trace of the model's own ``load_weights``, on vLLM's own
model class for (T, R), built on CPU the way vLLM's ``DefaultModelLoader`` builds it (``initialize_model`` under
``set_default_torch_dtype``), in float32 for the trace and in the engine's dtype on the meta device for the layout.
The trace reads the parameters right after ``load_weights`` and never runs ``process_weights_after_loading``: on the
CPU platform that step repacks every linear weight into a oneDNN handle (and empties ``layer.weight``), which is a
post-load transform, not the shard map.

What is faked, and why (each gated on the internals being there, each reported in ``workarounds``):

* **The parallel groups** (``fake_parallel_groups``). vLLM's layers read TP rank and size through
  ``vllm.distributed.parallel_state.get_tensor_model_parallel_rank/world_size()``, which read the module global
  ``_TP``; MoE layers also read ``_DP``, ``_PCP`` and ``_EP``, and models ``_PP``. Only
  ``init_distributed_environment`` + ``initialize_model_parallel`` write them, and that needs T real processes. The
  trace builds one rank alone, so each unset group global gets a placeholder holding only ``rank_in_group`` and
  ``world_size`` (TP, EP and world: (R, T); PP, DP, PCP, DCP: (0, 1)), and as ``cpu_group``/``device_group`` a
  stand-in with only ``rank()`` and ``size()`` (Qwen3-MoE sizes its experts from ``device_group.size()``). No
  collective runs: ``load_weights`` of these layers only slices.
* **The current ``VllmConfig``** is not faked but real: ``EngineArgs(model=DIR, tensor_parallel_size=T, dtype=...,
  load_format="dummy").create_engine_config()``, set by vLLM's own ``initialize_model``
  (``set_current_vllm_config``), as layers need it to construct; a fresh one per build, because attention layers
  register themselves by name in it. Layer-reduced builds use vLLM's ``hf_overrides={"num_hidden_layers": K}``.
* **The CPU platform** (``VLLM_TARGET_DEVICE=cpu`` unless set): the build is on CPU whatever the engine runs on.
  ``--dtype auto`` therefore resolves as vLLM's CPU platform does (a float32 checkpoint becomes bfloat16); pass the
  engine's resolved dtype explicitly for an engine on another platform.
* **The rotary-embedding cache** (``rope_cache_cleared``): ``get_rope`` caches one module per (shape, dtype), not per
  device, so the float32 CPU build could otherwise reuse a module made on the meta device; it is emptied before each
  build.

These are vLLM internals, not API: :data:`VALIDATED_VLLM` is the release they were checked against, and
:func:`check_internals` refuses with a one-line error naming what is missing when a vLLM lacks any of them.
"""

from __future__ import annotations

import os
import time
import types
from pathlib import Path
from typing import Any

from weightsync_engine import trace_core as core

#: The vLLM release this trace (and what it fakes) was written and checked against.
VALIDATED_VLLM = "0.32.0"
#: ``vllm.distributed.parallel_state`` globals the layers read, with the placement the placeholder gets
#: (``"tp"``: the traced rank of T; ``"one"``: rank 0 of 1).
GROUPS = {"_TP": "tp", "_PP": "one", "_DP": "one", "_EP": "tp", "_PCP": "one", "_DCP": "one", "_WORLD": "tp"}
#: The engine's name in the trace's help and messages.
ENGINE = "vLLM"

TraceError = core.TraceError


# ---------------------------------------------------------------- importing vLLM


def import_vllm() -> types.SimpleNamespace:
    """The vLLM (and torch) names the trace uses; a missing package is a one-line TraceError."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # build on CPU whatever the host has (module docstring)
    m = core.import_engine(
        "vLLM",
        "vllm",
        {
            "torch": "torch",
            "vllm": "vllm",
            "arg_utils": "vllm.engine.arg_utils",
            "parallel_state": "vllm.distributed.parallel_state",
            "loader_utils": "vllm.model_executor.model_loader.utils",
            "torch_utils": "vllm.utils.torch_utils",
            "rotary": "vllm.model_executor.layers.rotary_embedding",
        },
    )
    torch, vllm, parallel_state = m["torch"], m["vllm"], m["parallel_state"]
    vl = types.SimpleNamespace(
        torch=torch,
        version=str(getattr(vllm, "__version__", "unknown")),
        EngineArgs=getattr(m["arg_utils"], "EngineArgs", None),
        parallel_state=parallel_state,
        initialize_model=getattr(m["loader_utils"], "initialize_model", None),
        set_default_torch_dtype=getattr(m["torch_utils"], "set_default_torch_dtype", None),
        rope_cache=getattr(m["rotary"], "_ROPE_DICT", None),
    )
    check_internals(vl)
    return vl


#: What ``trace.py --serve`` imports once, before it forks a child per trace.
IMPORT = import_vllm


def check_internals(vl: types.SimpleNamespace) -> None:
    """Refuse, naming them, when this vLLM lacks the internals the trace fakes or calls (module docstring)."""
    missing = [
        name for name in ("EngineArgs", "initialize_model", "set_default_torch_dtype") if getattr(vl, name) is None
    ]
    missing += [f"parallel_state.{g}" for g in GROUPS if not hasattr(vl.parallel_state, g)]
    if not isinstance(vl.rope_cache, dict):
        missing.append("rotary_embedding._ROPE_DICT")
    if missing:
        raise TraceError(
            f"vLLM {vl.version} lacks what the trace needs ({', '.join(missing)}); it was validated against vLLM "
            f"{VALIDATED_VLLM}"
        )


# ---------------------------------------------------------------- workarounds (gated, each recorded)

FAKE_GROUPS_WHY = (
    "vLLM's layers read TP rank and size (and MoE layers DP/PCP/EP, models PP) from the parallel_state globals "
    "_TP, _PP, _DP, _EP, _PCP, _DCP, _WORLD, which only initialize_model_parallel writes with real processes; the "
    "trace builds one rank alone, so each unset one gets a placeholder carrying only rank_in_group/world_size and "
    "cpu_group/device_group stand-ins with only rank() and size(). No collective runs: load_weights of these "
    "layers only slices."
)
ROPE_WHY = (
    "get_rope caches rotary-embedding modules by (shape, dtype), not by device: the float32 CPU build could reuse "
    "one made on the meta device, so the cache is emptied before each build."
)


def fake_parallel_groups(vl: types.SimpleNamespace, tp: int, rank: int, workarounds: core.Workarounds) -> None:
    """Placeholders for every group global that is not set (a process never initialised for vLLM: all of them), or
    that holds this trace's placeholder from an earlier build (several ranks may be traced in one process)."""
    state = vl.parallel_state
    placement: dict[str, list[int]] = {}
    for name, kind in GROUPS.items():
        if not isinstance(getattr(state, name), (type(None), core.PlaceholderGroup)):
            continue  # a real group: a process vLLM initialised; leave it
        index, size = (rank, tp) if kind == "tp" else (0, 1)
        group = core.PlaceholderGroup(name, index, size)
        # MoE blocks size themselves from the torch process group (``get_ep_group().device_group.size()``).
        group.cpu_group = group.device_group = PlaceholderProcessGroup(index, size)
        setattr(state, name, group)
        placement[name] = [index, size]
    entry = workarounds.note("fake_parallel_groups", FAKE_GROUPS_WHY, applied=bool(placement))
    entry["groups"] = placement
    # Assert the topology the layers will read is the one asked for.
    got = (state.get_tensor_model_parallel_rank(), state.get_tensor_model_parallel_world_size())
    if got != (rank, tp):
        raise TraceError(f"vLLM's parallel state says TP rank {got[0]} of {got[1]}, asked for {rank} of {tp}")


class PlaceholderProcessGroup:
    """Stands in for a torch ``ProcessGroup`` behind a placeholder group: its rank and size only, no collective."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _finish_groups_note(workarounds: core.Workarounds) -> None:
    entry = workarounds.entries.get("fake_parallel_groups")
    if entry is not None:
        entry["read"] = sorted(set(entry.get("read", [])) | core.PlaceholderGroup.read)
        entry["used"] = bool(entry["read"])


# ---------------------------------------------------------------- building the model


def build_model(
    vl: types.SimpleNamespace,
    model_dir: Path,
    tp: int,
    rank: int,
    dtype: str,
    workarounds: core.Workarounds,
    *,
    layers: int | None = None,
    device: str = "cpu",
    expert_parallel: bool = False,
) -> tuple[Any, Any]:
    """vLLM's model class for TP rank ``rank`` of ``tp`` on ``device``, weights uninitialised; (model, VllmConfig).

    As ``DefaultModelLoader.load_model`` builds it, without loading anything. ``layers`` overrides
    ``num_hidden_layers`` (vLLM's own ``hf_overrides``); ``device="meta"`` builds names, shapes and dtypes only;
    ``expert_parallel`` is vLLM's ``enable_expert_parallel`` (the EP group faked as the TP one: EP size = ``tp``)."""
    torch = vl.torch
    args = vl.EngineArgs(
        model=str(model_dir),
        tensor_parallel_size=tp,
        dtype=dtype,
        load_format="dummy",
        enforce_eager=True,
        max_model_len=256,  # the trace never runs forward; a small value keeps config checks cheap
        hf_overrides={"num_hidden_layers": layers} if layers is not None else {},
        enable_expert_parallel=expert_parallel,
    )
    config = args.create_engine_config()
    if config.model_config.quantization:
        raise TraceError(f"quantized checkpoints ({config.model_config.quantization}) are not traced yet")
    fake_parallel_groups(vl, tp, rank, workarounds)
    rope = workarounds.note("rope_cache_cleared", ROPE_WHY)
    if vl.rope_cache:
        rope["applied"] = rope["used"] = True
        vl.rope_cache.clear()
    with vl.set_default_torch_dtype(config.model_config.dtype), torch.device(device):
        model = vl.initialize_model(vllm_config=config)
    _finish_groups_note(workarounds)
    return model.eval(), config


# ---------------------------------------------------------------- the whole run


def run(model_dir: Path, tp: int, rank: int, dtype: str, reduce_layers: bool = True) -> dict[str, Any]:
    started = time.monotonic()
    sources = core.read_checkpoint(model_dir)
    vl = import_vllm()
    imported = time.monotonic()
    workarounds = core.Workarounds()

    def build(build_dtype: str, layers: int | None, device: str) -> tuple[Any, str]:
        model, config = build_model(vl, model_dir, tp, rank, build_dtype, workarounds, layers=layers, device=device)
        return model, core.dtype_name(config.model_config.dtype)

    traced = core.trace_layers(vl.torch, build, sources, dtype, ENGINE, reduce_layers)
    return core.run_output(
        "vllm_version", vl.version, tp, rank, traced, workarounds, started=started, imported=imported
    )
