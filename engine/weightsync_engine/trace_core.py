"""The engine-independent core of the shard-map traces: how one TP rank's parameters are cut from the full HF tensors.

Standalone: the standard library only, and ``torch`` passed in by the caller; never weightsync code. The engine
modules (``sglang/trace_model.py``, ``vllm/trace_model.py``) run with the ENGINE's Python, where weightsync is not
installed, through the one entry point ``trace.py`` (which registers this root from its own directory). They supply
what is engine-specific: importing the engine, building its model class for (T, R) on CPU without process groups, and
the version in the output. Everything else is here, once: reading the checkpoint's safetensors headers, the index-code
trace of ``load_weights`` (:class:`Tracer`), accepting pure rectangular translations only (:func:`analyse`), the
seeded-random bit-exact check, vocab padding and fused-expert placement (``at``), layer-reduced tracing, and the CLI
wrapper that keeps stdout for one JSON object and stderr for one line on failure.

Method and refusals: docs/engines/sglang-trace.md, docs/engines/vllm-trace.md.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import math
import os
import re
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024
PROG = "trace_model"  # the stderr line's prefix, unchanged since each engine had its own script

#: ``build(dtype, layers, device) -> (model, engine dtype name)``: the engine's model class for the traced rank, in
#: ``dtype`` (``"float32"`` for the traced replica, the engine's ``--dtype`` for its layout), with ``layers`` decoder
#: layers (``None``: as configured), on ``device`` (``"cpu"``, or ``"meta"`` for names, shapes and dtypes only).
Build = Callable[[str, "int | None", str], "tuple[Any, str]"]
#: ``run(model_dir, tp, rank, dtype, reduce_layers) -> the JSON object``: one engine module's whole trace.
Run = Callable[[Path, int, int, str, bool], "dict[str, Any]"]
#: The ``--serve`` mode's bounds on one request line and its arguments.
MAX_REQUEST_BYTES = 64 * 1024
MAX_REQUEST_ARGS = 32


class TraceError(Exception):
    """A real error: the trace cannot run. ``str()`` is the one stderr line."""


# ---------------------------------------------------------------- the checkpoint (stdlib only)


def import_engine(engine: str, package: str, modules: dict[str, str]) -> dict[str, Any]:
    """``modules`` (a short name -> a module path) imported from the engine's own install, offline (a local model
    directory only: never reach for the Hub); a missing package is a one-line TraceError naming it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        return {name: importlib.import_module(path) for name, path in modules.items()}
    except ImportError as exc:
        missing = (exc.name or package).split(".")[0]
        raise TraceError(
            f"cannot import {missing} ({exc}): run this script with the Python that {engine} is installed in"
        ) from exc


