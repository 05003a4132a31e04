"""The plugin's worker extension hashes exactly what vLLM's ``/weight_checker`` hashes (weightsync_engine/vllm/
worker_extension.py): vLLM's own expression, per tensor, in parallel; the names and order kept."""

from __future__ import annotations

import hashlib

import pytest
import torch

from weightsync_engine.vllm.worker_extension import parallel_digests


def vllm_digest(tensor: torch.Tensor) -> str:
    """``vllm/model_executor/model_loader/weight_checksum.py``'s expression (vLLM 0.32.0), written out."""
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


@pytest.mark.parametrize("threads", [1, 4])
def test_digests_equal_vllms_for_every_dtype_and_layout(threads: int) -> None:
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(64, 48, generator=generator)
    tensors = {
        "bf16": base.to(torch.bfloat16),
        "fp16": base.to(torch.float16),
        "fp32": base,
        "int64": torch.arange(100),
        "strided": base.t(),  # vLLM makes it contiguous first: so do we
        "scalar": torch.tensor(1.5),
        "empty": torch.empty(0),
    }
    sums = parallel_digests(tensors.items(), threads=threads)
    assert list(sums) == list(tensors)
    assert sums == {name: vllm_digest(t) for name, t in tensors.items()}
    assert sums["strided"] != sums["fp32"]
