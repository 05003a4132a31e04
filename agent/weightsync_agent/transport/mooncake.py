"""The Mooncake Transfer Engine as a :class:`~weightsync_agent.transport.base.Transport`.

P2PHANDSHAKE metadata (no etcd, no metadata server): the session id is ``"<host>:<rpc port>"`` of this
transport's *home* engine, which holds every registration and receives the writes peers make into this
process. Writes this process makes go through a separate engine per peer (``mooncake_link``), split
into chunks of ``chunk_bytes`` submitted with ``transfer_submit_write`` and polled with the non-blocking
``transfer_check_status``; never the sync calls or ``get_batch_transfer_status``, which spin a core
while they wait (on 2 cores that starves the I/O threads: submit + sleep-poll was 1.4x faster).

Measured on the project's 2-core CPU machine over TCP loopback (docs/transport.md has the tables):

* Probe first, or an engine per peer? A peer that accepts connections but never answers (a SIGSTOPped
  process: the kernel still completes the TCP handshake) passes a plain TCP connect probe in 2 ms, then
  holds a shared engine's mutex through Mooncake's 60 s handshake timeout: a write to a healthy peer on
  that engine waited 61.7 s. On a second engine the healthy write took 12 ms. What a TCP probe can catch
  (refused, unroutable) Mooncake already fails in under 1 ms (or ``MC_HANDSHAKE_CONNECT_TIMEOUT``). So:
  an engine per peer, its handshake (a zero-length write; ``get_first_buffer_address`` holds the GIL
  for those 60 s) on a helper thread bounded by our own timeout, and no TCP probe. A peer that hangs
  after its handshake does not block an engine: with ``timeout_seconds=2`` its write failed after
  2.00 s while 16 MiB to a healthy peer took 10-30 ms, and after SIGCONT it wrote again.
* An engine costs about 0.3 ms to start, 2 listening ports and about 3 threads; its destructor holds
  the GIL for up to about 1 s, paid per peer at :meth:`MooncakeTransport.close`.
* Chunks (``DEFAULT_CHUNK_BYTES``, 64 MiB): several chunks beat one request by 10-20 % (Mooncake runs
  up to 4 requests per peer at once); 16, 64 and 256 MiB were indistinguishable. Poll intervals from
  0.1 to 5 ms made no measurable difference; ``wait_all`` keeps 0.5 ms.

Every call returns within a bounded time: registration and submission never wait on the network
(a write to a peer still handshaking is submitted later by the helper thread), and a transfer fails
once its peer has completed nothing for ``timeout_seconds``. A failure never means nothing was
written, and a write reported as timed out may still land later: keep the source memory unchanged
until a round is settled and never commit without verifying what arrived.

Mooncake's settings are environment variables read once per process (see ``mooncake_config``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Literal

from weightsync.api import names
from weightsync_agent.transport.base import DEFAULT_CHUNK_BYTES, TransportError
from weightsync_agent.transport.mooncake_config import (
    MooncakeSettings,
    apply_once,
    describe,
    free_ports,
    ports_in_effect,
)
from weightsync_agent.transport.mooncake_link import LinkState, MooncakeTransfer, PeerLink
from weightsync_agent.transport.regions import RegionTable

Protocol = Literal["tcp", "rdma", "auto"]


class MooncakeTransport:
    """A Mooncake session: ``register`` what peers may write into, ``submit_write`` into peers."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        protocol: Protocol | str = "tcp",
        devices: str | Sequence[str] = (),
        *,
        force_tcp: bool = False,
        timeout_seconds: float = 30.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        ports: tuple[int, int] | None = None,
    ) -> None:
        """``ports``: the range every Mooncake engine of this process listens in (``transfer.mooncakePorts``);
        None keeps what the environment says (``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT``, else Mooncake's default)."""
        if protocol not in ("tcp", "rdma", "auto"):
            raise ValueError(f"protocol must be tcp, rdma or auto, got {protocol!r}")
        if protocol == "rdma" and force_tcp:
            raise ValueError("protocol='rdma' contradicts force_tcp=True")
        if timeout_seconds <= 0 or chunk_bytes <= 0:
            raise ValueError("timeout_seconds and chunk_bytes must be positive")
        names = devices.split(",") if isinstance(devices, str) else list(devices)
        self.host = host
        self.timeout_seconds = timeout_seconds
        self.chunk_bytes = chunk_bytes
        # Mooncake picks RDMA whenever it finds a NIC, whatever `protocol` says; only MC_FORCE_TCP stops it.
        self.force_tcp = force_tcp or protocol == "tcp"
        self._protocol = "rdma" if protocol == "rdma" or (protocol == "auto" and names) else "tcp"
        self._devices = ",".join(n.strip() for n in names if n.strip())
        self.settings = apply_once(MooncakeSettings(timeout_seconds, self.force_tcp, host, ports))
        self._regions = RegionTable(f"mooncake session on {host}")
        self._engines: list[Any] = []
        self._links: dict[str, PeerLink] = {}
        self._lock = threading.RLock()
        self._closed = False
        self._home = self._new_engine()
        self._session_id = f"{host}:{self._home.get_rpc_port()}"

    @property
    def session_id(self) -> str:
        return self._session_id

    def _new_engine(self) -> Any:
        from mooncake.engine import TransferEngine  # after apply_once: it reads MC_* lazily

        engine = TransferEngine()
        rc = engine.initialize(self.host, "P2PHANDSHAKE", self._protocol, self._devices)
        if rc != 0:
            ports = ports_in_effect()
            if free_ports(ports, limit=2) < 2:  # an engine needs two
                # Mooncake only logs "No valid port found"; every engine takes two ports of the range.
                raise TransportError(
                    f"no free port in Mooncake's port range {ports[0]}-{ports[1]} "
                    f"({names.ENV_MOONCAKE_MIN_PORT}/{names.ENV_MOONCAKE_MAX_PORT}): each Mooncake engine listens "
                    f"on two (this session already holds {len(self._engines)}: one for its own memory, one per peer "
                    "it writes to); widen spec.transfer.mooncakePorts"
                )
            raise TransportError(
                f"Mooncake initialize({self.host!r}, P2PHANDSHAKE, {self._protocol!r}, {self._devices!r}) "
                f"returned {describe(rc)}"
            )
        with self._lock:
            if self._closed:
                raise TransportError("the transport was closed")
            for address, nbytes in self._regions.items():
                self._register_on(engine, address, nbytes)
            self._engines.append(engine)
        return engine

    # ---------------------------------------------------------------------------------- memory

    def register(self, address: int, nbytes: int) -> None:
        # Every engine registers everything (RDMA needs the source registered with the engine that sends).
        # Registration does not wait on a peer engine's stuck handshake (measured: 0.3 ms during one).
        with self._lock:
            self._check_open()
            self._regions.add(address, nbytes)
            done: list[Any] = []
            try:
                for engine in self._engines:
                    self._register_on(engine, address, nbytes)
                    done.append(engine)
            except TransportError:
                for engine in done:
                    engine.unregister_memory(address)
                self._regions.remove(address)
                raise

    @staticmethod
    def _register_on(engine: Any, address: int, nbytes: int) -> None:
        rc = engine.register_memory(address, nbytes)
        if rc != 0:
            raise TransportError(f"Mooncake register_memory({address:#x}, {nbytes}) returned {describe(rc)}")

    def unregister(self, address: int) -> None:
        with self._lock:
            self._check_open()
            self._regions.remove(address)
            failures = [rc for engine in self._engines if (rc := engine.unregister_memory(address)) != 0]
        if failures:
            raise TransportError(f"Mooncake unregister_memory({address:#x}) returned {describe(failures[0])}")

    # ---------------------------------------------------------------------------------- peers

    def _link(self, peer: str) -> PeerLink:
        with self._lock:
            self._check_open()
            link = self._links.get(peer)
            if link is None:
                link = self._links[peer] = PeerLink(peer, self._new_engine, self.timeout_seconds)
            return link

    def probe(self, peer: str, timeout: float) -> bool:
        """Handshake with ``peer`` (once; it is kept for later writes) and say whether it answered."""
        return self._link(peer).wait_ready(timeout)

    def peer_state(self, peer: str) -> LinkState | None:
        link = self._links.get(peer)
        return None if link is None else link.state

    def submit_write(self, peer: str, local_address: int, remote_address: int, nbytes: int) -> MooncakeTransfer:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self._check_open()
        # RDMA needs the source registered; TCP does not check, so we do, to fail the same way on both.
        if nbytes and not self._regions.covers(local_address, nbytes):
            raise TransportError(
                f"local range [{local_address:#x}, +{nbytes}) is not inside one region registered "
                f"with {self._session_id}"
            )
        if nbytes == 0:
            return MooncakeTransfer(None, peer, local_address, remote_address, 0, self.chunk_bytes)
        link = self._link(peer)
        transfer = MooncakeTransfer(link, peer, local_address, remote_address, nbytes, self.chunk_bytes)
        link.submit(transfer)
        return transfer

    # ---------------------------------------------------------------------------------- lifetime

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"Mooncake session {getattr(self, '_session_id', self.host)} is closed")

    def close(self) -> None:
        """Fail pending transfers and drop the engines (each destructor holds the GIL for up to ~1 s)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links, self._links = list(self._links.values()), {}
            engines, self._engines = self._engines, []
        for link in links:
            link.close()
        # Engines still in a handshake live on in their helper thread until it returns.
        del links, engines
        self._home = None

    def __enter__(self) -> MooncakeTransport:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
