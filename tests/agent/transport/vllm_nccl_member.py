"""One TP rank of a vLLM engine receiving a broadcast round with vLLM's OWN code (a GPU test's peer).

vLLM's ``NCCLWeightTransferEngine`` (``vllm/distributed/weight_transfer/nccl_engine.py``, the class stock vLLM's
worker builds for ``--weight-transfer-config '{"backend": "nccl"}'``) is constructed as the worker does and driven
as the worker's routes drive it: ``parse_init_info`` + ``init_transfer_engine`` with the adapter's exact
``init_info`` (vLLM's ``PyNcclCommunicator.from_unique_id_bytes``: ``ncclCommInitRank`` and its warm-up), then
``update_weights`` per chunk with the adapter's exact ``update_info`` (an empty tensor and one broadcast per
announced tensor, each handed to the model's ``load_weights``). What is not vLLM's: the model (a module whose
``load_weights`` keeps what it is given) and the worker's parallel config (this rank alone: DP 0, world 1, rank 0,
so vLLM computes its group rank as ``rank_offset``). Prints one JSON line: the sha256 of every tensor loaded.

    python vllm_nccl_member.py --init-info JSON --chunks JSON
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
import types
from types import SimpleNamespace
from typing import Any

import torch


class KeepingModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Any) -> set[str]:
        for name, tensor in weights:
            self.loaded[name] = tensor.detach().clone()
        return set(self.loaded)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--init-info", required=True)
    parser.add_argument("--chunks", required=True, help="a JSON list of update_info objects")
    parser.add_argument("--device", type=int, required=True)
    args = parser.parse_args()
    torch.cuda.set_device(args.device)
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
    from vllm.platforms import current_platform
    from vllm.utils import torch_utils

    if "vllm.model_executor.model_loader.mtp_validation" not in sys.modules and not current_platform.is_cuda():
        # receive_weights wraps its loads in the model loader's disable_mtp_completeness_check (a check for MTP
        # layers, which this model has none of); importing the loader package pulls vLLM's whole serving stack,
        # which the GPU machine lacks. Only where the CPU build stands in: the context manager alone, as a no-op.
        stub = types.ModuleType("vllm.model_executor.model_loader.mtp_validation")
        stub.disable_mtp_completeness_check = contextlib.nullcontext  # type: ignore[attr-defined]
        sys.modules[stub.__name__] = stub
    if not current_platform.is_cuda():
        # The only vLLM Python at hand on the GPU machine is the CPU build's (no CUDA kernels: docs/engines/vllm.md),
        # whose platform hands pynccl a stream placeholder. Give it what vLLM's CUDA platform gives it: a dedicated
        # CUDA stream as the thread's current stream (``vllm.utils.torch_utils.current_stream``).
        torch_utils._current_stream_tls.value = torch.cuda.Stream()

    worker_config = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0), model_config=None
    )
    model = KeepingModel()
    engine = NCCLWeightTransferEngine(
        WeightTransferConfig(backend="nccl"),
        worker_config,
        torch.device("cuda", args.device),
        model,  # type: ignore[arg-type]
    )
    engine.init_transfer_engine(engine.parse_init_info(json.loads(args.init_info)))
    for update_info in json.loads(args.chunks):
        engine.update_weights(update_info)
    sums = {
        name: hashlib.sha256(t.cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for name, t in model.loaded.items()
    }
    engine.shutdown()
    print(json.dumps({"sha256": sums, "order": list(model.loaded)}), flush=True)


if __name__ == "__main__":
    main()
