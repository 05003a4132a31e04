"""The target manifest: what an inference rank publishes so sources can write straight into its weights.

Served by the engine (as the ``weights_info`` of ``/remote_instance_transfer_engine_info``, the route
SGLang uses) together with the transfer session id. One entry per local weight tensor: where it lives
(absolute address in the engine process), its dtype and shape, and how it is cut from the trainer's full
tensors — a concatenation along ``cat_dim`` of slices of one or more full tensors (one part for a plain
TP shard; three for a fused qkv; one whole-tensor part for a replicated norm). Two extensions cover what
stock engines hold beyond that: a part may land in a sub-tensor picked by leading indices (``at``: expert
``e``'s 2-D projections in a fused ``[experts, rows, cols]`` parameter), and an entry may end, along
``cat_dim``, in ``padding`` slices no full tensor writes and the engine holds as zeros (vocab padding on
the last TP rank).

Sources read this once per target, check it, and build a CPU replica with the identical byte layout, so
every bucket is a run of plain memory copies into remote addresses. Checks here are strict on purpose:
a malformed manifest is refused before any byte is written.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise
from typing import Final, Literal, Self

from pydantic import ConfigDict, Field, model_validator

from weightsync.api.v1alpha1 import ApiModel

SCHEMA_VERSION: Final = "weightsync.io/manifest/v1"

DType = Literal["float32", "float16", "bfloat16", "float64", "int8", "uint8", "int32", "int64", "float8_e4m3fn"]
ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
    "float8_e4m3fn": 1,
}
#: What a quantized weight's scale entry may be stored as (checkpoints store INT8 channel scales in the model's dtype).
FLOAT_SCALES = frozenset({"float32", "float16", "bfloat16"})


#: How a target checks what landed (docs/architecture.md): per bucket, xxh3-64 of the bytes (weightsync's
#: own verify routes); or per tensor, in manifest order, the engine's own hash: ``tensor-sha256-8`` is
#: the first 8 bytes of sha256 of the tensor's bytes (SGLang's ``/weights_checker`` on CPU tensors),
#: ``tensor-sglang-gpu`` SGLang's ``gpu_tensor_hash`` (on CUDA tensors).
ChecksumScheme = Literal["bucket-xxh3", "tensor-sha256-8", "tensor-sglang-gpu", "tensor-sha256"]


class ManifestError(ValueError):
    """A manifest that cannot be trusted: refused before anything is written."""


class ShardPart(ApiModel):
    """``full[source]`` sliced to ``[start, start + length)`` along ``dim`` (the rest whole).

    It lands in ``tensor[at]``: the tensor itself when ``at`` is empty, else the sub-tensor those leading
    indices select (so the part has ``len(at)`` fewer dims than the tensor)."""

    model_config = ConfigDict(frozen=True)

    source: str = Field(min_length=1, description="Name of the full (trainer-side) tensor.")
    full_shape: tuple[int, ...]
    dim: int = Field(ge=0)
    start: int = Field(ge=0)
    length: int = Field(ge=1)
    at: tuple[int, ...] = Field(
        default=(), description="Leading indices of the destination sub-tensor (fused experts: (expert,))."
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.dim >= len(self.full_shape):
            raise ManifestError(f"{self.source}: shard dim {self.dim} outside shape {list(self.full_shape)}")
        if self.start + self.length > self.full_shape[self.dim]:
            raise ManifestError(
                f"{self.source}: slice [{self.start}, {self.start + self.length}) exceeds "
                f"dim {self.dim} of size {self.full_shape[self.dim]}"
            )
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = self.length
        return tuple(shape)


@dataclass(frozen=True)
class Placement:
    """Where a part lands: ``tensor[part.at]``, from ``start`` along the entry's ``cat_dim`` (``length`` long)."""

    index: int  # the part's position in the entry
    part: ShardPart
    start: int
    length: int


