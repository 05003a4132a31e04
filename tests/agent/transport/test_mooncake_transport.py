"""MooncakeTransport between real processes over TCP loopback: data lands bit-exact, bad writes are
refused without touching the target, and no dead, hung or silent peer stalls writes to a healthy one.

Writes that need short Mooncake timeouts run in a writer child (``mc_writer.py``): Mooncake's settings
are process-wide, so the transports built here keep the default 30 s.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import xxhash

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine is not installed")

from transport_children import Child

from weightsync_agent.transport.base import TransferState, TransportError, wait_all
from weightsync_agent.transport.mooncake import MooncakeTransport
from weightsync_agent.transport.mooncake_link import LinkState

MiB = 1 << 20
SIZE = 16 * MiB
CHUNK = 1 * MiB  # small, so that module writes are several chunks
SHORT = 2.0  # the writer child's timeout for hung and silent peers


def zeros_hash(nbytes: int) -> str:
    return xxhash.xxh3_64_hexdigest(bytes(nbytes))


@pytest.fixture(scope="module")
def target(spawn_module: Callable[..., Child]) -> Child:
    return spawn_module("mc_target.py", "--size", str(SIZE))


@pytest.fixture(scope="module")
def source() -> Iterator[tuple[MooncakeTransport, torch.Tensor]]:
    transport = MooncakeTransport("127.0.0.1", "tcp", force_tcp=True, timeout_seconds=30, chunk_bytes=CHUNK)
    buffer = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    transport.register(buffer.data_ptr(), SIZE)
    yield transport, buffer
    transport.close()


def write(transport: MooncakeTransport, peer: str, local: int, remote: int, nbytes: int, timeout: float = 20.0) -> str:
    """Submit, wait, and return the final state's value."""
    transfer = transport.submit_write(peer, local, remote, nbytes)
    wait_all([transfer], time.monotonic() + timeout)
    return transfer.poll().value


def test_several_mib_land_bit_exact(target: Child, source: tuple[MooncakeTransport, torch.Tensor]) -> None:
    transport, buffer = source
    target.ask("zero")
    offset, nbytes = 4096, 12 * MiB + 123  # unaligned tail; 13 chunks
    transfer = transport.submit_write(
        target.info["session_id"], buffer.data_ptr(), target.info["address"] + offset, nbytes
    )
    assert not wait_all([transfer], time.monotonic() + 20), transfer.error()
    assert transfer.poll() is TransferState.DONE and transfer.nbytes == nbytes
    assert target.ask(f"hash {offset} {nbytes}") == xxhash.xxh3_64_hexdigest(buffer.numpy()[:nbytes].data)
    assert target.ask(f"hash 0 {offset}") == zeros_hash(offset)
    assert transport.peer_state(target.info["session_id"]) is LinkState.READY


def test_out_of_range_writes_fail_and_leave_the_target_untouched(
    target: Child, source: tuple[MooncakeTransport, torch.Tensor]
) -> None:
    transport, buffer = source
    target.ask("zero")
    peer, base, local = target.info["session_id"], target.info["address"], buffer.data_ptr()
    cases = {
        "overruns the end by one byte": (base + SIZE - 4096 + 1, 4096),
        "starts past the end": (base + SIZE, 4096),
        "starts before the buffer": (base - 4096, 8192),
        "nowhere near": (0x1000, 4096),
    }
    for what, (remote, nbytes) in cases.items():
        transfer = transport.submit_write(peer, local, remote, nbytes)
        wait_all([transfer], time.monotonic() + 10)
        assert transfer.poll() is TransferState.FAILED, what
        error = transfer.error() or ""
        assert peer in error and "refused the range" in error, error
    assert target.ask(f"hash 0 {SIZE}") == zeros_hash(SIZE)
    # The link survives refused writes.
    assert write(transport, peer, local, base, 4096) == "done"


