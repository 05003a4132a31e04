"""Stock SGLang's engine replica as a process: the layout an engine pod publishes, and the loader a source runs.

Run with the ENGINE's Python through the engine root's entry point (``trace.py``)::

    python .../weightsync_engine/trace.py sglang --replica-layout --model DIR --tp T --rank R --dtype D \
        [--ep E] [--dp D]
    python .../weightsync_engine/trace.py sglang --replica-serve

``--replica-layout`` (the engine pod's agent, where the trace refused a rank): runs :func:`replica_model.check` for
the rank with the checkpoint's own values as the engine's and a seeded perturbation of them as the round's, and
prints one JSON object: ``tensors`` (the loader layout: every parameter in ``named_parameters()`` order but those
no checkpoint tensor writes, listed in ``kept``: the engine keeps its own values there, as in its own load), ``feeds``
(the HF tensors ``load_weights`` takes, in checkpoint order, in the engine's dtype), ``refused`` (every parameter,
buffer or attribute the path cannot bring to the engine's own load's bytes, with the reason: never synced) and
``rederived`` (what SGLang's end of session re-derives, for the docs and the status), ``layer_groups`` (the feeds
by decoder layer, as indices into ``feeds``, when ``load_weights`` one group at a time leaves the bytes one call does:
a source then loads each group as soon as it is staged and gives its memory back; empty: one load of every feed) and
``layerwise`` (what that check found).

``--replica-serve`` (a source's agent, one process per engine replica): JSON lines on stdin, one answer line each
on stdout (``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``):

* ``{"op": "bind", "replica": {...Manifest.replica}, "file": PATH, "offset": O, "tensors": [[name, offset]...],
  "feed": {"file": PATH, "offset": O, "tensors": [[name, offset]...]}}`` builds SGLang's model class for the rank and
  makes every parameter a view of the replica file at ``O + offset`` (the agent's layout, checked name by name
  against the model's), and maps the feed file;
* ``{"op": "load", "names": [...]}`` runs the model's own ``load_weights`` over those feed tensors (every one when
  ``names`` is absent): the loader layout lands in the replica file, which the agent then sends.

EOF ends it. The engine's own output goes to stderr; stdout carries the answers only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from weightsync_engine import replica_core
from weightsync_engine import trace_core as core
from weightsync_engine.sglang import replica_model, trace_model

#: The perturbation the layout check's round applies to the checkpoint (seeded: the same check every time).
ROUND_SEED = 20261128
MAX_REQUEST_BYTES = 16 * 1024 * 1024  # a bind names every parameter and feed


#: A quantized checkpoint's scales keep their own dtype (float32), as its quantized weights do.
SCALE_SUFFIX = "_scale_inv"


def checkpoint(sg: Any, model_dir: Path, dtype: Any) -> dict[str, Any]:
    """Every HF tensor of ``model_dir``'s safetensors as a trainer's feed holds it: the model's plain float weights in
    ``dtype``, a quantized checkpoint's FP8 weights and their float32 scales as they are."""
    safetensors = __import__("safetensors.torch", fromlist=["load_file"])
    torch = sg.torch
    order = core.read_checkpoint(model_dir)
    plain = (torch.float16, torch.bfloat16, torch.float32)
    values: dict[str, Any] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in safetensors.load_file(str(path)).items():
            if name in order:
                cast = tensor.dtype in plain and not name.endswith(SCALE_SUFFIX)
                values[name] = tensor.to(dtype) if cast else tensor
    return {name: values[name] for name in order}


def perturbed(sg: Any, values: dict[str, Any]) -> dict[str, Any]:
    """The round's weights: each moved by seeded noise (an FP8 weight in its float value, a scale by a positive
    factor), integers kept."""
    torch = sg.torch
    generator = torch.Generator().manual_seed(ROUND_SEED)
    out = {}
    for name, tensor in values.items():
        if not tensor.is_floating_point():
            out[name] = tensor.clone()
            continue
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
        if name.endswith(SCALE_SUFFIX):
            out[name] = (tensor * (1 + 0.05 * noise.abs())).contiguous()
        elif tensor.dtype == torch.float8_e4m3fn:
            out[name] = (tensor.float() + 0.05 * noise).clamp(-448, 448).to(tensor.dtype).contiguous()
        else:
            out[name] = (tensor + 0.05 * noise.to(tensor.dtype)).contiguous()
    return out


