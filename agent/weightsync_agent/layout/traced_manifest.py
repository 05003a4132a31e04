"""A weightsync manifest for one TP rank of a stock engine: the traced shard map plus the engine's own addresses. Pure.

A stock engine (SGLang, vLLM) publishes, per TP rank, where its parameters live, but no shard map. The engine
trace (``weightsync_engine/<engine>/trace_model.py`` on its ``trace_core``, run with the engine's own code) says how
each parameter is cut from the trainer's full HF tensors, in one schema for every engine. This module joins the two and
cross-checks them, parameter by parameter: the same names on both sides, and ``numel * element_size`` equal to
the traced shape in the engine's dtype. Anything that does not match, or that the trace refused, refuses the whole
manifest with a reason that names the parameter: a guess here would write the wrong bytes into a serving engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from weightsync_agent.layout.manifest import ITEMSIZE, ChecksumScheme, Manifest, ManifestError, Region, TensorEntry


class TraceRefusedError(ManifestError):
    """The trace found parameters that are not block copies of HF tensors (never guessed)."""


def assemble(
    engine: int,
    rank: int,
    trace: Mapping[str, Any],
    session_id: str,
    weights_info: Mapping[str, Sequence[int]],
    *,
    checksum: ChecksumScheme,
) -> Manifest:
    """Rank ``rank``'s manifest from its trace and what the engine published (``weights_info``: per parameter
    ``[address, numel, element_size]``); ``checksum``: what the engine verifies with. Raises ManifestError."""
    check_refused(trace, f"rank {rank}: {{count}} parameter(s) cannot be synced")
    traced = {str(t["name"]): t for t in trace.get("tensors") or []}
    published = set(weights_info)
    unwritten = sorted(published - set(traced))
    unknown = sorted(set(traced) - published)
    if unwritten or unknown:
        raise ManifestError(
            f"rank {rank}: the engine publishes {sorted(unwritten)[:5]} which no HF tensor writes, and the trace "
            f"found {sorted(unknown)[:5]} which the engine does not publish: different model code or config?"
        )
    tensors: list[TensorEntry] = []
    regions: list[Region] = []
    for name, entry in traced.items():
        address, numel, element_size = published_entry(weights_info[name], name, rank)
        dtype = str(entry["dtype"])
        shape = tuple(int(d) for d in entry["shape"])
        if math.prod(shape) != numel or ITEMSIZE.get(dtype) != element_size:
            raise ManifestError(
                f"rank {rank}: {name} is traced as {dtype}{list(shape)} ({math.prod(shape)} elements of "
                f"{ITEMSIZE.get(dtype)} B), the engine holds {numel} elements of {element_size} B"
            )
        nbytes = numel * element_size
        try:
            tensors.append(
                TensorEntry.model_validate(
                    {
                        "name": name,
                        "dtype": dtype,
                        "shape": shape,
                        "address": address,
                        "nbytes": nbytes,
                        "catDim": int(entry.get("cat_dim", 0)),
                        "parts": [_part(p) for p in entry["parts"]],
                        "padding": int(entry.get("padding", 0)),
                    }
                )
            )
        except (ValidationError, KeyError, TypeError) as exc:
            raise ManifestError(f"rank {rank}: {name}: the trace's entry is not usable: {exc}") from exc
        if nbytes:
            # An engine registers each parameter (or merged runs of them) with Mooncake but does not say which:
            # one region per parameter is always inside a registration, so no write spans two.
            regions.append(Region(address=address, nbytes=nbytes))
    try:
        return Manifest(
            engine=engine,
            rank=rank,
            session_id=session_id,
            tensors=tuple(tensors),
            regions=tuple(regions),
            checksum=checksum,
        )
    except ValidationError as exc:
        raise ManifestError(f"rank {rank}: {exc}") from exc


def check_refused(found: Mapping[str, Any], what: str) -> None:
    """TraceRefusedError if ``found`` (a trace, an engine-replica layout) refused anything: ``what`` (its ``{count}``
    filled in), then the first five refusals, each with its reason."""
    refused = found.get("refused") or []
    if refused:
        listed = "; ".join(f"{r['name']}: {r['reason']}" for r in refused[:5])
        more = f" (and {len(refused) - 5} more)" if len(refused) > 5 else ""
        raise TraceRefusedError(f"{what.format(count=len(refused))}: {listed}{more}")


def published_entry(entry: Any, name: str, rank: int) -> tuple[int, int, int]:
    """An engine's ``[address, numel, element_size]`` for ``name``, checked to be three non-negative integers."""
    if (
        isinstance(entry, Sequence)
        and not isinstance(entry, str)
        and len(entry) == 3
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in entry)
    ):
        return int(entry[0]), int(entry[1]), int(entry[2])
    raise ManifestError(f"rank {rank}: {name}'s published entry {str(entry)[:80]} is not [address, numel, size]")


def _part(part: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "source": part["source"],
        "fullShape": list(part["full_shape"]),
        "dim": int(part["dim"]),
        "start": int(part["start"]),
        "length": int(part["length"]),
        "at": [int(i) for i in part.get("at", ())],
    }
