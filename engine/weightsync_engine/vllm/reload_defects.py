"""Architectures whose staged rounds stock vLLM would apply wrong: its layerwise reload leaves state a fresh load
would not hold. Refused by name at ``/init_weight_transfer_engine`` (the ``buffer`` placement), never synced wrong.

Found by the coverage survey (``weightsync_testing.vllm_coverage``, docs/engines/vllm-coverage.md), for the release
in :data:`VALIDATED_VLLM`; the loading code involved is not platform-specific. Another vLLM release gets no entry
here: re-run the survey for it.
"""

from __future__ import annotations

VALIDATED_VLLM = "0.32.0"

RELOAD_DEFECTS: dict[str, str] = {
    "GptOssForCausalLM": (
        "vLLM's layerwise reload leaves attn.sinks and the experts' w13/w2 weights and biases as they were: GPT-OSS's "
        "load_weights copies them with param.copy_, around the weight_loader the reload wraps"
    ),
    "FalconH1ForCausalLM": (
        "vLLM's layerwise reload leaves mamba.conv_weights stale: a non-persistent buffer viewing conv1d.weight, "
        "which the reload re-materialises"
    ),
    "GraniteMoeHybridForCausalLM": (
        "vLLM's layerwise reload leaves mamba.conv_weights stale: a non-persistent buffer viewing conv1d.weight, "
        "which the reload re-materialises"
    ),
}


def reload_defect(version: str, architectures: list[str] | tuple[str, ...]) -> str | None:
    """Why vLLM ``version`` cannot take a staged round into a model of ``architectures``, or None."""
    if version != VALIDATED_VLLM:
        return None
    for arch in architectures:
        if arch in RELOAD_DEFECTS:
            return f"{arch}: {RELOAD_DEFECTS[arch]} (docs/engines/vllm-coverage.md); staged rounds are refused"
    return None
