"""Per-tensor checksum schemes: what a source reports for engines that verify with their own hash (SGLang)."""

from __future__ import annotations

import pytest
import torch

from weightsync_agent.layout.checksums import tensor_checksums
from weightsync_agent.layout.manifest import Manifest
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
