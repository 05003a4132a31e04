"""A weightsync manifest for one stock-SGLang TP rank: the traced shard map plus the engine's own addresses. Pure.

Stock SGLang publishes, per TP rank, only ``{name: [data_ptr, numel, element_size]}`` and a Mooncake
session id (``/remote_instance_transfer_engine_info``): no dtype, shape or shard map. The trace
(``weightsync_engine/sglang/trace_model.py``, run with the engine's own SGLang code) says how each parameter is cut
from the trainer's full HF tensors; :func:`weightsync_agent.layout.traced_manifest.assemble` joins the two and
cross-checks them. What is SGLang's own here: the hash its ``/weights_checker`` computes, by device, and which
derived buffers it re-derives itself after the writes when its server runs weightsync's custom weight loader
(:data:`REBIND_LOADER`: SGLang's own ``_rebind_parameter_aliases``, Gemma-2's ``gemma_weight``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from weightsync_agent.layout import traced_manifest
from weightsync_agent.layout.manifest import ChecksumScheme, Manifest, ManifestError
from weightsync_agent.layout.traced_manifest import TraceRefusedError

__all__ = ["CHECKSUM_BY_DEVICE", "REBIND_LOADER", "TraceRefusedError", "assemble", "checksum_scheme", "rebinds"]

#: The hash SGLang's ``/weights_checker`` computes, by the device the engine's weights live on.
CHECKSUM_BY_DEVICE: Mapping[str, ChecksumScheme] = {"cpu": "tensor-sha256-8", "cuda": "tensor-sglang-gpu"}
#: SGLang's ``--custom-weight-loader`` value that lets a round run SGLang's own alias rebind
#: (``weightsync_engine/sglang/aliases.py`` ``LOADER_PATH``; spelled here too: the agent never imports the engine root).
REBIND_LOADER = "weightsync_engine.sglang.aliases.rebind_parameter_aliases"
#: What the trace names in a refused buffer that SGLang's own rebind re-derives bit for bit (``aliases.REDERIVED_BY``).
REDERIVED_BY = "PreshardedModelLoader._rebind_parameter_aliases"


def rebinds(server_info: Mapping[str, Any]) -> bool:
    """Whether the SGLang server (its ``/server_info``) runs weightsync's custom weight loader: started with
    ``--custom-weight-loader`` naming :data:`REBIND_LOADER`."""
    loaders = server_info.get("custom_weight_loader") or []
    return isinstance(loaders, Sequence) and not isinstance(loaders, str) and REBIND_LOADER in loaders


def checksum_scheme(device: str) -> ChecksumScheme:
    scheme = CHECKSUM_BY_DEVICE.get(device)
    if scheme is None:
        raise ManifestError(
            f"SGLang engines on {device!r} verify with a hash weightsync sources cannot compute yet "
            f"(supported: {', '.join(CHECKSUM_BY_DEVICE)})"
        )
    return scheme


def assemble(
    engine: int,
    rank: int,
    trace: Mapping[str, Any],
    session_id: str,
    weights_info: Mapping[str, Sequence[int]],
    *,
    device: str,
    rebind: bool = False,
) -> Manifest:
    """Rank ``rank``'s manifest from its trace and what SGLang published; raises ManifestError.

    The buffers the trace refused but marked as re-derived by SGLang's own rebind are accepted when ``rebind`` (the
    server runs weightsync's custom weight loader, :func:`rebinds`) and listed in ``Manifest.rederived``: every round
    into the engine then has it re-derive them after the writes. Without it they are refused, and the refusal says
    which flag would sync them. Every other refusal stands either way."""
    checksum = checksum_scheme(device)
    refused = list(trace.get("refused") or [])
    rederived = [str(r["name"]) for r in refused if r.get("rederived_by") == REDERIVED_BY]
    if not rederived:
        return traced_manifest.assemble(engine, rank, trace, session_id, weights_info, checksum=checksum)
    if not rebind:
        try:
            return traced_manifest.assemble(engine, rank, trace, session_id, weights_info, checksum=checksum)
        except TraceRefusedError as exc:
            raise TraceRefusedError(
                f"{exc}; SGLang re-derives {len(rederived)} of these buffers ({rederived[0]}, ...) itself when started "
                f"with --custom-weight-loader {REBIND_LOADER} (weightsync's engine package on its path; "
                "docs/engines/sglang.md)"
            ) from exc
    kept = {**trace, "refused": [r for r in refused if r.get("rederived_by") != REDERIVED_BY]}
    manifest = traced_manifest.assemble(engine, rank, kept, session_id, weights_info, checksum=checksum)
    return manifest.model_copy(update={"rederived": tuple(rederived)})