def read_checkpoint(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """``{HF tensor name: shape}`` from the safetensors headers of ``model_dir``, in the engines' file order.

    Files as SGLang's and vLLM's loaders pick them: every ``*.safetensors`` in the directory, restricted to those
    the index names when there is an index. Only headers are read (8-byte length, then JSON)."""
    if not model_dir.is_dir():
        raise TraceError(f"model directory {model_dir} does not exist")
    if not (model_dir / "config.json").is_file():
        raise TraceError(f"{model_dir} has no config.json (not a Hugging Face model directory)")
    files = sorted(model_dir.glob("*.safetensors"))
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            listed = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise TraceError(f"{index} is not a safetensors index: {exc}") from exc
        missing = sorted(f for f in listed if not (model_dir / f).is_file())
        if missing:
            raise TraceError(f"{index} names files that are missing: {missing[:3]}")
        files = sorted(model_dir / f for f in listed)
    if not files:
        raise TraceError(f"{model_dir} has no *.safetensors files (only safetensors checkpoints are traced)")
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            with open(path, "rb") as handle:
                (size,) = struct.unpack("<Q", handle.read(8))
                if size > MAX_HEADER_BYTES:
                    raise ValueError(f"header of {size} bytes")
                header = json.loads(handle.read(size))
        except (OSError, ValueError, struct.error) as exc:
            raise TraceError(f"{path} is not a readable safetensors file: {exc}") from exc
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            shapes[name] = tuple(int(d) for d in meta["shape"])
    if not shapes:
        raise TraceError(f"{model_dir}: the safetensors files hold no tensors")
    return shapes


class Workarounds:
    """What the trace changed in the engine's process state to build a model without a GPU or process groups.

    Each entry is reported in the output (``workarounds``): ``applied`` when its gate opened, ``used``
    when the engine actually read what it installed, and ``why``."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, Any]] = {}

    def note(self, name: str, why: str, **detail: Any) -> dict[str, Any]:
        entry = self.entries.setdefault(name, {"name": name, "applied": False, "used": False, "why": why})
        entry.update(detail)
        return entry

    def report(self) -> list[dict[str, Any]]:
        return list(self.entries.values())


class PlaceholderGroup:
    """A placeholder process-group handle: placement only, and a record of which groups the engine read."""

    read: set[str] = set()  # group names read, over the process (ranks traced in one process share it)

    def __init__(self, name: str, rank_in_group: int, world_size: int) -> None:
        self.name, self.rank_in_group, self.world_size = name, rank_in_group, world_size
        # One group spanning the TP ranks alone: its ranks are the world's (some layers read ``rank``).
        self.rank, self.local_rank, self.ranks = rank_in_group, rank_in_group, list(range(world_size))
        self.is_first_rank, self.is_last_rank = rank_in_group == 0, rank_in_group == world_size - 1
        self.cpu_group: Any = None  # an engine module may put a stand-in process group here
        self.device_group: Any = None

    def __getattribute__(self, attr: str) -> Any:
        if attr not in ("name", "__class__", "__dict__"):
            PlaceholderGroup.read.add(object.__getattribute__(self, "name"))
        return object.__getattribute__(self, attr)

    def __repr__(self) -> str:
        return f"<weightsync trace placeholder {self.name} {self.rank_in_group}/{self.world_size}>"


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------- tracing


class Tracer:
    """Per HF tensor and dim: NaN-fill the replica, load an index code, read back where it landed."""

    def __init__(self, torch: Any, model: Any, sources: dict[str, tuple[int, ...]], engine: str = "the engine") -> None:
        self.torch = torch
        self.engine = engine
        self.model = model
        self.sources = sources
        self.params = dict(model.named_parameters())
        self.storage = {n: (id(p), p.data_ptr(), tuple(p.shape)) for n, p in self.params.items()}
        self.buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        self.attributes = self._tensor_attributes()
        self.attribute_writes: dict[str, list[str]] = {}
        self.refused: dict[str, str] = {}
        # writes[param][source] = (mask of elements changed, per source dim: values read back)
        self.writes: dict[str, dict[str, tuple[Any, list[Any]]]] = {}
        self.buffer_writes: dict[str, list[str]] = {}
        self.unused: list[str] = []
        for name, param in self.params.items():
            if not param.dtype.is_floating_point:
                self.refused[name] = f"{dtype_name(param.dtype)} parameter: only floating-point weights are traced"

    def _load(self, source: str, tensor: Any) -> dict[str, Any]:
        """Load ``tensor`` as ``source``; ``{param: its value}`` for every parameter it changed."""
        torch = self.torch
        with torch.no_grad():
            for param in self.params.values():
                if param.dtype.is_floating_point:
                    param.data.fill_(math.nan)
            try:
                self.model.load_weights([(source, tensor)])
            except Exception as exc:  # the engine could not load the checkpoint's own tensor: a real error
                detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                failed = f"{source}{list(tensor.shape)}: {type(exc).__name__}: {detail}"
                raise TraceError(f"{self.engine}'s load_weights failed on {failed}") from exc
            now = dict(self.model.named_parameters())
            for name in now.keys() - self.storage.keys():
                # (vLLM's Transformers backend creates Phi's lm_head.bias in load_weights.) Not in the model as
                # built, so not in the layout the sources write: a round would leave it as the first load did.
                self.refused.setdefault(name, f"created by load_weights({source}): not in the model as built")
            for name, (ident, pointer, shape) in self.storage.items():
                param = now.get(name)
                if param is None or id(param) != ident or param.data_ptr() != pointer or tuple(param.shape) != shape:
                    self.refused.setdefault(
                        name, f"load_weights({source}) replaced or re-allocated it: its address would go stale"
                    )
            changed = {}
            for name, param in self.params.items():
                if not param.dtype.is_floating_point:
                    continue
                written = ~torch.isnan(param.data)
                if bool(written.any()):
                    changed[name] = param.data.clone()
            for name, buffer in self.model.named_buffers():
                before = self.buffers.get(name)
                if before is None or not _same(torch, buffer, before):
                    writers = self.buffer_writes.setdefault(name, [])
                    if source not in writers:
                        writers.append(source)
                    if before is not None and before.shape == buffer.shape:
                        buffer.copy_(before)
            attributes = self._tensor_attributes()
            for name, value in attributes.items():
                before = self.attributes.get(name)
                if before is None or not _same(torch, value, before):
                    writers = self.attribute_writes.setdefault(name, [])
                    if source not in writers:
                        writers.append(source)
            self.attributes = attributes  # the next load is blamed only for what it changes
        return changed

    def _tensor_attributes(self) -> dict[str, Any]:
        """Tensors held as plain module attributes (neither parameters nor buffers), e.g. MLA's ``w_kc``/``w_vc``
        that DeepSeek's ``load_weights`` derives from ``kv_b_proj``: copies, to see what a load changes."""
        found = {}
        # An attribute that views a parameter's storage (an alias, e.g. ``self.w1 = experts.w13_weight``) is that
        # parameter: written with it, traced as it.
        weights = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        for prefix, module in self.model.named_modules():
            for attr, value in vars(module).items():
                if isinstance(value, self.torch.Tensor) and value.untyped_storage().data_ptr() not in weights:
                    found[f"{prefix}.{attr}" if prefix else attr] = value.detach().clone()
        return found

    def trace(self) -> None:
        torch = self.torch
        for source, shape in self.sources.items():
            per_dim: list[dict[str, Any]] = []
            for dim in range(max(len(shape), 1)):
                if shape:
                    code = torch.arange(1, shape[dim] + 1, dtype=torch.float32)
                    view = [1] * len(shape)
                    view[dim] = shape[dim]
                    code = code.reshape(view).expand(shape).contiguous()
                else:
                    code = torch.ones((), dtype=torch.float32)
                per_dim.append(self._load(source, code))
            if not any(per_dim):
                self.unused.append(source)
                continue
            for name in dict.fromkeys(n for d in per_dim for n in d):
                if any(name not in d for d in per_dim):
                    self.refused.setdefault(name, f"load_weights({source}) writes it on some loads only")
                    continue
                masks = [~torch.isnan(d[name]) for d in per_dim]
                if any(not torch.equal(masks[0], m) for m in masks[1:]):
                    self.refused.setdefault(name, f"load_weights({source}) writes different elements on each load")
                    continue
                values = [d[name][masks[0]] for d in per_dim]
                self.writes.setdefault(name, {})[source] = (masks[0], values)

    def verify(self, tensors: list[dict[str, Any]]) -> None:
        """Load seeded random values per HF tensor; each accepted part must hold exactly its slice."""
        torch = self.torch
        by_source: dict[str, list[tuple[dict[str, Any], int, dict[str, Any]]]] = {}
        for entry in tensors:
            along: dict[tuple[int, ...], int] = {}  # per destination sub-tensor
            sub_dim = entry["cat_dim"] - len(entry["parts"][0]["at"])
            for part in entry["parts"]:
                at = tuple(part["at"])
                by_source.setdefault(part["source"], []).append((entry, along.get(at, 0), part))
                size = part["length"] if part["dim"] == sub_dim else part["full_shape"][sub_dim]
                along[at] = along.get(at, 0) + size
        generator = torch.Generator().manual_seed(20240917)
        for source, uses in by_source.items():
            values = torch.randn(self.sources[source], generator=generator, dtype=torch.float32)
            changed = self._load(source, values.clone())  # loaders may change their input in place (gemma.py)
            for entry, offset, part in uses:
                name = entry["name"]
                got = changed.get(name)
                want = values.narrow(part["dim"], part["start"], part["length"])
                sub_dim = entry["cat_dim"] - len(part["at"])
                if got is not None:
                    got = got[tuple(part["at"])] if part["at"] else got
                    got = got.narrow(sub_dim, offset, want.shape[sub_dim])
                if got is None or not torch.equal(got, want):
                    self.refused.setdefault(
                        name,
                        f"{source}'s values change on the way in (load_weights is not a plain copy: a scale, "
                        "offset or cast)",
                    )


def _same(torch: Any, a: Any, b: Any) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return bool(torch.equal(torch.isnan(a), torch.isnan(b))) and bool(torch.equal(a.nan_to_num(0), b.nan_to_num(0)))
    return bool(torch.equal(a, b))


# ---------------------------------------------------------------- from writes to parts


class Block:
    """One (parameter, HF tensor) pair that is a pure rectangular translation.

    ``at``: the leading destination indices when the HF tensor has fewer dims than the parameter (expert
    ``e``'s projection lands in ``param[e]`` of a fused ``[experts, rows, cols]`` parameter); ``dst0`` is
    then relative to ``param[at]``."""

    def __init__(
        self,
        source: str,
        full: tuple[int, ...],
        src0: list[int],
        dst0: list[int],
        extent: list[int],
        at: tuple[int, ...] = (),
    ):
        self.source, self.full, self.src0, self.dst0, self.extent, self.at = source, full, src0, dst0, extent, at


def analyse(
    torch: Any,
    name: str,
    param: Any,
    writes: dict[str, tuple[Any, list[Any]]],
    sources: dict[str, tuple[int, ...]],
) -> Any:
    """The parameter's parts (``(cat_dim, parts)``) or a refusal reason (``str``)."""
    shape = tuple(param.shape)
    covered = torch.zeros(shape, dtype=torch.int32)
    zero_filled = torch.zeros(shape, dtype=torch.bool)
    blocks: list[Block] = []
    for source, (mask, values) in writes.items():
        full = sources[source]
        zero = values[0] == 0  # codes are >= 1: a zero is the loader's own fill (e.g. vocab padding)
        if any(not torch.equal(v == 0, zero) for v in values[1:]):
            return f"from {source}: not a block copy (values read back are inconsistent)"
        copied = mask.clone()
        copied[mask] = ~zero
        filled = mask.clone()
        filled[mask] = zero
        zero_filled |= filled
        covered += copied.to(torch.int32)
        if not bool(copied.any()):
            continue
        result = _translation(torch, source, full, copied, [v[~zero] for v in values], shape)
        if isinstance(result, str):
            return result
        blocks.append(result)
    overlap = covered > 1
    if bool(overlap.any()):
        return f"{int(overlap.sum())} element(s) written by more than one HF tensor ({', '.join(writes)})"
    if not blocks:
        return "load_weights only zero-fills it: no HF tensor's values land in it"
    if not shape:
        return "0-d parameter: a shard part needs at least one dim"
    padding = None
    uncovered = covered == 0
    if bool(uncovered.any()):
        padding = _padding(torch, uncovered, zero_filled, shape)
        if isinstance(padding, str):
            return padding
    return _parts(name, shape, blocks, padding)


def _translation(
    torch: Any, source: str, full: tuple[int, ...], copied: Any, values: list[Any], shape: tuple[int, ...]
) -> Any:
    if not full:
        return f"written from the 0-d tensor {source}: a shard part needs at least one dim"
    src = torch.stack([v.to(torch.float64) - 1 for v in values], dim=1)
    limits = torch.tensor(full, dtype=torch.float64)
    if not bool(((src == src.floor()) & (src >= 0) & (src < limits)).all()):
        return f"from {source}: the values that land are not copies of source elements (transformed by load_weights)"
    src = src.to(torch.int64)
    dst = copied.nonzero()
    count = dst.shape[0]
    src0, dst0 = src.min(0).values, dst.min(0).values
    extent = src.max(0).values - src0 + 1
    box = math.prod(int(e) for e in extent)
    if dst.shape[1] != src.shape[1]:
        lead = dst.shape[1] - src.shape[1]
        placed = lead > 0 and box == count and bool((dst[:, :lead] == dst0[:lead]).all())
        if placed and bool(((dst[:, lead:] - dst0[lead:]) == (src - src0)).all()):
            at = tuple(int(i) for i in dst0[:lead].tolist())
            return Block(source, full, src0.tolist(), dst0[lead:].tolist(), extent.tolist(), at)
        return f"from {source}{list(full)}: not a block copy into a {len(shape)}-D parameter"
    if box == count and bool(((dst - dst0) == (src - src0)).all()):
        return Block(source, full, src0.tolist(), dst0.tolist(), extent.tolist())
    if box == count and src.shape[1] >= 2:
        for perm in _permutations(src.shape[1]):
            if bool(((dst - dst0) == (src - src0)[:, perm]).all()):
                return f"from {source}: a transposed copy (source dims {perm} land as dims 0..{len(perm) - 1})"
    return f"from {source}: not a rectangular block copy (interleaved, strided or reordered)"


def _permutations(n: int) -> list[list[int]]:
    return [list(p) for p in itertools.permutations(range(n)) if list(p) != list(range(n))]


def _padding(torch: Any, uncovered: Any, zero_filled: Any, shape: tuple[int, ...]) -> Any:
    """``(dim, count)`` when the unwritten elements are the last ``count`` slices along ``dim`` and
    load_weights zero-fills all of them (vocab padding: the engine holds zeros there); else the refusal."""
    total, missing = math.prod(shape), int(uncovered.sum())
    all_filled = bool(torch.equal(zero_filled & uncovered, uncovered))
    filled = " (load_weights zero-fills them)" if bool((zero_filled & uncovered).any()) else ""
    for dim in range(len(shape)):
        others = [d for d in range(len(shape)) if d != dim]
        rows = uncovered.all(dim=others) if others else uncovered
        any_rows = uncovered.any(dim=others) if others else uncovered
        if not torch.equal(rows, any_rows):
            continue
        index = rows.nonzero().flatten().tolist()
        if not index or index != list(range(index[0], index[-1] + 1)):
            continue
        what = "rows" if dim == 0 else f"slices along dim {dim}"
        where = f"uncovered {what} [{index[0]}, {index[-1] + 1}) of {shape[dim]} along dim {dim}"
        if index[-1] + 1 != shape[dim]:
            return f"{where}: no HF tensor writes them{filled}, and they are not trailing padding"
        if not all_filled:
            return f"{where} (padding): no HF tensor writes them and load_weights leaves them as they were"
        return dim, len(index)
    return f"{missing} of {total} element(s) are written by no HF tensor{filled}"


def _parts(name: str, shape: tuple[int, ...], blocks: list[Block], padding: tuple[int, int] | None) -> Any:
    """``(cat_dim, parts, padding count)``: per destination sub-tensor (``at``), blocks in order along one dim."""
    lead = len(blocks[0].at)
    if any(len(block.at) != lead for block in blocks):
        return f"its blocks index different numbers of leading dims ({name})"
    sub = shape[lead:]
    parts: list[tuple[Block, int | None]] = []
    groups: dict[tuple[int, ...], list[tuple[Block, int | None]]] = {}
    for block in blocks:
        dims = [d for d, n in enumerate(block.full) if not (block.src0[d] == 0 and block.extent[d] == n)]
        if len(dims) > 1:
            return f"from {block.source}: slices the source along dims {dims}; a part may slice one dim only"
        parts.append((block, dims[0] if dims else None))
        groups.setdefault(block.at, []).append(parts[-1])
    if padding is not None:  # padding trails along the concatenation dim, so that dim is fixed
        if padding[0] < lead:
            return f"padding along dim {padding[0]}, which indexes sub-tensors ({name})"
        candidates = [padding[0] - lead]
    else:
        singles = all(len(group) == 1 for group in groups.values())
        candidates = list(dict.fromkeys(d for _, d in parts if d is not None)) if singles else []
        candidates += [d for d in range(len(sub)) if d not in candidates]
    for cat_dim in candidates:
        others = [d for d in range(len(sub)) if d != cat_dim]
        fits = all(block.dst0[d] == 0 and block.extent[d] == sub[d] for block, _ in parts for d in others)
        if not fits:
            continue
        out = []
        for at in sorted(groups):
            for block, sliced in sorted(groups[at], key=lambda p: p[0].dst0[cat_dim]):
                dim = cat_dim if sliced is None else sliced
                out.append(
                    {
                        "source": block.source,
                        "full_shape": list(block.full),
                        "dim": dim,
                        "start": block.src0[dim],
                        "length": block.extent[dim],
                        "at": list(at),
                    }
                )
        return cat_dim + lead, out, padding[1] if padding else 0
    return f"its {len(parts)} blocks do not tile it along one dim ({name})"


# ---------------------------------------------------------------- the whole run

#: How a refusal of a buffer that ``load_weights`` changed begins (an engine may re-derive some: sglang/aliases.py).
BUFFER_CHANGED = "buffer changed by load_weights"


def trace_replica(
    torch: Any,
    model: Any,
    sources: dict[str, tuple[int, ...]],
    layout: dict[str, tuple[str, list[int], bool]],
    engine_dtype: str = "float32",
    engine: str = "the engine",
) -> tuple[list[dict[str, Any]], list[dict[str, str]], list[str]]:
    """Trace a float32 replica (anything with ``named_parameters``/``named_buffers``/``load_weights``).

    ``layout``: per parameter, as the engine holds it: (dtype name, shape, contiguous). Returns
    (tensors, refused, HF tensors that write nothing)."""
    tracer = Tracer(torch, model, sources, engine)
    if list(tracer.params) != list(layout) or any(list(p.shape) != layout[n][1] for n, p in tracer.params.items()):
        raise TraceError(f"the model built in float32 differs from the one built in {engine_dtype} (names or shapes)")
    for name, (_, _, contiguous) in layout.items():
        if not contiguous:
            tracer.refused.setdefault(name, "not contiguous in the engine: a block write would scatter")
    tracer.trace()
    tensors: list[dict[str, Any]] = []
    reasons: dict[str, str] = {}
    for name, param in tracer.params.items():
        if name in tracer.refused:
            continue
        writes = tracer.writes.get(name)
        if not writes:
            reasons[name] = "no HF tensor in the checkpoint writes it"
            continue
        result = analyse(torch, name, param, writes, sources)
        if isinstance(result, str):
            reasons[name] = result
            continue
        cat_dim, parts, padding = result
        param_dtype, shape, _ = layout[name]
        tensors.append(
            {
                "name": name,
                "dtype": param_dtype,
                "shape": shape,
                "cat_dim": cat_dim,
                "parts": parts,
                "padding": padding,
            }
        )
    tracer.verify(tensors)
    refused = [{"name": n, "reason": r} for n, r in {**reasons, **tracer.refused}.items()]
    for name, by in tracer.buffer_writes.items():
        refused.append(
            {
                "name": name,
                "reason": f"{BUFFER_CHANGED}({', '.join(by[:3])}): a one-sided write of the "
                "parameters would leave it stale",
            }
        )
    for name, by in tracer.attribute_writes.items():
        refused.append(
            {
                "name": name,
                "reason": f"derived by load_weights({', '.join(by[:3])}) into a tensor attribute (not a parameter): a "
                "one-sided write of the parameters would leave it stale",
            }
        )
    order = {n: i for i, n in enumerate(tracer.params)}
    refused.sort(key=lambda r: order.get(r["name"], len(order)))
    refused_names = {r["name"] for r in refused}
    return [t for t in tensors if t["name"] not in refused_names], refused, tracer.unused


LAYER = re.compile(r"\.(?:layers|h)\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder-layer index in a parameter or HF tensor name (``model.layers.7.mlp...`` -> 7), if any."""
    found = LAYER.search(name)
    return int(found.group(1)) if found else None


def in_layer(name: str, layer: int) -> str:
    """``name`` moved to decoder layer ``layer``."""
    found = LAYER.search(name)
    return name if found is None else f"{name[: found.start(1)]}{layer}{name[found.end(1) :]}"


def param_layout(model: Any) -> dict[str, tuple[str, list[int], bool]]:
    """Per parameter, as the engine holds it: (dtype name, shape, contiguous)."""
    return {n: (dtype_name(p.dtype), list(p.shape), p.is_contiguous()) for n, p in model.named_parameters()}


def layer_signatures(names_and_shapes: dict[str, Any]) -> dict[int, tuple[Any, ...]]:
    """Per decoder layer: its tensors (name within the layer, shape, ...) — layers with equal signatures are alike."""
    by_layer: dict[int, list[tuple[str, Any]]] = {}
    for name, detail in names_and_shapes.items():
        layer = layer_of(name)
        if layer is not None:
            by_layer.setdefault(layer, []).append((LAYER.sub(".#.", name, count=1), detail))
    return {layer: tuple(sorted(items, key=repr)) for layer, items in by_layer.items()}


def representatives(*signatures: dict[int, tuple[Any, ...]]) -> dict[int, int]:
    """Each layer's representative: the first layer alike in every signature given."""
    layers = sorted(set().union(*signatures))
    first: dict[tuple[Any, ...], int] = {}
    return {layer: first.setdefault(tuple(sig.get(layer) for sig in signatures), layer) for layer in layers}


def trace_layers(
    torch: Any, build: Build, sources: dict[str, tuple[int, ...]], dtype: str, engine: str, reduce_layers: bool = True
) -> dict[str, Any]:
    """Build (``build``) and trace one rank: ``dtype``, ``tensors``, ``refused``, ``unused_sources``, ``layers``, and
    ``seconds`` (``build``, ``trace``). ``engine`` names the engine in messages."""
    started = time.monotonic()
    # 1. The engine's dtypes: the model class built as the engine builds it (dtype as the engine resolves it), every
    #    layer, on the meta device (names, shapes, dtypes; no memory).
    engine_model, engine_dtype = build(dtype, None, "meta")
    layout = param_layout(engine_model)
    del engine_model
    # 2. Which layers to trace: one per kind (alike in the checkpoint and in the engine's layout), the fewest leading
    #    layers that hold one of each; the rest are the same map moved to their layer.
    engine_kinds = layer_signatures({n: (v[0], tuple(v[1])) for n, v in layout.items()})
    reps = representatives(layer_signatures(sources), engine_kinds)
    total = len(reps)
    keep = max(reps.values()) + 1 if reps and reduce_layers else total
    if keep < total:
        traced_sources = {n: s for n, s in sources.items() if (layer_of(n) or 0) < keep}
        reduced, _ = build(dtype, keep, "meta")
        reduced_layout = param_layout(reduced)
        del reduced
        expected = {n: v for n, v in layout.items() if (layer_of(n) or 0) < keep}
        if reduced_layout != expected:
            differ = sorted(n for n in set(reduced_layout) | set(expected) if reduced_layout.get(n) != expected.get(n))
            raise TraceError(
                f"the {keep}-layer build differs from the first {keep} layers of the full model (e.g. {differ[:3]}): "
                "trace it with --full-layers"
            )
        layout_traced = reduced_layout
    else:
        keep, traced_sources, layout_traced = total, sources, layout
    # 3. The float32 replica that is traced.
    model, _ = build("float32", keep if keep < total else None, "cpu")
    built = time.monotonic()
    tensors, refused, unused = trace_replica(torch, model, traced_sources, layout_traced, engine_dtype, engine)
    if keep < total:
        tensors, refused, unused = _extend(tensors, refused, unused, reps, keep, sources, layout)
    done = time.monotonic()
    return {
        "dtype": engine_dtype,
        "tensors": tensors,
        "refused": refused,
        "unused_sources": unused,
        "layers": {"total": total, "traced": keep, "representative": {str(k): v for k, v in reps.items() if k >= keep}},
        "seconds": {"build": round(built - started, 2), "trace": round(done - built, 2)},
    }


def _extend(
    tensors: list[dict[str, Any]],
    refused: list[dict[str, str]],
    unused: list[str],
    reps: dict[int, int],
    keep: int,
    sources: dict[str, tuple[int, ...]],
    layout: dict[str, tuple[str, list[int], bool]],
) -> tuple[list[dict[str, Any]], list[dict[str, str]], list[str]]:
    """The traced leading layers' map moved to every later layer alike; checked against the full layout and
    checkpoint, in the full model's parameter order."""
    by_name = {t["name"]: t for t in tensors}
    out: dict[str, dict[str, Any]] = {}
    for name, (param_dtype, shape, _) in layout.items():
        layer = layer_of(name)
        if layer is None or layer < keep:
            if name in by_name:
                out[name] = by_name[name]
            continue
        model_name = in_layer(name, reps[layer])
        entry = by_name.get(model_name)
        if entry is None:
            continue  # refused (below) or untraced in the representative
        moved = dict(entry, name=name, parts=[dict(p, source=in_layer(p["source"], layer)) for p in entry["parts"]])
        for part in moved["parts"]:
            if tuple(sources.get(part["source"], ())) != tuple(part["full_shape"]):
                raise TraceError(
                    f"{name}: layer {layer} is traced as layer {reps[layer]}, but the checkpoint's {part['source']} "
                    f"is {list(sources.get(part['source'], ()))}, not {part['full_shape']}"
                )
        if (moved["dtype"], moved["shape"]) != (param_dtype, shape):
            raise TraceError(f"{name}: layer {layer} is {param_dtype}{shape}, its representative {entry['shape']}")
        out[name] = moved
    refusals = []
    for item in refused:
        layer = layer_of(item["name"])
        refusals.append(item)
        if layer is not None:
            refusals += [
                {"name": in_layer(item["name"], other), "reason": f"as layer {layer}: {item['reason']}"}
                for other, rep in reps.items()
                if rep == layer and other >= keep
            ]
    extra = [in_layer(n, other) for n in unused if (lay := layer_of(n)) is not None for other, r in reps.items()
             if r == lay and other >= keep]  # fmt: skip
    return list(out.values()), refusals, unused + extra


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one stderr line, like every other failure
        print(f"{PROG}: {message}", file=sys.stderr)
        sys.exit(2)


def run_output(
    version_key: str,
    version: str,
    tp: int,
    rank: int,
    traced: dict[str, Any],
    workarounds: Workarounds,
    *,
    started: float,
    imported: float,
) -> dict[str, Any]:
    """An engine module's JSON: the engine's version under ``version_key``, the rank, what :func:`trace_layers`
    returned, the workarounds' report, and the run's times (``started``/``imported``: monotonic clock readings at
    the start and once the engine was imported)."""
    seconds = traced.pop("seconds")
    return {
        version_key: version,
        "tp_size": tp,
        "tp_rank": rank,
        **traced,
        "workarounds": workarounds.report(),
        "seconds": {
            "import": round(imported - started, 2),
            "build": seconds["build"],
            "trace": seconds["trace"],
            "total": round(time.monotonic() - started, 2),
        },
    }


def main(argv: list[str] | None, *, engine: str, description: str, run: Run) -> int:
    """The trace's CLI (``trace.py ENGINE`` passes the rest): ``--model DIR --tp T --rank R --dtype DTYPE``; one JSON
    object on stdout, or one line on stderr (exit 1 on a real error, 2 on bad arguments). ``engine`` names the engine
    in help and messages."""
    parser = _Parser(prog=PROG, description=description)
    parser.add_argument("--model", type=Path, required=True, help="local Hugging Face model directory")
    parser.add_argument("--tp", type=int, required=True, help=f"{engine}'s tensor-parallel size")
    parser.add_argument("--rank", type=int, required=True, help="the TP rank to trace")
    parser.add_argument("--dtype", default="auto", help=f"{engine}'s --dtype (auto, bfloat16, float16, float32)")
    parser.add_argument(
        "--full-layers",
        action="store_true",
        help="trace every decoder layer (default: one layer of each kind, the map moved to the others)",
    )
    parser.add_argument("--verbose", action="store_true", help=f"let {engine}'s own output through to stderr")
    args = parser.parse_args(argv)
    if args.tp < 1 or not 0 <= args.rank < args.tp:
        parser.error(f"--rank {args.rank} is not a rank of --tp {args.tp}")
    # Engines log to stdout and stderr: keep stdout for the JSON, and stderr for one line on failure.
    sys.stdout.flush()
    sys.stderr.flush()
    real_out, real_err = os.dup(1), os.dup(2)
    log = tempfile.NamedTemporaryFile(prefix=f"weightsync-{engine.lower()}-trace-", suffix=".log", delete=False)  # noqa: SIM115
    os.dup2(real_err if args.verbose else log.fileno(), 1)
    if not args.verbose:
        os.dup2(log.fileno(), 2)
    error = None
    try:
        result = run(args.model.resolve(), args.tp, args.rank, args.dtype, not args.full_layers)
    except TraceError as exc:
        error = str(exc)
    except Exception as exc:  # anything else is still one line, with the log for the traceback
        error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(real_out, 1)
        os.dup2(real_err, 2)
        log.close()
    if error is not None:
        line = " ".join(error.split())
        keep = "" if args.verbose else f" ({engine}'s output: {log.name})"
        print(f"{PROG}: {line}{keep}", file=sys.stderr)
        if args.verbose:
            os.unlink(log.name)
        return 1
    os.unlink(log.name)
    print(json.dumps(result))
    return 0


def serve(*, engine: str, description: str, run: Run, preload: Callable[[], Any]) -> int:
    """``--serve``: import the engine once (``preload``), then answer trace requests, one JSON line each on stdin
    (``{"argv": [the CLI's arguments]}``), with one JSON line each on stdout (``{"returncode", "stdout",
    "stderr"}``: what the CLI run with those arguments would have exited with and printed). Each request runs in a
    child forked from the state right after the import, so a trace sees what a fresh CLI run sees (no model built,
    no workaround applied) and pays the engine's import once: 10 s of SGLang's 12 s per trace. EOF ends it."""
    sys.stdout.flush()
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    # What the engine prints while it imports must not reach the answers' channel.
    os.dup2(2, 1)
    try:
        preload()
    except Exception as exc:  # one line, as the CLI's failures
        print(f"{PROG}: cannot import {engine}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    for line in sys.stdin:
        if not line.strip():
            continue
        answers.write(json.dumps(_serve_one(line, engine=engine, description=description, run=run)) + "\n")
    return 0


def _serve_one(line: str, *, engine: str, description: str, run: Run) -> dict[str, Any]:
    """One ``--serve`` request: its argv checked and bounded, then the CLI run in a forked child."""
    try:
        if len(line) > MAX_REQUEST_BYTES:
            raise ValueError(f"over {MAX_REQUEST_BYTES} bytes")
        argv = json.loads(line)["argv"]
        if not (isinstance(argv, list) and len(argv) <= MAX_REQUEST_ARGS and all(isinstance(a, str) for a in argv)):
            raise ValueError(f"argv is not a list of at most {MAX_REQUEST_ARGS} strings")
    except (ValueError, KeyError, TypeError) as exc:
        return {"returncode": 2, "stdout": "", "stderr": f"{PROG}: bad request: {exc}\n"}
    with tempfile.TemporaryDirectory(prefix=f"weightsync-{engine.lower()}-serve-") as scratch:
        out, err = Path(scratch, "stdout"), Path(scratch, "stderr")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: the CLI, its stdout and stderr into the scratch files
            code = 1
            try:
                with open(out, "wb") as o, open(err, "wb") as e:
                    os.dup2(o.fileno(), 1)
                    os.dup2(e.fileno(), 2)
                code = main(argv, engine=engine, description=description, run=run)
            except SystemExit as exc:  # argparse's exit 2 on bad arguments
                code = exc.code if isinstance(exc.code, int) else 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        printed = {"stdout": out.read_text(errors="replace"), "stderr": err.read_text(errors="replace")}
        return {"returncode": code, **printed}
