"""Stock SGLang's engine replica: its own model class for one TP rank, loaded through its own ``load_weights``.

Runs with the ENGINE's Python (the SGLang venv or image), like the trace; imports only the standard library,
``torch``, ``sglang`` and this root (``trace_core``, ``replica_core``, the trace's SGLang build).

The steps mirror stock SGLang's weight-update session (0.5.23,
``srt/model_executor/model_runner_components/weight_updater.py``):

* :func:`begin` is ``begin_weight_update``: ``DefaultModelLoader.restore_weights_before_loading`` undoes in-place
  quant packing, so the engine's parameters are in loader layout again;
* the sources' one-sided writes put the replica's parameters (:func:`load`, on the source) into them;
* :func:`end` is ``end_weight_update`` when nothing went through ``load_weights`` in the session ("P2P/RDMA"):
  the model's ``post_load_weights`` (MLA's ``w_kc``/``w_vc`` re-derived from ``kv_b_proj``), then every quant
  method's ``process_weights_after_loading``, on the engine's own device;
* :func:`rebind` is ``/update_weights_from_tensor`` with weightsync's custom weight loader (``aliases.py``): SGLang's
  own ``_rebind_parameter_aliases`` (Gemma-2's ``gemma_weight`` buffers), for a server started with the flag.

:func:`check` runs that whole path on CPU against SGLang's own full load and names every difference.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from weightsync_engine import replica_core
from weightsync_engine.sglang import aliases, trace_model
from weightsync_engine.trace_core import Workarounds

#: The loader's module (``DefaultModelLoader``, ``post_load_weights``), imported with SGLang.
LOADER = "sglang.srt.model_loader.loader"


def build(
    sg: types.SimpleNamespace, model_dir: Path, tp: int, rank: int, dtype: str, ep: int = 1, *, dp: int = 1
) -> Any:
    """SGLang's model class for TP rank ``rank`` of ``tp`` (``--ep-size ep``, DP attention over ``dp`` groups when
    above 1) on CPU, as the trace builds it (its workarounds); a quantized checkpoint's with its quantization config
    (an FP8 checkpoint's FP8 weights and ``weight_scale_inv``)."""
    model, _ = trace_model.build_model(sg, model_dir, tp, rank, dtype, Workarounds(), ep=ep, dp=dp, quantized=True)
    return model


def load(sg: types.SimpleNamespace, model: Any, weights: Iterable[tuple[str, Any]]) -> None:
    """The engine's own ``load_weights`` with the trainer's HF-named tensors: the replica's parameters then hold
    the loader layout (no post-processing: the engine runs that itself at the end of its session)."""
    with sg.torch.no_grad():
        model.load_weights(weights)


def begin(sg: types.SimpleNamespace, model: Any) -> None:
    """``begin_weight_update`` on ``model``: quant packing undone, parameters in loader layout."""
    importlib.import_module(LOADER).DefaultModelLoader.restore_weights_before_loading(model, sg.torch.device("cpu"))


def end(sg: types.SimpleNamespace, model: Any, *, run_post_load: bool = True) -> None:
    """``end_weight_update`` of a session with no ``load_weights`` (P2P/RDMA): the model's post-load fixup, then
    the quant methods' post-processing. ``run_post_load=False``: a session in which ``/update_weights_from_tensor``
    ran (the alias rebind, :func:`rebind`), which SGLang counts as a load: its end skips the post-load fixup."""
    loader = importlib.import_module(LOADER)
    with sg.torch.no_grad():
        if run_post_load:
            loader.post_load_weights(model)
        loader.DefaultModelLoader.postprocess_weights(model, sg.torch.device("cpu"))


def rebind(sg: types.SimpleNamespace, model: Any) -> None:
    """What ``/update_weights_from_tensor`` runs with ``load_format`` :data:`aliases.LOADER_PATH` and no tensors:
    weightsync's custom weight loader, SGLang's own ``_rebind_parameter_aliases`` (then the post-load fixup the
    session's end now skips)."""
    with sg.torch.no_grad():
        aliases.rebind_parameter_aliases(model, [])


def full_load(sg: types.SimpleNamespace, model: Any, weights: Iterable[tuple[str, Any]]) -> None:
    """SGLang's own load of a checkpoint (``DefaultModelLoader.load_weights_and_postprocess``): the reference."""
    loader = importlib.import_module(LOADER)
    with sg.torch.no_grad():
        loader.DefaultModelLoader.load_weights_and_postprocess(model, weights, sg.torch.device("cpu"))


def check(
    sg: types.SimpleNamespace,
    model_dir: Path,
    tp: int,
    rank: int,
    dtype: str,
    old: dict[str, Any],
    new: dict[str, Any],
    ep: int = 1,
    *,
    dp: int = 1,
    with_rebind: bool = False,
) -> dict[str, Any]:
    """The whole path of one round into TP rank ``rank`` (``--ep-size ep``) on CPU, against SGLang's own load of
    ``new``:

    1. the engine, fully loaded with ``old`` (its derived attributes are ``old``'s);
    2. the source's replica, its parameters views of one flat buffer (:func:`replica_core.bind`), loaded with
       ``new`` through ``load_weights`` straight into the buffer (ReplicaError if the loader replaced a tensor);
    3. a session on the engine: :func:`begin`, the replica's parameters written byte for byte, with ``with_rebind``
       SGLang's alias rebind through weightsync's custom weight loader (:func:`rebind`: a server started with
       ``--custom-weight-loader``, ``aliases.LOADER_PATH``), :func:`end`;
    4. every parameter, buffer and tensor attribute of the engine against a model fully loaded with ``new``.

    Returns ``layout`` (the replica's loader layout, with each parameter's offset in the buffer), ``parameters``
    (its count), ``bytes``, ``unwritten`` (the parameters no HF tensor wrote: the engine keeps its own, the replica
    never writes them), ``differences`` (empty: bit-exact) and ``before_end``: the differences right after the
    writes, before :func:`end`, i.e. what SGLang's own end-of-session processing had to re-derive, such as MLA's
    ``w_kc``/``w_vc`` (a round that skipped it would serve those stale)."""

    def weights(values: dict[str, Any]) -> Iterable[tuple[str, Any]]:
        return ((name, tensor.clone()) for name, tensor in values.items())  # a loader may change its input

    engine = build(sg, model_dir, tp, rank, dtype, ep, dp=dp)
    full_load(sg, engine, weights(old))
    replica = build(sg, model_dir, tp, rank, dtype, ep, dp=dp)
    # The replica's parameters are views of one flat buffer, as they are of the shared file a source registers.
    size = replica_core.packed(replica_core.loader_layout(replica))[1]
    buffer = sg.torch.zeros(size, dtype=sg.torch.uint8)
    bound = replica_core.bind(sg.torch, replica, buffer)
    buffer.fill_(replica_core.SENTINEL)
    load(sg, replica, weights(new))
    replica_core.check_bound(replica, buffer, bound)
    # Parameters no HF tensor wrote keep the engine's own values (its checkpoint's, or its constructor's): never
    # written, never compared (two fresh builds hold whatever their allocations held).
    own = frozenset(replica_core.unwritten(buffer, bound))
    begin(sg, engine)
    skipped = replica_core.write_parameters(sg.torch, replica, engine, skip=own)
    reference = build(sg, model_dir, tp, rank, dtype, ep, dp=dp)
    full_load(sg, reference, weights(new))
    before_end = replica_core.differences(sg.torch, engine, reference, ignore=own)
    if with_rebind:
        rebind(sg, engine)
    end(sg, engine, run_post_load=not with_rebind)
    found = [f"parameter {name}: not in the replica" for name in skipped]
    found += replica_core.differences(sg.torch, engine, reference, ignore=own)
    return {
        "layout": bound,
        "parameters": len(bound),
        "bytes": sum(p["nbytes"] for p in bound),
        "unwritten": sorted(own),
        "differences": found,
        "before_end": before_end,
    }


def checked_layer_groups(
    sg: types.SimpleNamespace,
    model_dir: Path,
    tp: int,
    rank: int,
    dtype: str,
    new: dict[str, Any],
    ep: int = 1,
    *,
    dp: int = 1,
) -> tuple[list[list[int]], str]:
    """The layer groups a source may load ``new``'s feeds in, one at a time (:func:`replica_core.layer_groups`, checked
    by :func:`layerwise_difference`; empty: one load of every feed), and what the check found: ``"N groups"``, ``"one
    group"`` or ``"differs at <parameter>"``."""
    groups = replica_core.layer_groups(list(new))
    if len(groups) <= 1:
        return [], "one group"
    differs = layerwise_difference(sg, model_dir, tp, rank, dtype, new, groups, ep, dp=dp)
    return ([], f"differs at {differs}") if differs else (groups, f"{len(groups)} groups")


def layerwise_difference(
    sg: types.SimpleNamespace,
    model_dir: Path,
    tp: int,
    rank: int,
    dtype: str,
    new: dict[str, Any],
    groups: list[list[int]],
    ep: int = 1,
    *,
    dp: int = 1,
) -> str | None:
    """Whether ``load_weights`` may run one layer group at a time (``groups``: indices into ``new``'s order, from
    :func:`replica_core.layer_groups`) and leave the same bytes as one call over every tensor, as a source that loads
    each group once the trainer staged it needs: None if so, else the first parameter that differs. The groups go in
    reverse order, so neither the checkpoint's order nor one call's end-of-load steps are what makes them agree."""
    names = list(new)

    def loaded(calls: list[list[int]]) -> tuple[Any, list[dict[str, Any]]]:
        replica = build(sg, model_dir, tp, rank, dtype, ep, dp=dp)
        size = replica_core.packed(replica_core.loader_layout(replica))[1]
        buffer = sg.torch.zeros(size, dtype=sg.torch.uint8)
        bound = replica_core.bind(sg.torch, replica, buffer)
        buffer.fill_(replica_core.SENTINEL)
        for call in calls:
            load(sg, replica, ((names[i], new[names[i]].clone()) for i in call))
        replica_core.check_bound(replica, buffer, bound)
        return buffer, bound

    whole, bound = loaded([list(range(len(names)))])
    grouped, _ = loaded(list(reversed(groups)))
    for entry in bound:
        span = slice(entry["offset"], entry["offset"] + entry["nbytes"])
        if not sg.torch.equal(whole[span], grouped[span]):
            return str(entry["name"])
    return None