#: How a source fills a tensor of its replica: ``trace``, cut from the trainer's full tensors as the parts say;
#: ``engine-replica``, written whole by the engine's own ``load_weights`` in the source's engine replica
#: (docs/engines/engine-replicas.md), for tensors the engine's loader fuses, transforms or derives.
FillPath = Literal["trace", "engine-replica"]


class TensorEntry(ApiModel):
    """One local weight tensor of the target rank."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(min_length=1)
    dtype: DType
    shape: tuple[int, ...]
    address: int = Field(gt=0, description="Absolute address in the engine process (the transfer target).")
    nbytes: int = Field(ge=0)
    cat_dim: int = Field(default=0, ge=0, description="Parts are concatenated along this dimension.")
    path: FillPath = Field(default="trace", description="How the source fills it: cut (trace) or engine replica.")
    parts: tuple[ShardPart, ...] = Field(default=(), description="The cut (path trace); none for an engine replica.")
    padding: int = Field(
        default=0,
        ge=0,
        description="Trailing slices along cat_dim that no full tensor writes and the engine holds as zeros.",
    )
    quantize: Literal["int8-channel", "fp8-channel", "fp8-block"] | None = Field(
        default=None,
        description="A quantized checkpoint tensor the source makes from the trainer's float tensors its parts cut "
        "(layout/quantize.py: int8-channel / fp8-channel = symmetric INT8 / e4m3 per output channel, a whole copy; "
        "fp8-block = e4m3 in "
        "block x block tiles of each full tensor, cut on tile edges); scale names the entry its scale goes to.",
    )
    block: tuple[int, int] | None = Field(default=None, description="fp8-block: the tile, [rows, columns].")
    scale: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _check(self) -> Self:
        expected = math.prod(self.shape) * ITEMSIZE[self.dtype]
        if (self.quantize is None) != (self.scale is None):
            raise ManifestError(f"{self.name}: a quantized tensor names its method and its scale's entry together")
        whole = len(self.parts) == 1 and self.parts[0].full_shape == self.shape
        if self.quantize == "int8-channel" and (self.dtype != "int8" or len(self.shape) != 2 or not whole):
            raise ManifestError(f"{self.name}: an int8-channel tensor is a whole 2-D int8 copy of one trainer tensor")
        if self.quantize == "fp8-channel" and (self.dtype != "float8_e4m3fn" or len(self.shape) != 2 or not whole):
            raise ManifestError(
                f"{self.name}: an fp8-channel tensor is a whole 2-D float8_e4m3fn copy of one trainer tensor"
            )
        if (self.quantize == "fp8-block") != (self.block is not None):
            raise ManifestError(f"{self.name}: a block goes with fp8-block quantization, and only with it")
        if self.quantize == "fp8-block" and (
            self.dtype != "float8_e4m3fn" or len(self.shape) != 2 or self.padding or self.path != "trace"
            or any(p.at for p in self.parts) or min(self.block or (0,)) < 1
        ):  # fmt: skip
            raise ManifestError(
                f"{self.name}: an fp8-block tensor is a 2-D float8_e4m3fn cut of whole trainer tensors (no padding, "
                "no sub-tensors) with a positive block"
            )
        if self.nbytes != expected:
            raise ManifestError(
                f"{self.name}: nbytes {self.nbytes} does not match shape {list(self.shape)} of {self.dtype} "
                f"({expected} bytes)"
            )
        if self.path == "engine-replica":
            if self.parts or self.padding or self.cat_dim:
                raise ManifestError(f"{self.name}: an engine-replica tensor has no parts, padding or cat_dim")
            return self
        if not self.parts:
            raise ManifestError(f"{self.name}: a traced tensor needs at least one part")
        rank = len(self.shape)
        if self.cat_dim >= max(rank, 1):
            raise ManifestError(f"{self.name}: cat_dim {self.cat_dim} outside shape {list(self.shape)}")
        lead = len(self.parts[0].at)
        if lead and self.cat_dim < lead:
            raise ManifestError(
                f"{self.name}: cat_dim {self.cat_dim} is one of the {lead} leading dim(s) that parts' 'at' index"
            )
        if self.padding and not rank:
            raise ManifestError(f"{self.name}: a 0-d tensor has no room for padding")
        sub = self.shape[lead:]
        along: dict[tuple[int, ...], int] = {}
        for part in self.parts:
            if len(part.at) != lead:
                raise ManifestError(f"{self.name}: parts index {lead} and {len(part.at)} leading dims; one count only")
            if any(not 0 <= i < n for i, n in zip(part.at, self.shape, strict=False)):
                raise ManifestError(f"{self.name}: part from {part.source} lands at {list(part.at)}, off the tensor")
            if len(part.shape) != len(sub):
                raise ManifestError(
                    f"{self.name}: part from {part.source} has rank {len(part.shape)}, not {len(sub)}"
                    + (f" (the tensor's rank {rank} less {lead} indexed dim(s))" if lead else "")
                )
            for axis, (have, want) in enumerate(zip(part.shape, sub, strict=True)):
                if axis + lead != self.cat_dim and have != want:
                    raise ManifestError(
                        f"{self.name}: part from {part.source} has shape {list(part.shape)}, "
                        f"which does not fit {list(sub)}"
                    )
            along[part.at] = along.get(part.at, 0) + (part.shape[self.cat_dim - lead] if rank else 1)
        for at, total in along.items():
            if rank and total + self.padding != self.shape[self.cat_dim]:
                where = f" at {list(at)}" if lead else ""
                padded = f" plus {self.padding} padding" if self.padding else ""
                raise ManifestError(
                    f"{self.name}: parts{where} add up to {total}{padded} along dim {self.cat_dim}, "
                    f"tensor has {self.shape[self.cat_dim]}"
                )
        if lead and len(along) != math.prod(self.shape[:lead]):
            raise ManifestError(
                f"{self.name}: parts fill {len(along)} of the {math.prod(self.shape[:lead])} sub-tensors "
                f"{list(self.shape[:lead])} indexes"
            )
        return self

    @property
    def end(self) -> int:
        return self.address + self.nbytes

    @property
    def lead(self) -> int:
        """How many leading dims the parts index (``at``) rather than fill: 0 unless experts are fused."""
        return len(self.parts[0].at) if self.parts else 0

    @cached_property
    def placements(self) -> tuple[Placement, ...]:
        """Each part's place: parts with the same ``at`` follow each other along ``cat_dim``, in order."""
        lead, along = self.lead, dict[tuple[int, ...], int]()
        out = []
        for index, part in enumerate(self.parts):
            start = along.get(part.at, 0)
            length = part.shape[self.cat_dim - lead] if self.shape else 1
            out.append(Placement(index, part, start, length))
            along[part.at] = start + length
        return tuple(out)


