"""A small but real transformer, in a trainer ("full") form and a tensor-parallel engine form.

The architecture is Llama-shaped: token embedding, ``num_layers`` blocks of (RMSNorm, grouped-query
attention with rotary embeddings, RMSNorm, SwiGLU MLP) with residuals, a final RMSNorm and an LM head.

* **Full form** (what a trainer holds after its all-gather): HF-style names with separate
  ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` (:func:`full_state`).
* **Tensor-parallel form** (what engine rank ``r`` of ``tp`` holds, SGLang-style): a fused column-parallel
  ``qkv_proj`` = ``[q_r; k_r; v_r]`` and ``gate_up_proj`` = ``[gate_r; up_r]``, row-parallel ``o_proj`` and
  ``down_proj`` (sliced along dim 1), and replicated norms, embedding and head.

:func:`local_layout` says, without touching any tensor, how each local tensor is cut from the full ones
(the manifest's ``ShardPart``s). :func:`shard` does the same cut directly with tensor ops, independently of
the layout, so tests can check one against the other and against a source's resharding.
:class:`RankWeights` holds one rank's parameters as views into one flat contiguous buffer (so it registers
with a transport once) and builds that rank's :class:`~weightsync_agent.layout.manifest.Manifest`.

:func:`forward_full` and :func:`forward_tp` compute the same logits (up to float summation order); both
are deterministic. Everything runs on CPU and is sized for tests (about 80 K parameters by default).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

import torch

from weightsync_agent.layout.manifest import (
    ITEMSIZE,
    SCALE_SUFFIX,
    DType,
    Manifest,
    Region,
    ShardPart,
    TensorEntry,
    block_scale_cut,
)
from weightsync_agent.layout.quantize import BLOCK, dequantize, fp8_block

TORCH_DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
#: The engine's linear weights: what an FP8 block checkpoint quantizes (embedding, norms and head stay in ``dtype``).
#: What an engine rank's tensors may be stored as: the model's dtype, and an FP8 target's weights.
TARGET_DTYPES: Final[dict[str, torch.dtype]] = {**TORCH_DTYPES, "float8_e4m3fn": torch.float8_e4m3fn}
LINEAR_WEIGHTS: Final = (".qkv_proj.weight", ".o_proj.weight", ".gate_up_proj.weight", ".down_proj.weight")
TRAINER_LINEAR_WEIGHTS: Final = tuple(f".{w}_proj.weight" for w in ("q", "k", "v", "o", "gate", "up", "down"))


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 96
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 8
    intermediate_size: int = 128
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    dtype: DType = "float32"
    #: An FP8 block target (the DeepSeek-V3 / Kimi-K2 checkpoint format): the linear weights are float8_e4m3fn with
    #: float32 ``_scale_inv`` tiles of ``block``; the trainer still holds ``dtype`` and the sources quantize.
    quantization: Literal["fp8-block"] | None = None
    block: tuple[int, int] = BLOCK

    def __post_init__(self) -> None:
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"reference model dtype must be one of {sorted(TORCH_DTYPES)}, not {self.dtype}")
        if self.quantization not in (None, "fp8-block"):
            raise ValueError(f"reference model quantization is fp8-block or none, not {self.quantization}")
        object.__setattr__(self, "block", (int(self.block[0]), int(self.block[1])))  # JSON gives a list
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads do not group over {self.num_kv_heads} kv heads")
        if self.head_dim % 2:
            raise ValueError("rotary embeddings need an even head_dim")

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    def check_tp(self, tp: int) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        for what, size in (
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("intermediate_size", self.intermediate_size),
        ):
            if size % tp:
                raise ValueError(f"{what}={size} is not divisible by tp={tp}")
        if self.quantization and tp > 1:
            for what, size in (
                ("q heads x head_dim", self.num_heads * self.head_dim),
                ("kv heads x head_dim", self.num_kv_heads * self.head_dim),
                ("intermediate_size", self.intermediate_size),
            ):
                if size // tp % min(self.block):
                    raise ValueError(f"an FP8 block target cuts {what}={size} over tp={tp} inside a {self.block} tile")


DEFAULT_CONFIG: Final = ModelConfig()


def _layer(i: int) -> str:
    return f"model.layers.{i}"


# --------------------------------------------------------------------------------------------- full form


def full_shapes(config: ModelConfig = DEFAULT_CONFIG) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the trainer-side (HF-style) tensors, in a fixed order."""
    c = config
    hidden, q_out, kv_out = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, hidden)}
    for i in range(c.num_layers):
        p = _layer(i)
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        shapes[f"{p}.self_attn.q_proj.weight"] = (q_out, hidden)
        shapes[f"{p}.self_attn.k_proj.weight"] = (kv_out, hidden)
        shapes[f"{p}.self_attn.v_proj.weight"] = (kv_out, hidden)
        shapes[f"{p}.self_attn.o_proj.weight"] = (hidden, q_out)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{p}.mlp.gate_proj.weight"] = (c.intermediate_size, hidden)
        shapes[f"{p}.mlp.up_proj.weight"] = (c.intermediate_size, hidden)
        shapes[f"{p}.mlp.down_proj.weight"] = (hidden, c.intermediate_size)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (c.vocab_size, hidden)
    return shapes


