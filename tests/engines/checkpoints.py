"""The trainer-side checkpoint of the engine tiers' tiny models, byte for byte, to compare engines' weights with."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def safetensors_bytes(model: Path) -> dict[str, bytes]:
    """Raw bytes of every tensor in ``model.safetensors`` (the format: u64 header size, JSON header, data)."""
    data = (model / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    base = 8 + size
    return {
        name: data[base + meta["data_offsets"][0] : base + meta["data_offsets"][1]]
        for name, meta in header.items()
        if name != "__metadata__"
    }
