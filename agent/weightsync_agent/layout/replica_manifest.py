"""A weightsync manifest for one rank synced through an engine replica: the engine's loader layout plus its own
addresses. Pure.

Where the trace refuses a rank (its loader fuses, transforms or derives weights: DeepSeek-V3's MLA, GPT-2's
transposes), the engine pod's agent asks the engine's own code for the rank's engine-replica layout
(``weightsync_engine/sglang/replica_serve.py --replica-layout``): every parameter as the engine's ``load_weights``
leaves it, the HF tensors it takes, and what the engine-replica path cannot reproduce (``refused``). This module
joins that layout with what the engine published, cross-checked parameter by parameter as a traced manifest is
(:mod:`weightsync_agent.layout.traced_manifest`); each tensor takes the ``engine-replica`` path, and the manifest
names the engine replica a source builds (docs/engines/engine-replicas.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from weightsync_agent.layout.manifest import (
    ITEMSIZE,
    ChecksumScheme,
    EngineReplica,
    Manifest,
    ManifestError,
    Region,
    TensorEntry,
)
from weightsync_agent.layout.quantize import SCALE_SUFFIX
from weightsync_agent.layout.traced_manifest import check_refused, published_entry


def assemble(
    engine: int,
    rank: int,
    layout: Mapping[str, Any],
    session_id: str,
    weights_info: Mapping[str, Sequence[int]],
    *,
    checksum: ChecksumScheme,
    model: str,
    kind: str = "sglang",
) -> Manifest:
    """Rank ``rank``'s manifest from its engine-replica ``layout`` and what the engine published (``weights_info``:
    per parameter ``[address, numel, element_size]``); ``model``: the model directory the engine loaded (a source
    builds the engine replica from its config). Raises ManifestError, TraceRefusedError if the layout refused."""
    check_refused(layout, f"rank {rank}: neither the trace nor an engine replica can sync {{count}} parameter(s)")
    entries = {str(t["name"]): t for t in layout.get("tensors") or []}
    kept = {str(name) for name in layout.get("kept") or []}
    published = set(weights_info) - kept
    if published != set(entries) or not kept <= set(weights_info):
        raise ManifestError(
            f"rank {rank}: the engine publishes {sorted(published - set(entries))[:5]} which its engine replica "
            f"lacks, and the replica has {sorted(set(entries) - published)[:5]} which the engine does not publish: "
            "different model code or config?"
        )
    tensors: list[TensorEntry] = []
    regions: list[Region] = []
    try:
        for name, entry in entries.items():
            address, numel, element_size = published_entry(weights_info[name], name, rank)
            dtype, shape = str(entry["dtype"]), tuple(int(d) for d in entry["shape"])
            if math.prod(shape) != numel or ITEMSIZE.get(dtype) != element_size:
                raise ManifestError(
                    f"rank {rank}: {name} is {dtype}{list(shape)} in the engine replica, the engine holds {numel} "
                    f"elements of {element_size} B"
                )
            nbytes = numel * element_size
            entry_json = {"name": name, "dtype": dtype, "shape": shape, "address": address, "nbytes": nbytes}
            tensors.append(TensorEntry.model_validate({**entry_json, "path": "engine-replica"}))
            if nbytes:
                regions.append(Region(address=address, nbytes=nbytes))
        replica = EngineReplica.model_validate(
            {
                "engine": kind,
                "engineVersion": str(layout.get(kind) or "unknown"),
                "model": model,
                "dtype": str(layout["dtype"]),
                "tp": int(layout["tp_size"]),
                "rank": rank,
                "ep": int(layout.get("ep_size") or 1),
                "dp": int(layout.get("dp_size") or 1),
                "feeds": quantized_feeds(layout["feeds"], layout.get("quantization"), rank),
                "kept": sorted(kept),
                "layerGroups": layout.get("layer_groups") or [],
            }
        )
        return Manifest(
            engine=engine,
            rank=rank,
            session_id=session_id,
            tensors=tuple(tensors),
            regions=tuple(regions),
            checksum=checksum,
            replica=replica,
        )
    except (ValidationError, KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ManifestError):
            raise
        raise ManifestError(f"rank {rank}: the engine-replica layout is not usable: {exc}") from exc


def quantized_feeds(feeds: Sequence[Mapping[str, Any]], quantization: Any, rank: int) -> list[dict[str, Any]]:
    """``feeds`` with each FP8 weight marked as the source makes it from the trainer's tensor: ``fp8-block`` in the
    checkpoint's ``weight_block_size``, its scale going to ``<name>_scale_inv`` (``layout/quantize.py``). A quantized
    feed weightsync cannot make is refused by name: never a guess at a format."""
    out = [dict(feed) for feed in feeds]
    fp8 = [feed for feed in out if feed.get("dtype") == "float8_e4m3fn"]
    if not fp8:
        return out
    config = quantization if isinstance(quantization, Mapping) else {}
    block = config.get("weight_block_size")
    if config.get("quant_method") != "fp8" or not (isinstance(block, Sequence) and len(block) == 2):
        raise ManifestError(
            f"rank {rank}: the checkpoint holds FP8 weights ({fp8[0]['name']}, ...) quantized as "
            f"{dict(config) or 'its config does not say'}; weightsync makes FP8 block-quantized weights only "
            "(quant_method fp8 with a weight_block_size)"
        )
    names = {str(feed["name"]) for feed in out}
    for feed in fp8:
        scale = f"{feed['name']}{SCALE_SUFFIX}"
        if scale not in names:
            raise ManifestError(f"rank {rank}: FP8 weight {feed['name']} has no {scale} in the checkpoint")
        feed.update(quantize="fp8-block", block=[int(block[0]), int(block[1])], scale=scale)
    return out