def full_state(seed: int, config: ModelConfig = DEFAULT_CONFIG) -> dict[str, torch.Tensor]:
    """The trainer's full weights for ``seed``: the same seed always gives the same bytes."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in full_shapes(config).items():
        if len(shape) == 1:  # norm gains near 1, but not exactly, so a wrong norm shows in the logits
            value = 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float32)
        else:
            value = torch.randn(shape, generator=gen, dtype=torch.float32) / math.sqrt(shape[-1])
        state[name] = value.to(config.torch_dtype)
    return state


# ------------------------------------------------------------------------------------ tensor-parallel form


@dataclass(frozen=True)
class LocalSpec:
    """One local tensor of an engine rank and how it is cut from the full tensors."""

    name: str
    shape: tuple[int, ...]
    cat_dim: int
    parts: tuple[ShardPart, ...]
    dtype: DType | None = None  # None: the model's
    block: tuple[int, int] | None = None  # an fp8-block weight; its scale is the next spec, name + SCALE_SUFFIX

    @property
    def scale(self) -> str | None:
        return None if self.block is None else self.name + SCALE_SUFFIX


def _quantized(spec: LocalSpec, block: tuple[int, int]) -> tuple[LocalSpec, LocalSpec]:
    """``spec`` as an FP8 block weight, and its scale's spec (the tiles of the same cut: ``block_scale_cut``)."""
    weight = LocalSpec(spec.name, spec.shape, spec.cat_dim, spec.parts, "float8_e4m3fn", block)
    shape, cat_dim, parts = block_scale_cut(spec.name, spec.shape, spec.cat_dim, spec.parts, block)
    return weight, LocalSpec(spec.name + SCALE_SUFFIX, shape, cat_dim, parts, "float32")


def _whole(name: str, shape: tuple[int, ...]) -> LocalSpec:
    return LocalSpec(name, shape, 0, (ShardPart(source=name, full_shape=shape, dim=0, start=0, length=shape[0]),))