class Region(ApiModel):
    """A buffer registered with the transport; one transfer request must stay inside one region."""

    model_config = ConfigDict(frozen=True)

    address: int = Field(gt=0)
    nbytes: int = Field(gt=0)

    @property
    def end(self) -> int:
        return self.address + self.nbytes


class Feed(ApiModel):
    """One trainer (HF-named) tensor an engine replica's ``load_weights`` takes, in the checkpoint's format.

    A quantized target's checkpoint holds some weights quantized: ``quantize`` says how the trainer's tensor of this
    name becomes this feed (``fp8-block``: ``layout/quantize.py``'s ``fp8_block`` in ``block`` blocks), and ``scale``
    names the feed its ``weight_scale_inv`` goes to; the trainer stages its BF16 tensor and the source quantizes."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(min_length=1)
    dtype: DType
    shape: tuple[int, ...]
    quantize: Literal["fp8-block"] | None = None
    block: tuple[int, int] | None = None
    scale: str | None = Field(default=None, description="The feed that takes this weight's scale_inv.")

    @model_validator(mode="after")
    def _check(self) -> Self:
        if (self.quantize is None) != (self.block is None) or (self.quantize is None) != (self.scale is None):
            raise ManifestError(f"{self.name}: a quantized feed names its method, block and scale feed together")
        if self.quantize == "fp8-block" and (self.dtype != "float8_e4m3fn" or len(self.shape) != 2):
            raise ManifestError(f"{self.name}: an fp8-block feed is a 2-D float8_e4m3fn weight")
        return self

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


class EngineReplica(ApiModel):
    """What a source needs to build the target's engine replica: the engine's own model class for this rank, loaded
    through the engine's ``load_weights`` with the trainer's ``feeds`` (docs/engines/engine-replicas.md)."""

    model_config = ConfigDict(frozen=True)

    engine: Literal["sglang"]
    engine_version: str = Field(min_length=1, max_length=64)
    model: str = Field(min_length=1, max_length=4096, description="The model directory (its config) on the source.")
    dtype: str = Field(min_length=1, max_length=32)
    tp: int = Field(ge=1, le=4096)
    rank: int = Field(
        ge=0, le=4095, description="The TP rank it is built for (ranks of one shape hold different bytes)."
    )
    ep: int = Field(default=1, ge=1, le=4096)
    dp: int = Field(
        default=1, ge=1, le=4096, description="DP attention's DP size (1: none): attention split over tp / dp."
    )
    feeds: tuple[Feed, ...] = Field(min_length=1)
    kept: tuple[str, ...] = Field(
        default=(),
        description="Parameters no checkpoint tensor writes: the engine keeps its own values, as in its own load; "
        "not in the replica, never written.",
    )
    layer_groups: tuple[tuple[int, ...], ...] = Field(
        default=(),
        description="The feeds by decoder layer (indices into feeds, each once), when the engine checked that its "
        "load_weights over one group at a time leaves the bytes one call does: a source loads each group as soon as "
        "the trainer staged it and gives the group's memory back. Empty: one load, once every feed is staged.",
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        names = [f.name for f in self.feeds]
        if len(set(names)) != len(names):
            raise ManifestError(f"engine replica feeds repeat {sorted({n for n in names if names.count(n) > 1})[:5]}")
        grouped = sorted(i for group in self.layer_groups for i in group)
        if self.layer_groups and (grouped != list(range(len(names))) or not all(self.layer_groups)):
            raise ManifestError(
                f"the engine replica's layer groups must hold each of its {len(names)} feeds exactly once, in "
                "non-empty groups"
            )
        by_name = {f.name: f for f in self.feeds}
        for feed in self.feeds:
            if feed.scale is None or feed.block is None:
                continue
            scale = by_name.get(feed.scale)
            grid = tuple(-(-n // b) for n, b in zip(feed.shape, feed.block, strict=True))
            if scale is None or scale.dtype != "float32" or scale.shape != grid:
                raise ManifestError(
                    f"{feed.name}: its scale feed {feed.scale} must be a float32 {list(grid)} (one per "
                    f"{list(feed.block)} block)"
                )
        return self


class Manifest(ApiModel):
    """Everything a source needs to write one inference rank."""

    model_config = ConfigDict(frozen=True)

    schema_version: Literal["weightsync.io/manifest/v1"] = SCHEMA_VERSION
    engine: int = Field(ge=0)
    rank: int = Field(ge=0)
    session_id: str = Field(min_length=1, description="Transfer session, e.g. Mooncake '<host>:<rpc port>'.")
    tensors: tuple[TensorEntry, ...] = Field(min_length=1)
    regions: tuple[Region, ...] = Field(min_length=1, description="Registered buffers holding the tensors.")
    staging: bool = Field(default=False, description="Addresses point into a staging area copied on commit.")
    checksum: ChecksumScheme = Field(default="bucket-xxh3", description="What the source reports for verification.")
    replica: EngineReplica | None = Field(
        default=None, description="The engine replica that fills the engine-replica tensors (none: all traced)."
    )
    rederived: tuple[str, ...] = Field(
        default=(),
        description="Buffers the engine derives from the written parameters at load and re-derives itself when told, "
        "after the writes and before its session ends (stock SGLang: GemmaRMSNorm's gemma_weight, through its "
        "--custom-weight-loader; docs/engines/sglang.md). None: the writes and the session's end are all.",
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        loaded = [t.name for t in self.tensors if t.path == "engine-replica"]
        if loaded and self.replica is None:
            raise ManifestError(f"tensors {loaded[:5]} take the engine-replica path, but no engine replica is given")
        if self.replica is not None and self.replica.rank != self.rank:
            raise ManifestError(f"the engine replica is built for rank {self.replica.rank}, not rank {self.rank}")
        if self.replica is not None and len(loaded) != len(self.tensors):
            traced = [t.name for t in self.tensors if t.path == "trace"]
            raise ManifestError(f"an engine replica fills every tensor of its rank; {traced[:5]} are traced")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            duplicated = sorted({n for n in names if names.count(n) > 1})
            raise ManifestError(f"duplicate tensor names: {duplicated[:5]}")
        self._check_scales()
        ordered = sorted(self.tensors, key=lambda t: t.address)
        for before, after in pairwise(ordered):
            if after.address < before.end:
                raise ManifestError(f"tensors {before.name} and {after.name} overlap in the engine's memory")
        regions = sorted(self.regions, key=lambda r: r.address)
        for before_region, after_region in pairwise(regions):
            if after_region.address < before_region.end:  # a transport refuses to register overlapping buffers
                raise ManifestError(
                    f"regions [{before_region.address:#x}, +{before_region.nbytes}) and "
                    f"[{after_region.address:#x}, +{after_region.nbytes}) overlap; each buffer is registered once"
                )
        for tensor in self.tensors:
            if tensor.nbytes and self.region_of(tensor.address, tensor.nbytes) is None:
                raise ManifestError(f"{tensor.name} is not inside any registered region")
        return self

    def _check_scales(self) -> None:
        """Each quantized tensor's scale entry is one no other tensor claims and no trainer tensor is cut into (the
        source writes it from the quantizer only): int8-channel, a whole float ``[out, 1]``; fp8-block, the float32
        tiles of exactly the weight's cut (:func:`block_scale_cut`)."""
        by_name = {t.name: t for t in self.tensors}
        claimed: set[str] = set()
        for tensor in self.tensors:
            if tensor.scale is None:
                continue
            scale = by_name.get(tensor.scale)
            if scale is None:
                raise ManifestError(f"{tensor.name}: its scale entry {tensor.scale} is not in the manifest")
            if scale.quantize is not None or tensor.scale in claimed or tensor.scale == tensor.name:
                raise ManifestError(f"{tensor.name}: scale entry {tensor.scale} is claimed twice or is quantized")
            if tensor.quantize == "fp8-block":
                assert tensor.block is not None  # TensorEntry checks it goes with fp8-block
                shape, cat_dim, parts = block_scale_cut(tensor.name, tensor.shape, tensor.cat_dim, tensor.parts,
                                                        tensor.block)  # fmt: skip
                if (scale.dtype, scale.shape, scale.cat_dim, scale.parts, scale.padding) != (
                    "float32", shape, cat_dim, parts, 0
                ):  # fmt: skip
                    raise ManifestError(
                        f"{tensor.name}: its scale entry {tensor.scale} must be float32 {list(shape)}, cut from the "
                        f"trainer tensors' {SCALE_SUFFIX} tiles as the weight is cut from theirs"
                    )
            else:
                if scale.dtype not in FLOAT_SCALES or scale.shape != (tensor.shape[0], 1):
                    raise ManifestError(f"{tensor.name}: its scale entry {tensor.scale} must be a float "
                                        f"[{tensor.shape[0]}, 1] (one per output channel)")  # fmt: skip
                whole = len(scale.parts) == 1 and scale.parts[0].full_shape == scale.shape
                if not whole or scale.parts[0].source != scale.name:
                    raise ManifestError(f"{tensor.scale}: a scale entry is written whole from the quantizer")
            claimed.add(tensor.scale)

    def region_of(self, address: int, nbytes: int) -> Region | None:
        for region in self.regions:
            if region.address <= address and address + nbytes <= region.end:
                return region
        return None

    @cached_property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @cached_property
    def layout_fingerprint(self) -> str:
        """Identifies the byte layout (names, dtypes, shapes, shards), not where it lives.

        Targets with the same fingerprint can be written from one shared replica.
        """
        # exclude_none: an unquantized tensor describes itself (and so fingerprints) as before quantized entries.
        layout: list[object] = [t.model_dump(mode="json", exclude={"address"}, exclude_none=True) for t in self.tensors]
        if self.replica is not None:  # what builds the bytes is part of the layout (ranks of one shape differ)
            layout.append(self.replica.model_dump(mode="json"))
        return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()[:16]

    @cached_property
    def placement(self) -> str:
        """Identifies where the layout lives: the transfer session, every tensor's address and every region.

        An engine that restarted publishes another placement (a new process: new addresses, a new session),
        and a source holding the old one must not write (modes/p2p pins it per round)."""
        tensors = [(t.name, t.address) for t in self.tensors]
        where = [self.session_id, tensors, [(r.address, r.nbytes) for r in self.regions]]
        return hashlib.sha256(json.dumps(where).encode()).hexdigest()[:16]

    def by_name(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}


