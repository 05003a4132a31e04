"""Mooncake Transfer Engine over TCP loopback, for the source tests and the publish benchmark.

``LoopbackMooncake`` is a minimal test-local adapter to the Transport protocol (submit + non-blocking
status, the mode measured fastest on TCP), used when ``weightsync_agent.transport.mooncake`` is absent.
Run as a script, this file is a *target process*::

    python mooncake_peer.py INFO_JSON ENGINE RANK MIB

registers a fake engine rank's weights (the toy MODEL when MIB is 0, else MIB MiB of bf16) with its
own engine, writes ``{"manifest": ...}`` to INFO_JSON, then answers lines on stdin:
``verify BUCKET_BYTES`` prints the target-side bucket checksums as JSON; ``quit`` exits.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from source_helpers import MODEL, Full, TargetMemory, tp_layout

from weightsync_agent.layout.buckets import plan_buckets
from weightsync_agent.layout.checksums import target_checksum
from weightsync_agent.layout.manifest import Manifest
from weightsync_agent.transport.base import TransferState, TransportError


def bench_model(mib: int) -> list[tuple[str, list[Full]]]:
    if mib <= 0:
        return MODEL
    rows = mib * (1 << 20) // (4096 * 2)
    return [("column", [Full(f"w{i}", (rows // 4, 4096), "bfloat16")]) for i in range(4)]


class LoopbackTransfer:
    def __init__(self, engine: Any, peer: str, nbytes: int, batch: int) -> None:
        self.engine = engine
        self.peer = peer
        self.nbytes = nbytes
        self.batch = batch
        self.state = TransferState.PENDING
        self.message: str | None = None

    def poll(self) -> TransferState:
        if self.state is TransferState.PENDING:
            rc = self.engine.transfer_check_status(self.batch)  # frees the id once done or failed
            if rc == 1:
                self.state = TransferState.DONE
            elif rc < 0:
                self.state = TransferState.FAILED
                self.message = f"mooncake transfer_check_status={rc} ({'timeout' if rc == -2 else 'failed'})"
        return self.state

    def error(self) -> str | None:
        return self.message


class LoopbackMooncake:
    def __init__(self, host: str = "127.0.0.1") -> None:
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise TransportError(f"mooncake initialize returned {rc}")
        self._session = f"{host}:{self.engine.get_rpc_port()}"

    @property
    def session_id(self) -> str:
        return self._session

    def register(self, address: int, nbytes: int) -> None:
        rc = self.engine.register_memory(address, nbytes)
        if rc != 0:
            raise TransportError(f"register_memory({address:#x}, {nbytes}) returned {rc}")

    def unregister(self, address: int) -> None:
        rc = self.engine.unregister_memory(address)
        if rc != 0:
            raise TransportError(f"unregister_memory({address:#x}) returned {rc}")

    def probe(self, peer: str, timeout: float) -> bool:
        return bool(self.engine.send_probe(peer) == 0)

    def submit_write(self, peer: str, local_address: int, remote_address: int, nbytes: int) -> LoopbackTransfer:
        batch = self.engine.transfer_submit_write(peer, local_address, remote_address, nbytes)
        if batch < 0:
            raise TransportError(f"transfer_submit_write to {peer} returned {batch}")
        return LoopbackTransfer(self.engine, peer, nbytes, batch)

    def close(self) -> None:
        del self.engine


def mooncake_transport() -> Any:
    """A Mooncake transport on TCP loopback: the project's MooncakeTransport when present."""
    try:
        from weightsync_agent.transport.mooncake import (  # type: ignore[import-not-found,unused-ignore]
            MooncakeTransport,
        )
    except ImportError:
        return LoopbackMooncake()
    return MooncakeTransport("127.0.0.1", "tcp", "", force_tcp=True, timeout_seconds=30)


PEER = Path(__file__).with_name("mooncake_peer.py")


class TargetProcess:
    """A target process (this file run as a script), driven over stdin/stdout."""

    def __init__(self, tmp_path: Path, engine: int = 0, mib: int = 0) -> None:
        self.info = tmp_path / f"target-{engine}.json"
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), str(self.info), str(engine), "0", str(mib)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while not self.info.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise RuntimeError(f"target process did not start: {err}")
            time.sleep(0.05)
        self.manifest = Manifest.model_validate(json.loads(self.info.read_text())["manifest"])

    def verify(self, bucket_bytes: int) -> list[str]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(f"verify {bucket_bytes}\n")
        self.proc.stdin.flush()
        return list(json.loads(self.proc.stdout.readline()))

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def target_main(info: str, engine: int, rank: int, mib: int) -> None:
    transport = mooncake_transport()
    mem = TargetMemory(tp_layout(bench_model(mib), 1, 0), engine=engine, rank=rank, session_id=transport.session_id)
    transport.register(mem.address, mem.buffer.numel())
    Path(info).write_text(json.dumps({"manifest": mem.manifest.model_dump(mode="json", by_alias=True)}))
    for line in sys.stdin:
        words = line.split()
        if words and words[0] == "verify":
            buckets = plan_buckets(mem.manifest, int(words[1]))
            print(json.dumps([target_checksum(b) for b in buckets]), flush=True)
        elif words and words[0] == "quit":
            break
    transport.close()


if __name__ == "__main__":
    target_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
