"""The data plane against real processes: Mooncake's listening ports are pinned into the group's range.

The group's NetworkPolicy opens ``transfer.mooncakePorts`` to the group's own pods only; that is worth something
only if every Mooncake socket of the group listens inside it. A loopback group (``weightsync agent`` processes,
reference engine processes, Mooncake over TCP) runs with a range picked free on this machine: the agents get it
from the plan, the engines from MC_MIN_RPC_PORT/MC_MAX_RPC_PORT in their environment, as the operator sets the
engine container's. Checked from /proc: every listening socket of every process is its HTTP port or inside the
range, and rounds land. A range with no free port fails with one clear line; a range Mooncake would ignore
(Linux's ephemeral ports) is refused before Mooncake sees it.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import ExitStack
from typing import cast

import pytest
import torch

from weightsync.api.engines import ENGINE_KINDS
from weightsync.api.token import new_token
from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_agent.transport.mooncake_config import MooncakeSettings, check_port_range
from weightsync_testing.engine_harness import ReferenceEngines
from weightsync_testing.listening import free_block, listening_ports
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.reference_engine.launch import launch_engine
from weightsync_testing.reference_engine.model import full_state
from weightsync_testing.trainer_ranks import publish_all

TEMPLATE = {"spec": {"containers": [{"name": "main"}]}}


def spec(ports: tuple[int, int], mode: str = "p2p") -> WeightSyncGroupSpec:
    return WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": 2, "template": TEMPLATE},
            "inference": {
                "engines": 2,
                "ranksPerEngine": 2,
                "ranksPerPod": 2,
                "adapter": "reference",
                "template": TEMPLATE,
            },
            "transfer": {
                "mode": mode,
                "protocol": "tcp",
                "bucketSizeMiB": 1,
                "timeoutSeconds": 20,
                "mooncakePorts": {"start": ports[0], "end": ports[1]},
            },
        }
    )


@pytest.fixture
def pinned_group() -> Iterator[tuple[LoopbackGroup, tuple[int, int]]]:
    ports = free_block(64)
    with LoopbackGroup(spec(ports), group="pinned").start() as group:
        yield group, ports


def test_every_mooncake_socket_of_the_group_listens_inside_its_range_and_rounds_land(
    pinned_group: tuple[LoopbackGroup, tuple[int, int]],
) -> None:
    group, (low, high) = pinned_group
    clients = [group.client(rank) for rank in range(2)]
    try:
        outcomes = publish_all(clients, full_state(seed=5), 1)
        assert all(getattr(o, "ok", False) for o in outcomes), outcomes
        for engine in group.engines.values():
            assert engine.client().weight_version() == "1"

        processes = {f"agent {pod}": (a.process.pid, a.port) for pod, a in group.agents.items()}
        harness = cast(ReferenceEngines, group.harness)
        for index, started in harness.processes.items():
            processes[f"engine {index}"] = (started.process.pid, int(started.ready["port"]))
        in_range = 0
        for who, (pid, http_port) in processes.items():
            ports = listening_ports(pid) - {http_port}
            outside = sorted(p for p in ports if not low <= p <= high)
            assert not outside, f"{who} listens on {outside}, outside the group's Mooncake range {low}-{high}"
            in_range += len(ports)
        # Each engine rank's session (2 ports each) and each agent's own plus one engine per peer it wrote to.
        assert in_range >= 2 * 2 * 2 + 2 * (2 + 2), in_range
    finally:
        for client in clients:
            client.close()


def _occupy(ports: tuple[int, int], stack: ExitStack) -> None:
    for port in range(ports[0], ports[1] + 1):
        sock = stack.enter_context(socket.socket())
        sock.bind(("0.0.0.0", port))
        sock.listen()


def test_a_full_range_fails_with_one_clear_line() -> None:
    """Mooncake only logs "No valid port found" and returns -1; the transport names the range and the fix."""
    ports = free_block(4)
    script = textwrap.dedent(
        f"""
        from weightsync_agent.transport.base import TransportError
        from weightsync_agent.transport.mooncake import MooncakeTransport
        try:
            MooncakeTransport("127.0.0.1", "tcp", ports={ports!r})
        except TransportError as exc:
            print("ERROR", exc)
        else:
            print("STARTED")
        """
    )
    with ExitStack() as stack:
        _occupy(ports, stack)
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert f"ERROR no free port in Mooncake's port range {ports[0]}-{ports[1]}" in done.stdout, done.stdout
    assert "widen spec.transfer.mooncakePorts" in done.stdout


def test_a_range_with_one_engine_free_still_starts_inside_it() -> None:
    """Mooncake picks ports at random inside the range (500 tries): two free ports are enough for one engine."""
    low, high = free_block(8)
    script = textwrap.dedent(
        f"""
        import os
        from weightsync_agent.transport.mooncake import MooncakeTransport
        t = MooncakeTransport("127.0.0.1", "tcp", ports=({low}, {high}))
        print("SESSION", t.session_id, os.getpid(), flush=True)
        input()
        """
    )
    with ExitStack() as stack:
        _occupy((low, high - 2), stack)
        child = subprocess.Popen(
            [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout is not None
            line = child.stdout.readline().split()
            assert line[0] == "SESSION", line
            assert listening_ports(int(line[2])) == {high - 1, high}
        finally:
            child.communicate("\n", timeout=30)


@pytest.mark.parametrize("ports", [(30000, 40000), (40000, 40010), (60999, 61010), (1000, 2000), (20010, 20000)])
def test_a_range_mooncake_would_ignore_is_refused_before_it_sees_it(ports: tuple[int, int]) -> None:
    """Mooncake replaces a range touching 32768-60999 (or out of bounds) by 15000-17000 with only a log line."""
    with pytest.raises(ValueError, match="Mooncake port range"):
        check_port_range(ports)
    with pytest.raises(ValueError, match="Mooncake port range"):
        MooncakeSettings(30.0, True, "127.0.0.1", ports)
    assert MooncakeSettings(30.0, True, "127.0.0.1", (20000, 20001)).env()["MC_MIN_RPC_PORT"] == "20000"


# --- Targets writable only inside an open round ---------------------------------------------------------------


class ForeignWriter:
    """A Mooncake peer with no part in the group: writes 0x5A bytes where the engine's manifest says its weights
    live, with Mooncake's own call (its return code is the evidence), from this process."""

    def __init__(self, session: str, address: int, nbytes: int) -> None:
        from mooncake.engine import TransferEngine

        self.session, self.address, self.nbytes = session, address, nbytes
        self.garbage = torch.full((nbytes,), 0x5A, dtype=torch.uint8)
        self.engine = TransferEngine()
        assert self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert self.engine.register_memory(self.garbage.data_ptr(), nbytes) == 0

    def write(self) -> int:
        return int(self.engine.transfer_sync_write(self.session, self.garbage.data_ptr(), self.address, self.nbytes))


