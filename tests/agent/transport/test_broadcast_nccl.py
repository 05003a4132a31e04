"""Broadcast mode over NCCL, one process per GPU: runs only where two or more GPUs are visible."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PEER = Path(__file__).with_name("bcast_gpu_peer.py")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")


def test_nccl_broadcast_is_bit_exact_on_every_receiver() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    agent = str(Path(__file__).parents[3] / "agent")
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [agent, os.environ.get("PYTHONPATH")]))}
    world = min(GPUS, 4)
    procs = [
        subprocess.Popen(
            [sys.executable, str(PEER), "--rank", str(r), "--world", str(world), "--init", init],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    try:
        outs = [json.loads(p.communicate(timeout=180)[0].strip().splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert outs[0]["backend"] == "nccl" and int(outs[0]["buckets"]) >= 3
    for out in outs[1:]:
        assert out["version"] == 3 and out["buckets"] == outs[0]["buckets"]
        assert out["exact"] == {"w": True, "big": True, "ids": True}, out
