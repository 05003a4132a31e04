"""Which tensors of a vLLM receive buffer the sources quantize, from the checkpoint's own ``quantization_config``.

A staged vLLM target receives the checkpoint's tensors as its files hold them; a quantized checkpoint holds
quantized weights, while an RL trainer stages float tensors. The sources make them (``layout/quantize.py``) in the
formats whose contract weightsync checks end to end into vLLM here: compressed-tensors W8A8, symmetric per output
channel, with dynamic activation scales, as INT8 (``format: int-quantized``, ``weight`` int8) or FP8
(``float-quantized``, ``weight`` float8_e4m3fn): ``weight`` ``[out, in]``, ``weight_scale`` ``[out, 1]``; nothing
else per layer. Anything else quantized is refused by name rather than written in a format nobody checked
(docs/engines/vllm.md, "Quantized targets").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from weightsync_agent.layout.manifest import FLOAT_SCALES, ManifestError

#: The per-layer tensors of a W8A8 channel checkpoint, besides ``weight``: a static or asymmetric scheme adds
#: ``input_scale``/``weight_zero_point``/``input_zero_point``, which a BF16 trainer does not have.
SCALE = "weight_scale"
#: Per compressed-tensors weight type: the quantized weight's dtype and how the sources make it.
SCHEMES: dict[str, tuple[str, str]] = {"int": ("int8", "int8-channel"), "float": ("float8_e4m3fn", "fp8-channel")}
#: The dtypes of quantized weights (an unquantized checkpoint holds none).
QUANTIZED_DTYPES = ("int8", "uint8", "float8_e4m3fn")


def channel_scales(layout: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """Quantized weight name -> (its scale's name, how the sources quantize it: ``int8-channel`` or ``fp8-channel``),
    for a receive buffer ``layout`` (the plugin's JSON: ``tensors``, ``quantization``); empty for an unquantized
    checkpoint. Raises :class:`ManifestError` saying why otherwise."""
    config = layout.get("quantization")
    slots: Sequence[Mapping[str, Any]] = layout.get("tensors") or ()
    if not config:
        quantized = [s["name"] for s in slots if s.get("dtype") in QUANTIZED_DTYPES]
        if quantized:
            raise ManifestError(f"the checkpoint says it is not quantized but holds {quantized[0]} as "
                                f"{next(s['dtype'] for s in slots if s['name'] == quantized[0])}")  # fmt: skip
        return {}
    dtype, scheme = SCHEMES[_check_config(config)]
    by_name = {str(s["name"]): s for s in slots}
    out: dict[str, tuple[str, str]] = {}
    for name, slot in by_name.items():
        if name.endswith((".input_scale", ".weight_zero_point", ".input_zero_point")):
            raise ManifestError(f"{name}: a static or asymmetric scheme; weightsync quantizes symmetric "
                                "per-channel weights with dynamic activations only")  # fmt: skip
        if slot.get("dtype") in QUANTIZED_DTYPES and slot.get("dtype") != dtype:
            raise ManifestError(f"{name}: {slot.get('dtype')} in a checkpoint whose quantized weights are {dtype}")
        if slot.get("dtype") != dtype:
            continue
        shape = [int(d) for d in slot.get("shape", ())]
        scale_name = name.removesuffix("weight") + SCALE
        scale = by_name.get(scale_name)
        if not name.endswith(".weight") or len(shape) != 2 or scale is None:
            raise ManifestError(f"{name}: a {dtype} tensor that is not a 2-D weight with a {SCALE} beside it")
        if scale.get("dtype") not in FLOAT_SCALES or [int(d) for d in scale.get("shape", ())] != [shape[0], 1]:
            raise ManifestError(f"{scale_name}: a per-channel scale is a float [{shape[0]}, 1], not "
                                f"{scale.get('dtype')} {scale.get('shape')}")  # fmt: skip
        out[name] = (scale_name, scheme)
    return out


def _check_config(config: Any) -> str:
    """The weights' compressed-tensors type (``int`` or ``float``), every group the same; ManifestError otherwise."""
    if not isinstance(config, Mapping) or config.get("quant_method") != "compressed-tensors":
        method = config.get("quant_method") if isinstance(config, Mapping) else config
        raise ManifestError(f"the checkpoint is quantized as {method!r}; into vLLM weightsync makes compressed-tensors "
                            "W8A8 INT8 or FP8 (symmetric, per channel, dynamic activations) only")  # fmt: skip
    groups = config.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ManifestError("a compressed-tensors config without config_groups")
    kinds: set[str] = set()
    for group_name, group in groups.items():
        weights = group.get("weights") if isinstance(group, Mapping) else None
        wanted = {"num_bits": 8, "symmetric": True, "strategy": "channel"}
        if (
            not isinstance(weights, Mapping)
            or any(weights.get(k) != v for k, v in wanted.items())
            or weights.get("type") not in SCHEMES
        ):
            raise ManifestError(
                f"config group {group_name}: weights {weights!r} are not 8-bit (int or float) symmetric per channel"
            )
        if weights.get("dynamic"):
            raise ManifestError(f"config group {group_name}: dynamic weight quantization has no checkpoint scales")
        activations = group.get("input_activations")
        if activations is not None and not (isinstance(activations, Mapping) and activations.get("dynamic")):
            raise ManifestError(f"config group {group_name}: static activation scales ({activations!r}) come from "
                                "calibration, which a trainer's tensors do not carry")  # fmt: skip
        kinds.add(str(weights["type"]))
    if len(kinds) > 1:
        raise ManifestError(f"config groups quantize weights as {sorted(kinds)}; weightsync makes one type per model")
    return kinds.pop()
