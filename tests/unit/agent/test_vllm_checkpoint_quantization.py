"""Which receive-buffer tensors the sources quantize for a vLLM target (``targets/vllm/checkpoint_quantization.py``):
a W8A8 INT8 or FP8 channel checkpoint's weights with their scales; everything else refused by name."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from weightsync_agent.layout.manifest import Manifest, ManifestError, TensorEntry
from weightsync_agent.targets.vllm.adapter import manifest_of
from weightsync_agent.targets.vllm.checkpoint_quantization import channel_scales

SCHEME = {"num_bits": 8, "type": "int", "symmetric": True}


def config(**weights: Any) -> dict[str, Any]:
    kind = weights.get("type", "int")
    return {
        "quant_method": "compressed-tensors",
        "config_groups": {"g": {"weights": {**SCHEME, "strategy": "channel", **weights},
                                "input_activations": {**SCHEME, "type": kind, "strategy": "token", "dynamic": True}}},
    }  # fmt: skip


def slot(name: str, dtype: str, shape: list[int]) -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": shape}


PROJ = [
    slot("l.q.weight", "int8", [8, 4]),
    slot("l.q.weight_scale", "bfloat16", [8, 1]),
    slot("n.weight", "bfloat16", [4]),
]


FP8_PROJ = [slot("l.q.weight", "float8_e4m3fn", [8, 4]), *PROJ[1:]]


def test_an_int8_or_fp8_channel_checkpoint_pairs_weights_with_scales() -> None:
    assert channel_scales({"quantization": config(), "tensors": PROJ}) == {
        "l.q.weight": ("l.q.weight_scale", "int8-channel")
    }
    assert channel_scales({"quantization": config(type="float"), "tensors": FP8_PROJ}) == {
        "l.q.weight": ("l.q.weight_scale", "fp8-channel")
    }


def test_an_unquantized_checkpoint_quantizes_nothing() -> None:
    assert channel_scales({"quantization": None, "tensors": PROJ[2:]}) == {}
    with pytest.raises(ManifestError, match=r"not quantized but holds l\.q\.weight"):
        channel_scales({"quantization": None, "tensors": PROJ})


@pytest.mark.parametrize(
    ("quantization", "tensors", "says"),
    [
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, PROJ, "quantized as 'fp8'"),
        (config(strategy="group"), PROJ, "not 8-bit \\(int or float\\) symmetric per channel"),
        (config(symmetric=False), PROJ, "not 8-bit"),
        (config(type="float", strategy="tensor"), FP8_PROJ, "not 8-bit"),  # per-tensor FP8: vLLM's CPU build can't
        (config(type="float"), PROJ, "int8 in a checkpoint whose quantized weights are float8_e4m3fn"),
        (config(), FP8_PROJ, "float8_e4m3fn in a checkpoint whose quantized weights are int8"),
        (config(dynamic=True), PROJ, "dynamic weight quantization"),
        (config(), [*PROJ, slot("l.q.input_scale", "float32", [1])], "static or asymmetric"),
        (config(), [slot("l.q.weight", "int8", [8, 4])], "weight_scale beside it"),
        (
            config(),
            [slot("l.q.weight", "int8", [8, 4]), slot("l.q.weight_scale", "bfloat16", [4, 1])],
            "float \\[8, 1\\]",
        ),
        ({**config(), "config_groups": {}}, PROJ, "without config_groups"),
    ],
)
def test_what_weightsync_does_not_make_is_refused_by_name(quantization: Any, tensors: Any, says: str) -> None:
    with pytest.raises(ManifestError, match=says):
        channel_scales({"quantization": quantization, "tensors": tensors})


def buffer_layout(scale_shape: list[int]) -> dict[str, Any]:
    slots, offset = [], 0
    tensors = [("l.q.weight", "int8", [8, 4], 32), ("l.q.weight_scale", "bfloat16", scale_shape, 2 * scale_shape[0]),
               ("n.weight", "bfloat16", [4], 8)]  # fmt: skip
    for name, dtype, shape, nbytes in tensors:
        slots.append({"name": name, "dtype": dtype, "shape": shape, "offset": offset, "nbytes": nbytes})
        offset += 64
    return {"address": 4096, "nbytes": offset, "session_id": "h:1", "tensors": slots, "quantization": config()}


def test_the_manifest_marks_quantized_weights_and_checks_their_scales() -> None:
    manifest = manifest_of(0, 0, buffer_layout([8, 1]))
    by_name = {t.name: t for t in manifest.tensors}
    assert (by_name["l.q.weight"].quantize, by_name["l.q.weight"].scale) == ("int8-channel", "l.q.weight_scale")
    assert by_name["l.q.weight_scale"].quantize is None and by_name["n.weight"].quantize is None
    # An unquantized manifest describes (and fingerprints) its tensors as before quantized entries existed.
    assert "quantize" not in by_name["n.weight"].model_dump(exclude_none=True)
    with pytest.raises(ValidationError, match=r"must be a float \[8, 1\]"):
        Manifest.model_validate({**manifest.model_dump(), "tensors": [
            {**t.model_dump(), "dtype": "int32", "nbytes": 32} if t.name == "l.q.weight_scale" else t.model_dump()
            for t in manifest.tensors]})  # fmt: skip
    with pytest.raises(ValidationError, match="names its method and its scale's entry together"):
        TensorEntry.model_validate({**by_name["l.q.weight"].model_dump(), "scale": None})