def model_dtype(sg: Any, model: Any) -> Any:
    """The dtype of the model's plain weights: the most common float dtype among its parameters but FP8."""
    counts: dict[Any, int] = {}
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != sg.torch.float8_e4m3fn:
            counts[param.dtype] = counts.get(param.dtype, 0) + param.numel()
    return max(counts, key=lambda d: counts[d])


def layout(model_dir: Path, tp: int, rank: int, dtype: str, ep: int = 1, dp: int = 1) -> dict[str, Any]:
    """The rank's engine-replica layout and what the check found (module doc)."""
    started = time.monotonic()
    sg = trace_model.import_sglang()
    probe = replica_model.build(sg, model_dir, tp, rank, dtype, ep, dp=dp)
    plain = model_dtype(sg, probe)
    del probe
    old = checkpoint(sg, model_dir, plain)
    round_values = perturbed(sg, old)
    found = replica_model.check(sg, model_dir, tp, rank, dtype, old, round_values, ep, dp=dp)
    kept = set(found["unwritten"])
    refused = [
        {
            "name": difference,
            "reason": "differs from SGLang's own load after the session's end: derived in load_weights, which "
            "one-sided writes do not run, and not re-derived by SGLang's end_weight_update",
        }
        for difference in found["differences"]
    ]
    # A parameter no checkpoint tensor writes (an FP8 model's KV-cache k_scale/v_scale) keeps the engine's own values,
    # as it does in SGLang's own load of the checkpoint: it is not in the replica and never written.
    fields = ("name", "dtype", "shape", "nbytes")
    tensors = [{k: entry[k] for k in fields} for entry in found["layout"] if entry["name"] not in kept]
    feeds = [{"name": n, "dtype": core.dtype_name(t.dtype), "shape": list(t.shape)} for n, t in old.items()]
    # A source loads a group once the trainer staged it and gives its feed memory back, if the model's load_weights
    # leaves the same bytes that way; otherwise it loads once, when every feed is staged.
    groups, layerwise = replica_model.checked_layer_groups(sg, model_dir, tp, rank, dtype, round_values, ep, dp=dp)
    return {
        "sglang": sg.version,
        "tp_size": tp,
        "tp_rank": rank,
        "ep_size": ep,
        "dp_size": dp,
        "dtype": core.dtype_name(plain),
        "quantization": json.loads((model_dir / "config.json").read_text()).get("quantization_config"),
        "tensors": tensors,
        "feeds": feeds,
        "refused": refused,
        "kept": sorted(kept),
        "layer_groups": groups,
        "layerwise": layerwise,
        "rederived": sorted({d.split(":")[0] for d in found["before_end"]}),
        "seconds": round(time.monotonic() - started, 2),
    }


