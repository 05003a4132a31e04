"""SGLang's own re-derivation of the buffers it derives from parameters, run in a P2P round through a stock flag.

Stock SGLang (0.5.23) derives some buffers from parameters inside ``load_weights``: ``GemmaRMSNorm.gemma_weight``, the
norm's ``weight + 1`` (``srt/layers/layernorm.py``; Gemma-2's every norm). One-sided writes of the parameters do not
run ``load_weights``, and the weight-update session's end does not re-derive them (``end_weight_update``: the model's
``post_load_weights``, then the quant methods' post-processing): the engine would serve the old weights' buffers. SGLang
has the function that does, ``PreshardedModelLoader._rebind_parameter_aliases`` (``srt/model_loader/loader.py``; the
presharded loader calls it after loading a presharded checkpoint), but no route calls it. Its stock plugin point does:
started with ``--custom-weight-loader weightsync_engine.sglang.aliases.rebind_parameter_aliases`` (:data:`LOADER_PATH`),
SGLang accepts that import path as the ``load_format`` of ``/update_weights_from_tensor`` and calls
:func:`rebind_parameter_aliases` with ``(model, named_tensors)`` on every TP rank, inside the open session. The SGLang
adapter sends it an empty tensor list after the writes, before ``/end_weight_update`` (docs/engines/sglang.md).
weightsync computes nothing here: the engine re-derives its own buffers with its own function.

Runs with the ENGINE's Python, in two places: inside SGLang's scheduler processes (:func:`rebind_parameter_aliases`,
imported by SGLang's ``dynamic_import``: the ``weightsync_engine`` package must be on the server's path), and in the
trace and the engine replica's check (:func:`rederived_buffers`: which refused buffers the rebind brings back, bit for
bit). At import time only the standard library and this root's stdlib-only ``trace_core`` (the scheduler imports this
module); torch, sglang and ``replica_core`` when a function runs.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

from weightsync_engine import trace_core

#: The value of SGLang's ``--custom-weight-loader`` that allows :func:`rebind_parameter_aliases` as a load format.
LOADER_PATH = "weightsync_engine.sglang.aliases.rebind_parameter_aliases"
#: SGLang's function that re-derives the buffers: what the trace names in a refused buffer's ``rederived_by``.
REDERIVED_BY = "PreshardedModelLoader._rebind_parameter_aliases"
#: The only buffer left to the rebind: ``GemmaRMSNorm``'s. The rebind also re-points mamba layers' ``A_log``,
#: ``dt_bias`` and conv aliases; none of those is a buffer the trace refuses, and none is checked here.
BUFFER = "gemma_weight"
LOADER = "sglang.srt.model_loader.loader"
LAYERNORM = "sglang.srt.layers.layernorm"
#: The seed of the values :func:`rederived_buffers` loads (any: the rebind must bring back what the loader derived).
SEED = 20261129


def rebind_parameter_aliases(model: Any, named_tensors: Sequence[tuple[str, Any]]) -> None:
    """SGLang's custom weight loader (``func(model, named_tensors)``): no tensors, only SGLang's own re-derivation of
    its parameter aliases and derived buffers from the parameters the round wrote."""
    if named_tensors:
        # Never a second way in for weights: the round's bytes came through the one-sided writes, verified.
        raise ValueError(f"{LOADER_PATH} takes no tensors, got {len(named_tensors)} ({named_tensors[0][0]}, ...)")
    loader = importlib.import_module(LOADER)
    loader.PreshardedModelLoader._rebind_parameter_aliases(model)
    # Calling /update_weights_from_tensor marks SGLang's session as loaded, and its end_weight_update then skips the
    # model's post_load_weights (it runs it only when no load ran: "P2P/RDMA"). Run it here, after the rebind, as the
    # session's end would have: end_weight_update still runs the quant methods' post-processing after it.
    loader.post_load_weights(model)


def rederived_buffers(torch: Any, model: Any, sources: Mapping[str, Sequence[int]]) -> list[str]:
    """The :data:`BUFFER` buffers of ``model``'s ``GemmaRMSNorm`` modules that SGLang's rebind re-derives bit for bit.

    ``model`` (CPU) is loaded with seeded values for every HF tensor of ``sources`` through its own ``load_weights``
    (each buffer then holds what the loader derived), each candidate buffer is made stale (NaN), SGLang's
    ``_rebind_parameter_aliases`` runs, and every candidate must hold the loader's bytes again. Empty if the rebind
    changed anything else (a parameter, another buffer, a tensor attribute): nothing is then left to it."""
    replica_core: Any = importlib.import_module("weightsync_engine.replica_core")
    norm = importlib.import_module(LAYERNORM).GemmaRMSNorm
    candidates = {
        f"{prefix}.{BUFFER}" if prefix else BUFFER: module
        for prefix, module in model.named_modules()
        if isinstance(module, norm) and isinstance(getattr(module, BUFFER, None), torch.Tensor)
    }
    if not candidates:
        return []
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, shape in sources.items():
            model.load_weights([(name, torch.randn(tuple(shape), generator=generator, dtype=torch.float32))])
        loaded = {(kind, name): _bytes(torch, t) for kind, name, t in replica_core.state(torch, model)}
        for module in candidates.values():
            getattr(module, BUFFER).fill_(math.nan)
        importlib.import_module(LOADER).PreshardedModelLoader._rebind_parameter_aliases(model)
        rebound = {(kind, name): _bytes(torch, t) for kind, name, t in replica_core.state(torch, model)}
    changed = {
        key for key in loaded.keys() | rebound.keys()
        if key not in loaded or key not in rebound or not torch.equal(loaded[key], rebound[key])
    }  # fmt: skip
    if {name for _, name in changed} - set(candidates):
        return []
    return sorted(name for name in candidates if (replica_core.BUFFER, name) not in changed)


def mark(
    refused: Sequence[Mapping[str, Any]], rederived: set[str], representative: Mapping[int, int]
) -> list[dict[str, Any]]:
    """``refused`` with ``rederived_by`` (:data:`REDERIVED_BY`) on each buffer refusal whose buffer, or its
    representative layer's (``representative``: a later layer -> the traced layer it was moved from), is in
    ``rederived``. Every other refusal is left as it is. Pure."""
    out = []
    for entry in refused:
        name = str(entry["name"])
        layer = trace_core.layer_of(name)
        traced = (
            trace_core.in_layer(name, representative[layer]) if layer is not None and layer in representative else name
        )
        buffer = trace_core.BUFFER_CHANGED in str(entry.get("reason", ""))
        out.append({**entry, "rederived_by": REDERIVED_BY} if buffer and traced in rederived else dict(entry))
    return out


def _bytes(torch: Any, tensor: Any) -> Any:
    """A copy of the tensor's bytes (NaN equal to itself, -0.0 unlike 0.0)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return (flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)).clone()
