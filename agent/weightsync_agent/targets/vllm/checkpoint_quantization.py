"""Which tensors of a vLLM receive buffer the sources quantize, from the checkpoint's own ``quantization_config``.

A staged vLLM target receives the checkpoint's tensors as its files hold them; a quantized checkpoint holds
quantized weights, while an RL trainer stages float tensors. The sources make them (``layout/quantize.py``) in the
one format whose contract weightsync checks end to end into vLLM here: compressed-tensors W8A8 INT8, symmetric per
output channel, with dynamic activation scales (``weight`` int8 ``[out, in]``, ``weight_scale`` ``[out, 1]``; nothing
else per layer). Anything else quantized is refused by name rather than written in a format nobody checked
(docs/engines/vllm.md, "Quantized targets").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from weightsync_agent.layout.manifest import FLOAT_SCALES, ManifestError

#: The per-layer tensors of a W8A8 INT8 channel checkpoint, besides ``weight``: a static or asymmetric scheme adds
#: ``input_scale``/``weight_zero_point``/``input_zero_point``, which a BF16 trainer does not have.
SCALE = "weight_scale"


def int8_channel_scales(layout: Mapping[str, Any]) -> dict[str, str]:
    """Quantized weight name -> its scale's name, for a receive buffer ``layout`` (the plugin's JSON: ``tensors``,
    ``quantization``); empty for an unquantized checkpoint. Raises :class:`ManifestError` saying why otherwise."""
    config = layout.get("quantization")
    slots: Sequence[Mapping[str, Any]] = layout.get("tensors") or ()
    if not config:
        quantized = [s["name"] for s in slots if s.get("dtype") in ("int8", "uint8", "float8_e4m3fn")]
        if quantized:
            raise ManifestError(f"the checkpoint says it is not quantized but holds {quantized[0]} as "
                                f"{next(s['dtype'] for s in slots if s['name'] == quantized[0])}")  # fmt: skip
        return {}
    _check_config(config)
    by_name = {str(s["name"]): s for s in slots}
    out: dict[str, str] = {}
    for name, slot in by_name.items():
        if name.endswith((".input_scale", ".weight_zero_point", ".input_zero_point")):
            raise ManifestError(f"{name}: a static or asymmetric INT8 scheme; weightsync quantizes symmetric "
                                "per-channel weights with dynamic activations only")  # fmt: skip
        if slot.get("dtype") != "int8":
            continue
        shape = [int(d) for d in slot.get("shape", ())]
        scale_name = name.removesuffix("weight") + SCALE
        scale = by_name.get(scale_name)
        if not name.endswith(".weight") or len(shape) != 2 or scale is None:
            raise ManifestError(f"{name}: an int8 tensor that is not a 2-D weight with a {SCALE} beside it")
        if scale.get("dtype") not in FLOAT_SCALES or [int(d) for d in scale.get("shape", ())] != [shape[0], 1]:
            raise ManifestError(f"{scale_name}: a per-channel scale is a float [{shape[0]}, 1], not "
                                f"{scale.get('dtype')} {scale.get('shape')}")  # fmt: skip
        out[name] = scale_name
    return out


def _check_config(config: Any) -> None:
    if not isinstance(config, Mapping) or config.get("quant_method") != "compressed-tensors":
        method = config.get("quant_method") if isinstance(config, Mapping) else config
        raise ManifestError(f"the checkpoint is quantized as {method!r}; into vLLM weightsync makes compressed-tensors "
                            "W8A8 INT8 (symmetric, per channel, dynamic activations) only")  # fmt: skip
    groups = config.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ManifestError("a compressed-tensors config without config_groups")
    for group_name, group in groups.items():
        weights = group.get("weights") if isinstance(group, Mapping) else None
        wanted = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
        if not isinstance(weights, Mapping) or any(weights.get(k) != v for k, v in wanted.items()):
            raise ManifestError(f"config group {group_name}: weights {weights!r} are not INT8 symmetric per channel")
        if weights.get("dynamic"):
            raise ManifestError(f"config group {group_name}: dynamic weight quantization has no checkpoint scales")
        activations = group.get("input_activations")
        if activations is not None and not (isinstance(activations, Mapping) and activations.get("dynamic")):
            raise ManifestError(f"config group {group_name}: static activation scales ({activations!r}) come from "
                                "calibration, which a trainer's tensors do not carry")  # fmt: skip
