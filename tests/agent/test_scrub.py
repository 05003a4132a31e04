"""Scrubbing (``transfer.scrubSeconds``, docs/agent.md): between rounds the coordinator has each engine's own checker
hash the weights it serves against what verified the committed version there; an engine that drifted is named, stops
serving (where it can) and is repaired from the replicas by a catch-up of the same version, without a new version.

Here through real agents into reference engines, whose memory takes no transport write between rounds: the drift is a
flipped byte written into the engine process's memory (``/proc/<pid>/mem``, at an address its manifest publishes),
as a memory fault would. Against stock SGLang (a foreign Mooncake write): tests/engines/sglang/test_sglang_faults.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from sync_helpers import TOKENS, expected_checksums, group_spec, training_step

from weightsync.api import names
from weightsync_testing.agent_metrics import metric
from weightsync_testing.engine_harness import ReferenceEngines
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.reference_engine.model import forward_full, full_state
from weightsync_testing.trainer_ranks import publish_all

#: The engine rank whose memory takes the fault, and the scrub period.
RANK = 1
SCRUB_SECONDS = 1


def flip_byte(pid: int, address: int) -> None:
    """Invert one byte of process ``pid``'s memory (a descendant of this process: ptrace rules allow it)."""
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as memory:
        memory.seek(address)
        byte = memory.read(1)
        memory.seek(address)
        memory.write(bytes([byte[0] ^ 0xFF]))


def wait_until(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.mark.parametrize("staging", ["live", "staged"])
def test_a_flipped_byte_between_rounds_is_found_and_repaired_without_a_new_version(staging: str) -> None:
    spec = group_spec(targetStaging=staging, scrubSeconds=SCRUB_SECONDS)
    with LoopbackGroup(spec, group=f"t-scrub-{staging}").start() as group, group.clients() as clients:
        one = training_step(full_state(seed=3), 1)
        assert all(getattr(o, "ok", False) for o in publish_all(clients, one, 1))
        engine = group.engines[0].client()
        bucket = spec.transfer.bucket_size_mi_b * 1024 * 1024
        want = expected_checksums(one, RANK, bucket)
        assert engine.checksums(RANK, bucket) == want
        served = torch.tensor(engine.forward(TOKENS))
        assert torch.allclose(served, forward_full(one, TOKENS), atol=1e-5)

        assert isinstance(group.harness, ReferenceEngines)
        pid = group.harness.processes[0].process.pid
        manifest = engine.manifest(RANK)
        tensor = manifest.tensors[len(manifest.tensors) // 2]
        # Staged, the manifest names the staging twin: the served bytes are the live buffer's, at the same offset.
        live = tensor.address - manifest.regions[0].address + engine.status()["live_addresses"][RANK]
        coordinator = group.agents[0].url
        flip_byte(pid, live)

        # Within a scrub period (and a tick): found, generation stopped, repaired by a catch-up of version 1.
        wait_until("the scrub to find the drift", lambda: engine.status()["scrub_drifts"] == 1, 10 * SCRUB_SECONDS)
        wait_until(
            "the repair",
            lambda: metric(coordinator, "weightsync_agent_rounds_total", kind="catch-up", result="Succeeded") >= 1,
        )
        wait_until("the engine to serve again", lambda: not engine.status()["paused"])
        status = engine.status()
        assert status["weight_version"] == "1" and not status["live_dirty"], status
        assert engine.checksums(RANK, bucket) == want
        assert torch.equal(torch.tensor(engine.forward(TOKENS)), served)
        assert metric(coordinator, "weightsync_agent_scrubs_total", result="drift") == 1
        assert names.DRIFT_FOUND  # the catch-up's reason starts with it (the operator's WeightsDrifted event)

        # A second period finds nothing; the next version commits as usual.
        time.sleep(2 * SCRUB_SECONDS)
        assert engine.status()["scrub_drifts"] == 1
        two = training_step(one, 2)
        assert all(getattr(o, "ok", False) for o in publish_all(clients, two, 2))
        assert engine.weight_version() == "2"