#: Where an FP8 block weight's tiles' scales come from: the trainer tensor ``X`` is quantized whole, and its scales
#: are the (virtual) full tensor ``X`` + this suffix, as the DeepSeek-V3 / Kimi-K2 checkpoints name them.
SCALE_SUFFIX: Final = "_scale_inv"


def block_scale_cut(
    name: str, shape: tuple[int, ...], cat_dim: int, parts: tuple[ShardPart, ...], block: tuple[int, int]
) -> tuple[tuple[int, ...], int, tuple[ShardPart, ...]]:
    """The scale entry an FP8 block weight (``name``, ``shape``, cut as ``parts`` along ``cat_dim``) needs, in
    ``block`` tiles: ``(shape, cat_dim, parts)``, each part the tiles of the weight's part (source
    ``<source>_scale_inv``, the full tensor's tile grid). Pure.

    The source quantizes each full trainer tensor whole (its tiles start at row and column 0), so a cut is exact only
    on tile edges: every part starts on one along its cut, ends on one or at the tensor's end, and every part but the
    last along ``cat_dim`` covers whole tiles (so the next part's tiles start a new scale row). Otherwise this
    refuses by name: an engine that cut inside a tile would need a scale no checkpoint has."""
    if len(shape) != 2 or any(len(p.full_shape) != 2 or p.at for p in parts):
        raise ManifestError(f"{name}: FP8 block tiles are of 2-D weights cut from 2-D trainer tensors")
    scales: list[ShardPart] = []
    along = 0
    for index, part in enumerate(parts):
        tile = block[part.dim]
        end = part.start + part.length
        if part.start % tile or (end % tile and end != part.full_shape[part.dim]):
            raise ManifestError(
                f"{name}: part {part.source}[{part.start}:{end}] along dim {part.dim} is not on {tile}-wide tile edges"
            )
        if index < len(parts) - 1 and part.shape[cat_dim] % block[cat_dim]:
            raise ManifestError(
                f"{name}: part {part.source} is {part.shape[cat_dim]} long along dim {cat_dim}, not whole "
                f"{block[cat_dim]}-tiles, and another part follows it"
            )
        grid = tuple(-(-n // b) for n, b in zip(part.full_shape, block, strict=True))
        first = part.start // tile
        scales.append(ShardPart(source=part.source + SCALE_SUFFIX, full_shape=grid, dim=part.dim, start=first,
                                length=-(-end // tile) - first))  # fmt: skip
        along += scales[-1].shape[cat_dim]
    tiles = [-(-n // b) for n, b in zip(shape, block, strict=True)]
    tiles[cat_dim] = along
    return tuple(tiles), cat_dim, tuple(scales)
