"""A weightsync manifest for one stock-SGLang TP rank: the traced shard map plus the engine's own addresses. Pure.

Stock SGLang publishes, per TP rank, only ``{name: [data_ptr, numel, element_size]}`` and a Mooncake
session id (``/remote_instance_transfer_engine_info``): no dtype, shape or shard map. The trace
(``weightsync_engine/sglang/trace_model.py``, run with the engine's own SGLang code) says how each parameter is cut
from the trainer's full HF tensors; :func:`weightsync_agent.layout.traced_manifest.assemble` joins the two and
cross-checks them. What is SGLang's own here: the hash its ``/weights_checker`` computes, by device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from weightsync_agent.layout import traced_manifest
from weightsync_agent.layout.manifest import ChecksumScheme, Manifest, ManifestError
from weightsync_agent.layout.traced_manifest import TraceRefusedError

__all__ = ["CHECKSUM_BY_DEVICE", "TraceRefusedError", "assemble", "checksum_scheme"]

#: The hash SGLang's ``/weights_checker`` computes, by the device the engine's weights live on.
CHECKSUM_BY_DEVICE: Mapping[str, ChecksumScheme] = {"cpu": "tensor-sha256-8", "cuda": "tensor-sglang-gpu"}


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
) -> Manifest:
    """Rank ``rank``'s manifest from its trace and what SGLang published; raises ManifestError."""
    checksum = checksum_scheme(device)
    return traced_manifest.assemble(engine, rank, trace, session_id, weights_info, checksum=checksum)
