"""One member of a unique-id NCCL group, doing what a stock vLLM worker's ``nccl`` backend does (a GPU test's peer).

vLLM's worker (``PyNcclCommunicator.from_unique_id_bytes`` then ``NCCLWeightTransferEngine.receive_weights`` with
``packed: false``): ``ncclCommInitRank`` from the 128-byte id at its rank, a one-element float32 sum ``all_reduce``,
then per announced tensor an empty CUDA tensor of that dtype and shape and one ``ncclBroadcast`` from rank 0. This
peer does the same through weightsync's NCCL binding (vLLM is not installed on the GPU machine), and prints, as one
JSON line, the sha256 of every tensor it received and the warm-up's sum.

    python nccl_uid_peer.py --rank R --world W --uid B64 --tensors JSON
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch

from weightsync_agent.transport.nccl_library import NcclLibrary
from weightsync_agent.transport.nccl_uid_group import unique_id_of


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--uid", required=True, help="nccl-uid:<base64>, as engines are told")
    parser.add_argument("--tensors", required=True, help='[["name", "dtype", [shape]], ...]')
    args = parser.parse_args()
    torch.cuda.set_device(args.rank % torch.cuda.device_count())
    nccl = NcclLibrary()
    comm = nccl.init_rank(args.world, unique_id_of(args.uid), args.rank)
    stream = torch.cuda.current_stream().cuda_stream
    warm_up = torch.zeros(1, dtype=torch.float32, device="cuda")
    nccl.all_reduce_sum(warm_up.data_ptr(), 1, "float32", comm, stream)
    received = {}
    for name, dtype, shape in json.loads(args.tensors):
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
        nccl.broadcast(tensor.data_ptr(), tensor.numel(), dtype, 0, comm, stream)
        torch.cuda.synchronize()
        received[name] = hashlib.sha256(tensor.cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
    nccl.abort(comm)
    print(json.dumps({"rank": args.rank, "warm_up": float(warm_up.item()), "sha256": received}), flush=True)


if __name__ == "__main__":
    main()
