"""The engine-independent core of engine replicas: what an engine's own loader leaves in its parameters.

An **engine replica** is the engine's own model class for one target rank, built on CPU and loaded with the
trainer's HF-named tensors through the engine's own ``load_weights``. Its parameters then hold the engine's
**loader layout**: whatever ``load_weights`` does on the way in (fused pairs such as MLA's
``fused_qkv_a_proj_with_mqa``, value transforms, transposes, interleaves, tied weights). One-sided writes of those
bytes into the engine's published parameters, inside the engine's weight-update session, followed by the engine's
own end-of-session processing (derived attributes such as MLA's ``w_kc``/``w_vc``, quant methods' repacking) give
the engine exactly what a full load of the same tensors gives it. The traced byte-cut (``trace_core``) is the
special case where ``load_weights`` is a plain copy, and stays the fast path there.

Standalone like ``trace_core``: the standard library, and ``torch`` passed in; never weightsync code. The engine
modules (``sglang/replica_model.py``) supply the engine's build, load and session steps; this module holds what
is not the engine's: the layout the engine publishes, copying a replica into a target as the writes do, and the
bit-for-bit comparison of everything the engine reads (parameters, buffers and plain tensor attributes).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

from weightsync_engine.trace_core import dtype_name

#: What ``state`` calls the three kinds of tensors a module holds.
PARAMETER, BUFFER, ATTRIBUTE = "parameter", "buffer", "attribute"
#: Where each parameter starts in a bound buffer: a multiple of this (any dtype's element size, a cache line).
ALIGN = 64


#: A decoder layer's index in an HF tensor name (``model.layers.3.``, GPT-2's ``transformer.h.3.``, ``blocks.3.``).
LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


class ReplicaError(Exception):
    """The replica cannot hold what the engine's loader produced; ``str()`` names the parameter and the reason."""


def loader_layout(model: Any) -> list[dict[str, Any]]:
    """Per parameter, in ``named_parameters()`` order (the order and the set the engines publish addresses for):
    ``name``, ``dtype``, ``shape``, ``nbytes``."""
    return [
        {
            "name": name,
            "dtype": dtype_name(param.dtype),
            "shape": list(param.shape),
            "nbytes": param.numel() * param.element_size(),
        }
        for name, param in model.named_parameters()
    ]