def local_layout(tp: int, rank: int, config: ModelConfig = DEFAULT_CONFIG) -> tuple[LocalSpec, ...]:
    """Rank ``rank`` of ``tp``: its local tensors, in buffer (and manifest) order. Pure."""
    config.check_tp(tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside tp={tp}")
    full = full_shapes(config)
    c = config
    hidden = c.hidden_size
    q_r = c.num_heads // tp * c.head_dim
    kv_r = c.num_kv_heads // tp * c.head_dim
    inter_r = c.intermediate_size // tp

    def rows(source: str, length: int) -> ShardPart:
        return ShardPart(source=source, full_shape=full[source], dim=0, start=rank * length, length=length)

    def cols(source: str, length: int) -> ShardPart:
        return ShardPart(source=source, full_shape=full[source], dim=1, start=rank * length, length=length)

    specs = [_whole("model.embed_tokens.weight", full["model.embed_tokens.weight"])]
    for i in range(c.num_layers):
        p = _layer(i)
        attn, mlp = f"{p}.self_attn", f"{p}.mlp"
        specs += [
            _whole(f"{p}.input_layernorm.weight", (hidden,)),
            LocalSpec(
                f"{attn}.qkv_proj.weight",
                (q_r + 2 * kv_r, hidden),
                0,
                (
                    rows(f"{attn}.q_proj.weight", q_r),
                    rows(f"{attn}.k_proj.weight", kv_r),
                    rows(f"{attn}.v_proj.weight", kv_r),
                ),
            ),
            LocalSpec(f"{attn}.o_proj.weight", (hidden, q_r), 1, (cols(f"{attn}.o_proj.weight", q_r),)),
            _whole(f"{p}.post_attention_layernorm.weight", (hidden,)),
            LocalSpec(
                f"{mlp}.gate_up_proj.weight",
                (2 * inter_r, hidden),
                0,
                (rows(f"{mlp}.gate_proj.weight", inter_r), rows(f"{mlp}.up_proj.weight", inter_r)),
            ),
            LocalSpec(f"{mlp}.down_proj.weight", (hidden, inter_r), 1, (cols(f"{mlp}.down_proj.weight", inter_r),)),
        ]
    specs += [_whole("model.norm.weight", (hidden,)), _whole("lm_head.weight", full["lm_head.weight"])]
    if config.quantization:
        specs = [q for spec in specs for q in (_quantized(spec, c.block) if spec.name.endswith(LINEAR_WEIGHTS)
                                               else (spec,))]  # fmt: skip
    return tuple(specs)


def quantized_full(full: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """What the engine's checkpoint holds for the trainer's ``full`` weights: unchanged without quantization; for an
    FP8 block target every linear weight ``X`` as ``fp8_block`` makes it, with ``X_scale_inv``."""
    if not config.quantization:
        return dict(full)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        if name.endswith(TRAINER_LINEAR_WEIGHTS):
            out[name], out[name + SCALE_SUFFIX] = fp8_block(tensor, config.block)
        else:
            out[name] = tensor
    return out


def dequantized(local: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """An engine rank's weights as float32, FP8 block weights multiplied out by their scales (what it computes with)."""
    if not config.quantization:
        return {name: t.float() for name, t in local.items()}
    return {
        name: dequantize(t, local[name + SCALE_SUFFIX], config.block) if t.dtype == torch.float8_e4m3fn else t.float()
        for name, t in local.items()
        if not name.endswith(SCALE_SUFFIX)
    }


def shard(full: Mapping[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """The reference resharding: rank ``rank``'s local tensors, cut from ``full`` with plain tensor ops. ``full`` may
    be a quantized checkpoint (:func:`quantized_full`): each ``X_scale_inv`` is cut and fused as ``X`` is.

    Deliberately written without :func:`local_layout`, so each can check the other.
    """
    out: dict[str, torch.Tensor] = {}

    def piece(name: str, dim: int) -> torch.Tensor:
        return full[name].chunk(tp, dim=dim)[rank]

    for name, tensor in full.items():
        suffix = SCALE_SUFFIX if name.endswith(SCALE_SUFFIX) else ""
        base = name.removesuffix(suffix)
        if base.endswith((".k_proj.weight", ".v_proj.weight", ".up_proj.weight")):
            continue  # folded into their fused partner below
        if base.endswith(".q_proj.weight"):
            stem = base.removesuffix(".q_proj.weight")
            fused = [piece(f"{stem}.{w}_proj.weight{suffix}", 0) for w in ("q", "k", "v")]
            out[f"{stem}.qkv_proj.weight{suffix}"] = torch.cat(fused, dim=0)
        elif base.endswith(".gate_proj.weight"):
            stem = base.removesuffix(".gate_proj.weight")
            gate_up = [piece(name, 0), piece(f"{stem}.up_proj.weight{suffix}", 0)]
            out[f"{stem}.gate_up_proj.weight{suffix}"] = torch.cat(gate_up, dim=0)
        elif base.endswith((".o_proj.weight", ".down_proj.weight")):
            out[name] = piece(name, 1).contiguous()
        else:
            out[name] = tensor.clone()
    return out


def local_state(full: Mapping[str, torch.Tensor], tp: int, rank: int, config: ModelConfig) -> dict[str, torch.Tensor]:
    """What engine rank ``rank`` of ``tp`` holds for the trainer's ``full`` weights (quantized where ``config`` is)."""
    return shard(quantized_full(full, config), tp, rank)


class RankWeights:
    """One engine rank's parameters: views into ONE flat contiguous buffer, packed in layout order.

    Tensors are packed back to back (every offset is a multiple of the dtype's item size, so no gaps),
    which makes the whole buffer one registered region and lets a bucket be one transfer request.
    """

    def __init__(self, tp: int, rank: int, config: ModelConfig = DEFAULT_CONFIG) -> None:
        self.config = config
        self.tp = tp
        self.rank = rank
        self.specs = local_layout(tp, rank, config)
        self.dtypes: dict[str, DType] = {spec.name: spec.dtype or config.dtype for spec in self.specs}
        self.offsets: dict[str, int] = {}
        cursor = 0
        for spec in self.specs:
            itemsize = ITEMSIZE[self.dtypes[spec.name]]
            cursor = -(-cursor // itemsize) * itemsize  # aligned for its dtype (an FP8 weight may end odd)
            self.offsets[spec.name] = cursor
            cursor += math.prod(spec.shape) * itemsize
        self.nbytes = cursor
        self.buffer = torch.zeros(self.nbytes, dtype=torch.uint8)
        self.params = self.views(self.buffer)

    def new_buffer(self) -> torch.Tensor:
        """A zeroed buffer with this rank's size, e.g. for staging."""
        return torch.zeros(self.nbytes, dtype=torch.uint8)

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """This rank's parameters as views into ``buffer`` (which must have this layout's size)."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != self.nbytes:
            raise ValueError(f"buffer must be a flat uint8 tensor of {self.nbytes} bytes")
        out = {}
        for spec in self.specs:
            start, dtype = self.offsets[spec.name], self.dtypes[spec.name]
            raw = buffer[start : start + math.prod(spec.shape) * ITEMSIZE[dtype]]
            out[spec.name] = raw.view(TARGET_DTYPES[dtype]).view(spec.shape)
        return out

    def load(self, local: Mapping[str, torch.Tensor]) -> None:
        """Copy a local state (as from :func:`shard`) into the live buffer."""
        missing = {s.name for s in self.specs} - set(local)
        if missing:
            raise KeyError(f"local state lacks {sorted(missing)[:5]}")
        for name, param in self.params.items():
            param.copy_(local[name])

    def manifest(
        self,
        *,
        engine: int,
        session_id: str,
        buffer: torch.Tensor | None = None,
        staging: bool = False,
    ) -> Manifest:
        """The manifest for this rank with addresses in ``buffer`` (default: the live buffer)."""
        target = self.buffer if buffer is None else buffer
        if target.numel() != self.nbytes:
            raise ValueError(f"buffer must hold {self.nbytes} bytes")
        base = target.data_ptr()
        entries = [
            TensorEntry(
                name=spec.name,
                dtype=self.dtypes[spec.name],
                shape=spec.shape,
                address=base + self.offsets[spec.name],
                nbytes=math.prod(spec.shape) * ITEMSIZE[self.dtypes[spec.name]],
                cat_dim=spec.cat_dim,
                parts=spec.parts,
                quantize=None if spec.block is None else "fp8-block",
                block=spec.block,
                scale=spec.scale,
            )
            for spec in self.specs
        ]
        return Manifest(
            engine=engine,
            rank=self.rank,
            session_id=session_id,
            tensors=tuple(entries),
            regions=(Region(address=base, nbytes=self.nbytes),),
            staging=staging,
        )


# ------------------------------------------------------------------------------------------------ forward


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form) for ``x`` of shape [heads, T, head_dim]."""
    _, seq, dim = x.shape
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    first, second = x[..., : dim // 2], x[..., dim // 2 :]
    return x * cos + torch.cat([-second, first], -1) * sin


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int, n_kv: int, config: ModelConfig
) -> torch.Tensor:
    """Causal GQA over [T, n*head_dim] projections; returns [T, n_heads*head_dim]."""
    seq, hd = q.shape[0], config.head_dim
    qh = _rope(q.view(seq, n_heads, hd).transpose(0, 1), config.rope_theta)
    kh = _rope(k.view(seq, n_kv, hd).transpose(0, 1), config.rope_theta)
    vh = v.view(seq, n_kv, hd).transpose(0, 1)
    group = n_heads // n_kv
    kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
    scores = qh @ kh.transpose(1, 2) / math.sqrt(hd)
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return (probs @ vh).transpose(0, 1).reshape(seq, n_heads * hd)


def _tokens(tokens: Sequence[int] | torch.Tensor, config: ModelConfig) -> torch.Tensor:
    ids = torch.as_tensor(tokens, dtype=torch.long)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError("tokens must be a non-empty 1-D sequence")
    if int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size:
        raise ValueError(f"token ids must be in [0, {config.vocab_size})")
    return ids


def forward_full(
    full: Mapping[str, torch.Tensor], tokens: Sequence[int] | torch.Tensor, config: ModelConfig = DEFAULT_CONFIG
) -> torch.Tensor:
    """Logits [T, vocab] (float32) of the trainer-side model for one sequence."""
    ids = _tokens(tokens, config)
    w = {name: t.float() for name, t in full.items()}
    h = w["model.embed_tokens.weight"][ids]
    for i in range(config.num_layers):
        p = _layer(i)
        x = _rms_norm(h, w[f"{p}.input_layernorm.weight"], config.rms_eps)
        q, k, v = (x @ w[f"{p}.self_attn.{n}_proj.weight"].T for n in ("q", "k", "v"))
        attn = _attention(q, k, v, config.num_heads, config.num_kv_heads, config)
        h = h + attn @ w[f"{p}.self_attn.o_proj.weight"].T
        x = _rms_norm(h, w[f"{p}.post_attention_layernorm.weight"], config.rms_eps)
        gate, up = x @ w[f"{p}.mlp.gate_proj.weight"].T, x @ w[f"{p}.mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[f"{p}.mlp.down_proj.weight"].T
    return _rms_norm(h, w["model.norm.weight"], config.rms_eps) @ w["lm_head.weight"].T


def forward_tp(
    ranks: Sequence[Mapping[str, torch.Tensor]],
    tokens: Sequence[int] | torch.Tensor,
    config: ModelConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """Logits [T, vocab] of one engine whose rank ``r`` holds ``ranks[r]`` (local, fused tensors).

    Column-parallel projections run per rank on that rank's heads / intermediate slice; row-parallel
    outputs are summed over ranks in rank order (the all-reduce), so the result is deterministic.
    Replicated tensors are read from rank 0.
    """
    tp = len(ranks)
    config.check_tp(tp)
    ids = _tokens(tokens, config)
    w = [dequantized(r, config) for r in ranks]
    n_heads, n_kv, inter = config.num_heads // tp, config.num_kv_heads // tp, config.intermediate_size // tp
    q_out, kv_out = n_heads * config.head_dim, n_kv * config.head_dim
    h = w[0]["model.embed_tokens.weight"][ids]
    for i in range(config.num_layers):
        p = _layer(i)
        x = _rms_norm(h, w[0][f"{p}.input_layernorm.weight"], config.rms_eps)
        partial = []
        for local in w:
            qkv = x @ local[f"{p}.self_attn.qkv_proj.weight"].T
            q, k, v = qkv[:, :q_out], qkv[:, q_out : q_out + kv_out], qkv[:, q_out + kv_out :]
            partial.append(_attention(q, k, v, n_heads, n_kv, config) @ local[f"{p}.self_attn.o_proj.weight"].T)
        h = h + _all_reduce(partial)
        x = _rms_norm(h, w[0][f"{p}.post_attention_layernorm.weight"], config.rms_eps)
        partial = []
        for local in w:
            gate_up = x @ local[f"{p}.mlp.gate_up_proj.weight"].T
            gate, up = gate_up[:, :inter], gate_up[:, inter:]
            partial.append((torch.nn.functional.silu(gate) * up) @ local[f"{p}.mlp.down_proj.weight"].T)
        h = h + _all_reduce(partial)
    return _rms_norm(h, w[0]["model.norm.weight"], config.rms_eps) @ w[0]["lm_head.weight"].T


def _all_reduce(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def greedy(logits_of: Callable[[list[int]], torch.Tensor], tokens: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of ``tokens`` for ``max_new_tokens`` steps; ``logits_of(ids) -> [T, vocab]``."""
    ids = list(tokens)
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(logits_of(ids)[-1].argmax())
        out.append(nxt)
        ids.append(nxt)
    return out
