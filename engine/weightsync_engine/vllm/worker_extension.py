"""A vLLM worker extension
(``--worker-extension-cls weightsync_engine.vllm.worker_extension.WeightsyncWorkerExtension``): vLLM's own
per-parameter sha256, many parameters at once.

``/weight_checker {"action": "checksum"}`` (vLLM's ``compute_tensor_digests``) copies each parameter to the host
and hashes it, one after another, in the worker while vLLM is paused: on an H200 it took 20.8 s for the 15.7 GB of
an 8B model's rank (0.76 GB/s; the copy alone took 0.29 s, ``bench/vllm_verify_bench.py``), so a live round's
verification, not its transfer, would set the pause. This method computes exactly the same digests, under the same
keys, over vLLM's own iteration of the parameters, on a thread pool with pinned staging: ``hashlib`` and torch's
copies release the GIL, so the parameters hash in parallel, bounded by the largest one. The live adapter calls it
through vLLM's stock ``/collective_rpc`` route (dev mode), one answer per worker, and falls back to
``/weight_checker`` where the server was started without the extension.

Standalone: the standard library, ``torch`` and ``vllm``; mixed into vLLM's worker class, so it reaches the worker's
own ``_weight_checksum_prefix`` and ``model_runner``.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

#: The most threads one worker hashes with.
MAX_THREADS = 16
#: How much of a device tensor goes to the host at a time, per thread (the pinned buffer each thread holds).
CHUNK_BYTES = 32 << 20
#: The method name ``/collective_rpc`` calls (the live adapter's ``DIGEST_METHOD``).
DIGEST_METHOD = "weightsync_checksums"


def parallel_digests(tensors: Iterable[tuple[str, torch.Tensor]], threads: int | None = None) -> dict[str, str]:
    """sha256 of each tensor's bytes (``compute_tensor_digests``' own bytes: contiguous, flattened, as uint8), hashed
    ``threads`` at a time. A device tensor goes to the host in :data:`CHUNK_BYTES` pieces through one pinned buffer
    per thread (a DMA copy; vLLM's ``.cpu()`` makes a pageable copy of the whole tensor), each piece fed to the hash
    as it lands: the same digest, a bounded amount of host memory."""
    named = list(tensors)
    local = threading.local()

    def digest(tensor: torch.Tensor) -> str:
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        hasher = hashlib.sha256()
        if flat.device.type == "cpu":
            hasher.update(flat.numpy().data)
            return hasher.hexdigest()
        staging = getattr(local, "staging", None)
        if staging is None:
            staging = local.staging = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
        for start in range(0, flat.numel(), CHUNK_BYTES):
            piece = flat[start : start + CHUNK_BYTES]
            host = staging[: piece.numel()]
            host.copy_(piece)  # synchronous: the piece is on the host when this returns
            hasher.update(host.numpy().data)
        return hasher.hexdigest()

    workers = threads or min(MAX_THREADS, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="weightsync-digest") as pool:
        sums = list(pool.map(digest, (tensor for _, tensor in named)))
    return {name: value for (name, _), value in zip(named, sums, strict=True)}


class WeightsyncWorkerExtension:
    """Methods added to vLLM's worker (``--worker-extension-cls``), called through ``/collective_rpc``."""

    def weightsync_checksums(self) -> dict[str, str]:
        """``/weight_checker``'s checksums of this worker, keyed as it keys them, computed in parallel."""
        from vllm.model_executor.model_loader.weight_checksum import _weights

        worker: Any = self
        prefix = worker._weight_checksum_prefix()
        digests = parallel_digests(_weights(worker.model_runner.get_model()))
        return {prefix + name: value for name, value in digests.items()}