@pytest.mark.parametrize("staged", [False, True], ids=["live", "staged"])
def test_engine_memory_refuses_foreign_writes_outside_a_round_and_takes_them_inside(staged: bool) -> None:
    """The engine's addresses are read here with the group's credential (an attacker might have learned them
    earlier, or guessed them); Mooncake's port takes no credential. Outside a round the write is refused (rc < 0)
    and the engine's bytes are unchanged; inside ``begin`` .. ``commit``/``abort`` the same write lands (the
    window is what protects, not an unreachable port); after the abort it is refused again."""
    assert ENGINE_KINDS["reference"].capabilities is not None
    assert ENGINE_KINDS["reference"].capabilities.writable_only_in_round
    token = new_token()
    engine = launch_engine(0, 2, seed=7, staged=staged, token=token)
    try:
        client = engine.client()
        manifest = client.manifest(0)
        region = manifest.regions[0]
        bucket = 1 << 20
        before = client.checksums(0, bucket)
        writer = ForeignWriter(manifest.session_id, region.address, region.nbytes)

        assert client.status()["writable"] == [False, False]
        rc = writer.write()
        assert rc < 0, f"a write outside a round returned {rc}"
        assert client.checksums(0, bucket) == before, "bytes landed outside a round"
        assert client.weight_version() == "default"

        if not staged:
            client.pause_generation()
        client.begin(2)
        assert client.status()["writable"] == [True, True]
        assert writer.write() == 0, "the window is open: the same write must land"
        assert client.checksums(0, bucket) != before
        client.abort(2)

        assert client.status()["writable"] == [False, False]
        after_round = client.checksums(0, bucket)
        assert writer.write() < 0, "the window closed with the round"
        assert client.checksums(0, bucket) == after_round
    finally:
        engine.stop()


def test_stock_sglang_declares_its_memory_writable_for_its_whole_life() -> None:
    """Stock SGLang registers its weights once, at start, and has no route to unregister them (docs/engines)."""
    capabilities = ENGINE_KINDS["sglang"].capabilities
    assert capabilities is not None and not capabilities.writable_only_in_round