def packed(layout: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """``layout`` with each parameter's ``offset`` in one buffer (in order, each aligned to :data:`ALIGN`), and the
    buffer's size."""
    out, end = [], 0
    for entry in layout:
        offset = -(-end // ALIGN) * ALIGN
        out.append({**entry, "offset": offset})
        end = offset + entry["nbytes"]
    return out, -(-end // ALIGN) * ALIGN


def bind(torch: Any, model: Any, buffer: Any) -> list[dict[str, Any]]:
    """Make every parameter of ``model`` a view of ``buffer`` (a flat ``uint8`` tensor, such as a shared file's
    mapping from ``torch.from_file(path, shared=True)``) at its :func:`packed` offset, its current values copied.
    The engine's ``load_weights`` then writes the loader layout straight into the buffer, which the source
    registers and writes from. Returns the packed layout; ReplicaError if the buffer is too small."""
    layout, size = packed(loader_layout(model))
    if buffer.numel() < size:
        raise ReplicaError(f"the replica buffer holds {buffer.numel()} bytes, the model's parameters need {size}")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for entry in layout:
            param = params[entry["name"]]
            start = entry["offset"]
            view = buffer[start : start + entry["nbytes"]].view(param.dtype).view(param.shape)
            view.copy_(param.data)
            param.data = view
    return layout


def check_bound(model: Any, buffer: Any, layout: list[dict[str, Any]]) -> None:
    """ReplicaError naming the first parameter whose data is no longer its view of ``buffer`` (a loader that
    replaced a parameter's tensor instead of writing into it: the buffer would not hold what the engine loaded)."""
    params = dict(model.named_parameters())
    base = buffer.data_ptr()
    for entry in layout:
        param = params.get(entry["name"])
        if param is None:
            raise ReplicaError(f"{entry['name']}: the loader removed the parameter")
        if param.data.data_ptr() != base + entry["offset"] or not param.data.is_contiguous():
            raise ReplicaError(f"{entry['name']}: the loader replaced the parameter's tensor, not writing into it")


#: What :func:`unwritten` fills a bound buffer with before the load: every byte 0xFF (NaN in every float dtype).
SENTINEL = 0xFF


def unwritten(buffer: Any, layout: list[dict[str, Any]]) -> list[str]:
    """The parameters whose bytes in ``buffer`` are all still :data:`SENTINEL` (the buffer was filled with it before
    the load): no HF tensor wrote them, so the engine keeps its own values there and the replica must not write
    them."""
    return [
        entry["name"]
        for entry in layout
        if entry["nbytes"] and bool((buffer[entry["offset"] : entry["offset"] + entry["nbytes"]] == SENTINEL).all())
    ]


def write_parameters(torch: Any, source: Any, target: Any, skip: frozenset[str] = frozenset()) -> list[str]:
    """Copy every parameter of ``source`` into the same-named parameter of ``target``, byte for byte, as the
    one-sided writes do (the target's memory, not new tensors), but those in ``skip``; the names ``target`` has and
    ``source`` lacks, or whose dtype or shape differ (nothing is written to those)."""
    held = dict(source.named_parameters())
    skipped = []
    with torch.no_grad():
        for name, param in target.named_parameters():
            if name in skip:
                continue
            replica = held.get(name)
            if replica is None or replica.dtype != param.dtype or replica.shape != param.shape:
                skipped.append(name)
                continue
            param.data.copy_(replica.data)
    return skipped


def state(torch: Any, model: Any) -> Iterator[tuple[str, str, Any]]:
    """``(kind, name, tensor)`` for everything the engine reads at inference: parameters, buffers, and plain tensor
    attributes of modules (MLA's ``w_kc``/``w_vc``, Gemma's derived norm weights) that a module keeps outside both."""
    for name, param in model.named_parameters():
        yield PARAMETER, name, param.data
    for name, buffer in model.named_buffers():
        yield BUFFER, name, buffer
    for prefix, module in model.named_modules():
        own = set(module._parameters) | set(module._buffers)
        for key, value in vars(module).items():
            if isinstance(value, torch.Tensor) and key not in own and not key.startswith("__"):
                yield ATTRIBUTE, f"{prefix}.{key}" if prefix else key, value


def differences(torch: Any, got: Any, want: Any, ignore: frozenset[str] = frozenset()) -> list[str]:
    """``kind name: why`` for every parameter, buffer and tensor attribute where ``got`` and ``want`` differ (shape,
    dtype or any byte; NaNs compared as bytes) or that only one holds, but the parameters in ``ignore``. Empty:
    bit-for-bit the same."""
    theirs = {(kind, name): tensor for kind, name, tensor in state(torch, want)}
    for name in ignore:
        theirs.pop((PARAMETER, name), None)
    out = []
    for kind, name, tensor in state(torch, got):
        if kind == PARAMETER and name in ignore:
            continue
        other = theirs.pop((kind, name), None)
        if other is None:
            out.append(f"{kind} {name}: not in the reference")
        elif (tensor.dtype, tuple(tensor.shape)) != (other.dtype, tuple(other.shape)):
            out.append(f"{kind} {name}: {tensor.dtype}{list(tensor.shape)} against {other.dtype}{list(other.shape)}")
        elif not torch.equal(_bytes(torch, tensor), _bytes(torch, other)):
            out.append(f"{kind} {name}: the bytes differ")
    out += [f"{kind} {name}: only in the reference" for kind, name in theirs]
    return out


def _bytes(torch: Any, tensor: Any) -> Any:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)


def layer_groups(names: Sequence[str]) -> list[list[int]]:
    """The feeds (``names``, in feed order) grouped by the decoder layer their name says, each group in feed order,
    groups in the order their first feed comes; the feeds of no layer (embeddings, final norm, head) form one group,
    last: a source loads each group as soon as the trainer staged it (a bounded feed) and gives its memory back."""
    by_layer: dict[str, list[int]] = {}
    rest: list[int] = []
    for index, name in enumerate(names):
        found = LAYER.search(name)
        if found is None:
            rest.append(index)
        else:
            by_layer.setdefault(name[: found.end()], []).append(index)
    return [*by_layer.values(), *([rest] if rest else [])]