def test_a_chunked_overrun_lands_its_in_range_chunks(
    target: Child, source: tuple[MooncakeTransport, torch.Tensor]
) -> None:
    """Documented: Mooncake checks each request, and a request is one chunk, so only the bad chunk fails."""
    transport, buffer = source
    target.ask("zero")
    start = SIZE - 3 * CHUNK - CHUNK // 2
    state = write(transport, target.info["session_id"], buffer.data_ptr(), target.info["address"] + start, 4 * CHUNK)
    assert state == "failed"
    assert target.ask(f"hash {start} {3 * CHUNK}") == xxhash.xxh3_64_hexdigest(buffer.numpy()[: 3 * CHUNK].data)
    assert target.ask(f"hash {start + 3 * CHUNK} {CHUNK // 2}") == zeros_hash(CHUNK // 2)


def test_unreachable_sessions_fail_fast(source: tuple[MooncakeTransport, torch.Tensor]) -> None:
    transport, buffer = source
    for peer in ("127.0.0.1:1", "127.0.0.1"):  # nothing listening; no port means Mooncake's default 12001
        started = time.monotonic()
        transfer = transport.submit_write(peer, buffer.data_ptr(), 0x10000, 4096)
        wait_all([transfer], time.monotonic() + 10)
        assert transfer.poll() is TransferState.FAILED
        assert time.monotonic() - started < 2.0
        assert "handshake" in (transfer.error() or "")
        assert transport.probe(peer, 1.0) is False


def test_registration_errors_are_clear(source: tuple[MooncakeTransport, torch.Tensor]) -> None:
    transport, buffer = source
    with pytest.raises(TransportError, match="overlaps the registered region"):
        transport.register(buffer.data_ptr(), SIZE)
    with pytest.raises(TransportError, match="overlaps"):
        transport.register(buffer.data_ptr() + MiB, MiB)
    with pytest.raises(TransportError, match="not the start of a registered region"):
        transport.unregister(buffer.data_ptr() + 1)
    spare = torch.zeros(MiB, dtype=torch.uint8)
    transport.register(spare.data_ptr(), MiB)
    transport.unregister(spare.data_ptr())
    with pytest.raises(TransportError, match="not inside one region registered"):
        transport.submit_write("127.0.0.1:1", spare.data_ptr(), 0x10000, 4096)


def test_zero_length_write_is_done_at_once(source: tuple[MooncakeTransport, torch.Tensor]) -> None:
    transport, buffer = source
    assert transport.submit_write("127.0.0.1:1", buffer.data_ptr(), 0x10000, 0).poll() is TransferState.DONE


def test_killed_target_fails_the_write_quickly(
    spawn: Callable[..., Child], source: tuple[MooncakeTransport, torch.Tensor]
) -> None:
    transport, buffer = source
    victim = spawn("mc_target.py", "--size", str(SIZE))
    assert transport.probe(victim.info["session_id"], 10)
    victim.signal(signal.SIGSTOP)  # so the write is surely in flight when the kill lands
    transfer = transport.submit_write(victim.info["session_id"], buffer.data_ptr(), victim.info["address"], SIZE)
    time.sleep(0.3)
    assert transfer.poll() is TransferState.PENDING
    victim.signal(signal.SIGKILL)
    killed = time.monotonic()
    wait_all([transfer], killed + 10)
    assert transfer.poll() is TransferState.FAILED
    assert time.monotonic() - killed < 3.0, transfer.error()


def test_hung_target_fails_within_the_timeout_while_a_healthy_target_completes(spawn: Callable[..., Child]) -> None:
    hung = spawn("mc_target.py", "--size", str(SIZE))
    healthy = spawn("mc_target.py", "--size", str(SIZE))
    writer = spawn("mc_writer.py", "--size", str(SIZE), "--timeout", str(SHORT))
    for peer in (hung, healthy):
        assert writer.ask(f"probe {peer.info['session_id']} 10")["ok"]
    hung.signal(signal.SIGSTOP)
    writer.ask(f"write h {hung.info['session_id']} 0 {hung.info['address']} {SIZE}")
    time.sleep(0.2)
    writer.ask(f"write ok {healthy.info['session_id']} 0 {healthy.info['address']} {SIZE}")
    done = writer.ask("wait ok 10")
    assert done["state"] == "done", done
    assert done["seconds"] < 1.5, done  # not held up by the hung peer
    assert healthy.ask(f"hash 0 {SIZE}") == writer.ask(f"hash 0 {SIZE}")
    failed = writer.ask("wait h 10")
    assert failed["state"] == "failed", failed
    assert SHORT - 0.5 < failed["seconds"] < SHORT + 2.0, failed
    # Once the peer resumes, the same link writes again.
    hung.signal(signal.SIGCONT)
    writer.ask(f"write again {hung.info['session_id']} 0 {hung.info['address']} {MiB}")
    assert writer.ask("wait again 10")["state"] == "done"


def test_silent_peer_does_not_stall_writes_to_a_healthy_peer(spawn: Callable[..., Child]) -> None:
    silent = spawn("silent_peer.py")
    healthy = spawn("mc_target.py", "--size", str(SIZE))
    writer = spawn("mc_writer.py", "--size", str(SIZE), "--timeout", str(SHORT))
    mute = f"127.0.0.1:{silent.info['port']}"
    assert writer.ask(f"probe {healthy.info['session_id']} 10")["ok"]
    writer.ask(f"write s {mute} 0 {0x10000} 4096")  # its handshake blocks for 60 s inside Mooncake
    time.sleep(0.2)
    writer.ask(f"write ok {healthy.info['session_id']} 0 {healthy.info['address']} {SIZE}")
    done = writer.ask("wait ok 10")
    assert done["state"] == "done" and done["seconds"] < 1.5, done
    failed = writer.ask("wait s 10")
    assert failed["state"] == "failed" and failed["seconds"] < SHORT + 1.0, failed
    assert "did not answer the handshake" in failed["error"]
    probe = writer.ask(f"probe {mute} 0.5")
    assert probe["ok"] is False and probe["seconds"] < 1.5
    silent.close()  # its sockets close, so the writer's stuck handshake returns and the writer exits cleanly


def test_closed_transport_refuses_work() -> None:
    transport = MooncakeTransport(timeout_seconds=30)
    session = transport.session_id
    assert session.startswith("127.0.0.1:") and json.dumps(session)
    transport.close()
    transport.close()
    with pytest.raises(TransportError, match="closed"):
        transport.submit_write("127.0.0.1:1", 0x1000, 0x1000, 16)
