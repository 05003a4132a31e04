"""Per-tensor checksum schemes: what a source reports for engines that verify with their own hash (SGLang)."""

from __future__ import annotations

import pytest
import torch

from weightsync_agent.layout.checksums import COMPARED_WITH_WEIGHT, fp8_pairs, tensor_checksums
from weightsync_agent.layout.manifest import Manifest
from weightsync_agent.layout.quantize import fp8_block
from weightsync_agent.layout.sglang_hash.tensor_hash import sglang_cpu_hash, sglang_gpu_hash


def _manifest(scheme: str, tensors: dict[str, torch.Tensor]) -> Manifest:
    entries, address = [], 1 << 20
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        part = {"source": name, "fullShape": list(t.shape), "dim": 0, "start": 0, "length": t.shape[0]}
        entries.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "address": address, "nbytes": nbytes, "parts": [part]})  # fmt: skip
        address += nbytes
    region = {"address": 1 << 20, "nbytes": address - (1 << 20)}
    return Manifest.model_validate(
        {"engine": 0, "rank": 0, "sessionId": "s", "tensors": entries, "regions": [region], "checksum": scheme}
    )


@pytest.mark.parametrize(
    ("scheme", "reference"), [("tensor-sha256-8", sglang_cpu_hash), ("tensor-sglang-gpu", sglang_gpu_hash)]
)
def test_a_source_hashes_each_tensor_of_its_replica_as_the_engine_does(scheme: str, reference: object) -> None:
    tensors = {
        "a.weight": torch.randn(37, 5, generator=torch.Generator().manual_seed(1)),
        "b.weight": torch.arange(3000, dtype=torch.bfloat16).reshape(100, 30),
        "c.bias": torch.tensor([7], dtype=torch.int64),
    }
    manifest = _manifest(scheme, tensors)
    replica = torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in tensors.values()])
    got = tensor_checksums(manifest, replica.data_ptr())
    assert got == [reference(t) for t in tensors.values()]  # type: ignore[operator]
    replica[40] ^= 1  # one flipped bit in the first tensor changes its hash only
    flipped = tensor_checksums(manifest, replica.data_ptr())
    assert flipped[0] != got[0] and flipped[1:] == got[1:]


def test_bucket_manifests_have_no_per_tensor_hashes() -> None:
    with pytest.raises(ValueError, match="not a per-tensor scheme"):
        tensor_checksums(_manifest("bucket-xxh3", {"x": torch.zeros(2)}), 1)


def test_a_block_fp8_weight_is_hashed_dequantized_with_its_scale_as_sglangs_checker_does() -> None:
    """SGLang's weight checker hashes a ``(weight, weight_scale_inv)`` pair of an FP8 block module as the weight
    dequantized to bfloat16, and lists no checksum for the scale (``utils/weight_checker.py``, 0.5.23)."""
    generator = torch.Generator().manual_seed(2)
    dense, _ = fp8_block(torch.randn(32, 48, generator=generator), (16, 16))
    experts = torch.stack([fp8_block(torch.randn(32, 16, generator=generator), (16, 16))[0] for _ in range(3)])
    tensors = {
        "o_proj.weight": dense,
        "o_proj.weight_scale_inv": torch.rand(2, 3, generator=generator) + 0.5,
        "experts.w2_weight": experts,  # fused experts: [experts, out, in], scales [experts, out/16, in/16]
        "experts.w2_weight_scale_inv": torch.rand(3, 2, 1, generator=generator) + 0.5,
        "lone.weight": dense.clone(),  # FP8 without a scale: no pair, raw bytes
    }
    manifest = _manifest("tensor-sha256-8", tensors)
    assert fp8_pairs(manifest) == {
        "o_proj.weight": "o_proj.weight_scale_inv",
        "experts.w2_weight": "experts.w2_weight_scale_inv",
    }
    replica = torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in tensors.values()])
    got = tensor_checksums(manifest, replica.data_ptr())
    scale = tensors["o_proj.weight_scale_inv"].repeat_interleave(16, 0).repeat_interleave(16, 1)
    dequantized = (dense.float() * scale).to(torch.bfloat16)
    assert got[0] == sglang_cpu_hash(dequantized) and got[1] == COMPARED_WITH_WEIGHT == got[3]
    expert_scale = tensors["experts.w2_weight_scale_inv"].repeat_interleave(16, 1).repeat_interleave(16, 2)
    assert got[2] == sglang_cpu_hash((experts.float() * expert_scale).to(torch.bfloat16))
    assert got[4] == sglang_cpu_hash(dense)
