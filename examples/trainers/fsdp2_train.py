"""Train with FSDP2 and sync the engines after every step through weightsync (docs/train.md).

Run one process per trainer rank in the trainer pods of a WeightSyncGroup (``torchrun --nproc-per-node=N
examples/trainers/fsdp2_train.py``): the operator gives each pod the environment ``WeightSyncClient.from_env``
reads, and the pod's agent sidecar builds this rank's replica and runs the rounds. Each step trains, then
``stage_module`` makes each FSDP2-sharded parameter whole in turn (``DTensor.full_tensor()``, a collective every
rank enters), copies what this rank's targets need into its replica and drops it, and ``publish`` syncs the
version: rank 0's agent writes every engine, verifies and commits.

The model here is the reference model (``ReferenceLM``: Llama-shaped, HF parameter names) so the example runs on
a laptop and in the tests (``tests/agent/test_trainers.py`` runs it on CPU with gloo against real agents and
reference engines). With your model: build it, ``fully_shard`` it as you do, and pass a converter to
``stage_module`` if its parameter names are not the engines' (see ``megatron_style_tp.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from weightsync_agent.client.modules import stage_module, whole
from weightsync_agent.client.trainer import WeightSyncClient
from weightsync_testing.reference_engine.model import DEFAULT_CONFIG, full_state
from weightsync_testing.reference_engine.torch_module import ReferenceLM, training_loss


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="training steps, one sync after each")
    parser.add_argument("--first-version", type=int, default=1, help="the weight version the first step publishes")
    parser.add_argument("--seed", type=int, default=0, help="the initial weights (the engines' checkpoint)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--stream", action="store_true", help="overlap gathering with the transfer")
    parser.add_argument("--save", type=Path, help="rank 0 writes the trained, unsharded weights here (for checks)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    model = ReferenceLM(full_state(args.seed))
    fully_shard(model)  # every parameter a DTensor sharded over the ranks (dim 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    client = WeightSyncClient.from_env()
    generator = torch.Generator().manual_seed(1234)
    try:
        for step in range(args.steps):
            tokens = torch.randint(0, DEFAULT_CONFIG.vocab_size, (12,), generator=generator)
            loss = training_loss(model, tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            version = args.first_version + step
            if args.stream:
                with client.stream(version) as stream:
                    report = stage_module(stream, model, expected=client.expected())
                outcome_ok, summary = True, "streamed"
            else:
                report = stage_module(client, model)
                outcome = client.publish(version)
                outcome_ok, summary = outcome.ok, outcome.summary()
            print(json.dumps({
                "rank": rank, "version": version, "loss": float(loss), "ok": outcome_ok, "summary": summary,
                "parameters": report.parameters, "staged": report.staged, "staged_bytes": report.staged_bytes,
                "peak_bytes": report.peak_bytes, "largest_parameter_bytes": report.largest_parameter_bytes,
                "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                "seconds": round(report.seconds, 4),
            }), flush=True)  # fmt: skip
        if args.save is not None:
            trained = {name: whole(p.detach()).clone() for name, p in model.named_parameters()}  # every rank gathers
            if rank == 0:
                torch.save(trained, args.save)
    finally:
        client.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