class Loader:
    """One engine replica: SGLang's model for one rank, its parameters views of the replica file."""

    def __init__(self, sg: Any) -> None:
        self.sg = sg
        self.model: Any = None
        self.bound: list[dict[str, Any]] = []
        self.buffer: Any = None
        self.feeds: dict[str, Any] = {}

    def bind(self, request: dict[str, Any]) -> dict[str, Any]:
        torch, spec = self.sg.torch, request["replica"]
        model = replica_model.build(
            self.sg,
            Path(spec["model"]),
            int(spec["tp"]),
            int(spec["rank"]),
            str(spec["dtype"]),
            int(spec["ep"]),
            dp=int(spec.get("dp") or 1),
        )
        given = [(str(name), int(offset)) for name, offset in request["tensors"]]
        kept = {str(name) for name in spec.get("kept", ())}
        params = [(n, p) for n, p in model.named_parameters() if n not in kept]
        if [name for name, _ in given] != [name for name, _ in params]:
            have, want = [n for n, _ in params], [n for n, _ in given]
            extra, lacking = sorted(set(want) - set(have))[:5], sorted(set(have) - set(want))[:5]
            raise replica_core.ReplicaError(
                f"the manifest's tensors are not this model's parameters in order (the manifest has {extra} the model "
                f"lacks, the model has {lacking} the manifest lacks): another model or SGLang version"
            )
        buffer = mapped(torch, Path(request["file"]))
        base = int(request["offset"])
        bound = []
        with torch.no_grad():
            for (name, param), (_, offset) in zip(params, given, strict=True):
                start = base + offset
                nbytes = param.numel() * param.element_size()
                if start % param.element_size() or start + nbytes > buffer.numel():
                    raise replica_core.ReplicaError(f"{name}: offset {offset} does not fit a {param.dtype} view")
                view = buffer[start : start + nbytes].view(param.dtype).view(param.shape)
                param.data = view
                bound.append({"name": name, "offset": start, "nbytes": nbytes})
        feed_buffer = mapped(torch, Path(request["feed"]["file"]))
        feed_base = int(request["feed"]["offset"])
        by_name = {f["name"]: f for f in spec["feeds"]}
        feeds = {}
        for name, offset in request["feed"]["tensors"]:
            feed = by_name[name]
            dtype = getattr(torch, feed["dtype"])
            size = torch.empty((), dtype=dtype).element_size()
            start = feed_base + int(offset)
            count = 1
            for dim in feed["shape"]:
                count *= int(dim)
            feeds[name] = feed_buffer[start : start + count * size].view(dtype).view(feed["shape"])
        self.model, self.bound, self.buffer, self.feeds = model, bound, buffer, feeds
        return {"ok": True, "parameters": len(bound), "feeds": len(feeds)}

    def load(self, names: list[str] | None = None) -> dict[str, Any]:
        """``load_weights`` over the feeds ``names`` (all when None: a layer's, when the source streams)."""
        if self.model is None:
            raise replica_core.ReplicaError("load before bind")
        chosen = list(self.feeds) if names is None else [str(n) for n in names]
        unknown = sorted(set(chosen) - set(self.feeds))
        if unknown:
            raise replica_core.ReplicaError(f"no feed named {unknown[:5]}")
        started = time.monotonic()
        # A loader may change its input in place: it gets copies; the feed file keeps the trainer's bytes.
        replica_model.load(self.sg, self.model, ((name, self.feeds[name].clone()) for name in chosen))
        replica_core.check_bound(self.model, self.buffer, self.bound)
        return {"ok": True, "seconds": round(time.monotonic() - started, 4)}


def mapped(torch: Any, path: Path) -> Any:
    """``path``'s bytes as a flat ``uint8`` tensor sharing the file (writes reach every process mapping it)."""
    size = os.path.getsize(path)
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


def serve(stdin: TextIO | None = None) -> int:
    """``--replica-serve`` (module doc)."""
    sys.stdout.flush()
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the engine's own prints must not reach the answers
    try:
        loader = Loader(trace_model.import_sglang())
    except Exception as exc:
        answers.write(json.dumps({"ok": False, "error": f"cannot import SGLang: {' '.join(str(exc).split())}"}) + "\n")
        return 1
    answers.write(json.dumps({"ok": True, "sglang": loader.sg.version}) + "\n")
    for line in stdin or sys.stdin:
        if not line.strip():
            continue
        try:
            if len(line) > MAX_REQUEST_BYTES:
                raise ValueError(f"request over {MAX_REQUEST_BYTES} bytes")
            request = json.loads(line)
            op = request.get("op")
            if op == "bind":
                answer = loader.bind(request)
            elif op == "load":
                answer = loader.load(request.get("names"))
            else:
                raise ValueError(f"unknown op {op!r} (bind, load)")
        except Exception as exc:  # one answer per request, naming what failed
            answer = {"ok": False, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"}
        answers.write(json.dumps(answer) + "\n")
    answers.flush()
    # EOF: the source's agent is done with this replica. Nothing is left to clean up (the replica's bytes are the
    # shared file's), and the engine's own non-daemon threads would keep a normal exit waiting.
    os._exit(0)


def layout_main(argv: list[str]) -> int:
    """``--replica-layout``: one JSON object on stdout, or one line on stderr and exit 1."""
    parser = argparse.ArgumentParser(prog="replica_layout", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1, help="DP attention's DP size (1: none)")
    args = parser.parse_args(argv)
    sys.stdout.flush()
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        result = layout(args.model.resolve(), args.tp, args.rank, args.dtype, args.ep, args.dp)
    except Exception as exc:
        print(f"replica_layout: {type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    answers.write(json.dumps(result) + "\n")
    answers.flush()
    return 0
