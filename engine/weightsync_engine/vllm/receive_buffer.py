"""Where a round's bytes land in a vLLM worker: one file-backed region holding a rank's checkpoint tensors.

Why a receive buffer and not the live parameters: vLLM's CPU build repacks every linear weight into a oneDNN
handle after loading (``layer.weight`` is then an empty tensor), and quantized layouts differ from the
checkpoint's; a write into them would not take effect. So the sources write Hugging Face tensors, as the
checkpoint names and shapes them, into this buffer, and the engine applies them with ``model.load_weights``
inside vLLM's layerwise reload (:mod:`weightsync_engine.vllm.engine`).

Why a file: the engine pod's agent (another process, the same pod) checks the bytes that landed against the
sources' checksums before the engine is told to apply them, so the region lives in a file both can map (on a
pod, a memory-backed ``emptyDir`` shared by the two containers). Its layout is written next to it as JSON
(:meth:`ReceiveBuffer.describe`): what the agent reads to build the rank's manifest.

Standalone: the standard library and ``torch`` only.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

#: Every tensor starts at a multiple of this (cache lines; also what Mooncake's TCP path copies best).
ALIGN = 64
#: A safetensors header larger than this is not a checkpoint's (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024
#: safetensors dtype names -> torch dtypes (what a checkpoint holds: an unquantized model's, and a W8A8 checkpoint's
#: INT8 or FP8 e4m3 weights).
DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
}
#: The plain float dtypes a checkpoint may hold in another precision than the model's: the buffer takes them in the
#: model's dtype (vLLM's loader casts them to it anyway). Every other dtype is kept as the checkpoint holds it.
PLAIN_FLOATS = frozenset({"F32", "F16", "BF16", "F64"})


class BufferError(ValueError):
    """The checkpoint cannot be laid out, or the buffer's file cannot be made."""


def buffer_dtypes(
    tensors: list[tuple[str, str, tuple[int, ...]]], model_dtype: torch.dtype
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``checkpoint_tensors``' entries with the dtype each takes in the buffer: plain floats in ``model_dtype``,
    the rest (integers, FP8 weights) as the checkpoint holds them; BufferError naming a dtype it does not know (never
    laid out as something else)."""
    out = []
    for name, kind, shape in tensors:
        if kind in PLAIN_FLOATS:
            out.append((name, model_dtype, shape))
        elif kind in DTYPES:
            out.append((name, DTYPES[kind], shape))
        else:
            raise BufferError(f"{name}: the checkpoint holds it as {kind}, which the receive buffer does not take")
    return out


@dataclass(frozen=True)
class Slot:
    """One tensor's place in the buffer."""

    name: str
    dtype: str  # torch's name without the prefix: "float32"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def checkpoint_tensors(model_dir: Path) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, safetensors dtype, shape)`` of every tensor in the checkpoint's ``*.safetensors`` files (headers
    only), in file order then header order."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise BufferError(f"{model_dir} has no *.safetensors files")
    found: list[tuple[str, str, tuple[int, ...]]] = []
    for path in files:
        with open(path, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            if size > MAX_HEADER_BYTES:
                raise BufferError(f"{path}: a safetensors header of {size} bytes")
            header = json.loads(handle.read(size))
        for name, meta in header.items():
            if name != "__metadata__":
                found.append((name, str(meta["dtype"]), tuple(int(d) for d in meta["shape"])))
    return found


def layout(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[list[Slot], int]:
    """Slots for ``tensors`` packed in order, each aligned; and the total size."""
    slots: list[Slot] = []
    offset = 0
    for name, dtype, shape in tensors:
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        slots.append(Slot(name, str(dtype).removeprefix("torch."), shape, offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return slots, max(offset, ALIGN)


class ReceiveBuffer:
    """The region (a file under ``directory``, mapped shared) and its tensors as views of it."""

    def __init__(self, directory: Path, tag: str, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        if not directory.is_dir():
            raise BufferError(f"the receive directory {directory} does not exist")
        self.slots, self.nbytes = layout(tensors)
        self.path = directory / f"{tag}.buf"
        self.layout_path = directory / f"{tag}.json"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, self.nbytes)
            self._map = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address = self._bytes.data_ptr()
        self.by_name = {slot.name: slot for slot in self.slots}

    def tensor(self, name: str) -> torch.Tensor:
        slot = self.by_name[name]
        raw = self._bytes[slot.offset : slot.offset + slot.nbytes]
        return raw.view(getattr(torch, slot.dtype)).view(slot.shape)

    def describe(self, **extra: Any) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "address": self.address,
            "nbytes": self.nbytes,
            "tensors": [asdict(slot) for slot in self.slots],
            **extra,
        }

    def publish(self, **extra: Any) -> None:
        """Write the layout next to the region (:func:`publish_json`: a reader never sees half of it)."""
        publish_json(self.layout_path, self.describe(placement="buffer", **extra))

    def close(self) -> None:
        self.layout_path.unlink(missing_ok=True)
        del self._bytes
        self._map.close()
        self.path.unlink(missing_ok=True)


def publish_json(path: Path, content: dict[str, Any]) -> None:
    """Write ``content`` to ``path`` atomically: the engine pod's agent reads these files while the plugin writes."""
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(content))
    temporary.replace(path)
