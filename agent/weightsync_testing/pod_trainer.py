"""A trainer container's program for multi-pod tests: one ``torchrun`` job over the group's trainer pods.

``torchrun --nnodes $(WEIGHTSYNC_NNODES) --node-rank $(WEIGHTSYNC_NODE_RANK) --nproc-per-node
$(WEIGHTSYNC_NPROC_PER_NODE) --rdzv-endpoint $(WEIGHTSYNC_DIST_INIT_ADDR) -m weightsync_testing.pod_trainer MODEL
VERSION`` — the operator's workload identity and nothing else. Every rank joins the job's gloo group (the rendezvous on
trainer pod 0), takes one "training step" that the ranks agree on through an all-reduce (as a data-parallel step's
gradients do), stages the step's weights (the tiny HF model's ``trained_state``) through ``WeightSyncClient.from_env``
and publishes ``VERSION``; it prints one JSON line with its outcome and exits 0 only if the round succeeded.
Test-only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from weightsync_agent.client import WeightSyncClient
from weightsync_testing.sglang_models import trained_state


def main(argv: list[str]) -> int:
    model_dir, version = Path(argv[0]), int(argv[1])
    dist.init_process_group("gloo")  # torchrun's environment: the store on the rendezvous endpoint
    rank, world = dist.get_rank(), dist.get_world_size()
    step = torch.tensor([float(version)])
    dist.all_reduce(step)  # every rank's step, summed: they agree on the version they train
    agreed = int(step.item()) // world
    client = WeightSyncClient.from_env()
    try:
        client.stage_many(trained_state(model_dir, agreed))
        outcome = client.publish(agreed, check=False)
    finally:
        client.close()
    print(json.dumps({"rank": rank, "world": world, "version": agreed, "ok": outcome.ok,
                      "summary": outcome.summary()}), flush=True)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
