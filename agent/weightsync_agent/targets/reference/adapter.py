"""The reference engine's adapter: SGLang's route shapes plus weightsync's verify/commit extension routes.

The engine publishes a full weightsync manifest per rank in ``/remote_instance_transfer_engine_info``,
verifies per-bucket xxh3 checksums over its own memory, and changes the version it reports only on its
own commit, which it refuses unless every rank verified (docs/reference-engine.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

from weightsync.api.engines import ENGINE_KINDS, Capabilities
from weightsync.api.timeouts import HTTP_CALL_SECONDS
from weightsync_agent.http.client import HttpCallError
from weightsync_agent.http.credential import ApiKey
from weightsync_agent.layout.manifest import Manifest
from weightsync_agent.targets.adapter import (
    AdapterSettings,
    BroadcastReception,
    FullTensor,
    LeftRound,
    Readiness,
    TargetVerdict,
)
from weightsync_agent.targets.engine_client import EngineClient, PauseMode

JOIN_BROADCAST_ROUTE = "/weightsync/broadcast"
ARM_BROADCAST_ROUTE = "/weightsync/broadcast/receive"


class ReferenceAdapter:
    kind: ClassVar[str] = "reference"
    capabilities: ClassVar[Capabilities] = ENGINE_KINDS["reference"].capabilities  # type: ignore[assignment]
    manifests_from_engine_agent: ClassVar[bool] = False  # the engine serves full manifests itself
    #: One process serves every rank, so one member per engine cuts them all from weightsync's buckets.
    broadcast: ClassVar[BroadcastReception] = BroadcastReception("engine", "weightsync-buckets")
    #: The semantic gate (``GatedRound``) in live rounds only: its staged weights serve only from the commit.
    gate_stagings: ClassVar[frozenset[str]] = frozenset({"live"})

    def __init__(self, settings: AdapterSettings, *, pause_mode: PauseMode = "abort") -> None:
        self.settings = settings
        self.client = EngineClient(settings.url, timeout=settings.call_timeout, api_key=settings.api_key)
        self.name = f"engine {settings.engine} ({self.client.base_url})"
        self.pause_mode = pause_mode

    def __repr__(self) -> str:
        return f"ReferenceAdapter({self.name})"

    # --- Discovery and readiness -------------------------------------------------------------------

    def manifest(self, rank: int) -> Manifest:
        return self.client.manifest(rank)

    def held_version(self, timeout: float | None = None) -> str | None:
        return self.client.weight_version(timeout=timeout)

    def healthy(self, timeout: float) -> bool:
        return self.client.health(timeout)

    def readiness(self) -> Readiness:
        try:
            for rank in range(self.settings.ranks):
                self.client.manifest(rank)
        except HttpCallError as exc:
            return Readiness(False, "EngineUnavailable", str(exc))
        return Readiness(True, "EngineServing", f"engine at {self.client.base_url} answers")

    # --- The round ---------------------------------------------------------------------------------

    # The engine holds the round id itself and refuses calls naming another round (409).

    def pause(self, timeout: float, *, round_id: str) -> None:
        self.client.pause_generation(self.pause_mode, timeout=timeout, round_id=round_id)

    def resume(self, timeout: float, *, round_id: str) -> None:
        self.client.continue_generation(timeout=timeout, round_id=round_id)

    def begin(self, version: int, timeout: float, *, round_id: str) -> None:
        self.client.begin(version, timeout=timeout, verify=self.settings.verify, round_id=round_id)

    def reopen(self, version: int, timeout: float, *, round_id: str) -> None:
        # A begin of the open round (same version and id) opens every rank's window again (ClosesAtVerify).
        self.begin(version, timeout, round_id=round_id)

    def verify(
        self, rank: int, version: int, checksums: Sequence[str], timeout: float, *, round_id: str
    ) -> TargetVerdict:
        answer = self.client.verify(
            rank, version, self.settings.bucket_bytes, checksums, timeout=timeout, round_id=round_id
        )
        return TargetVerdict(ok=answer.ok, mismatched=answer.mismatched, error=answer.error)

    def apply(self, version: int, timeout: float, *, round_id: str) -> None:
        self.client.apply(version, timeout=timeout, round_id=round_id)

    def scrub(self, rank: int, version: int, checksums: Sequence[str], timeout: float) -> TargetVerdict:
        # The engine checks its own memory; on a drift it stops serving and takes a repair of the version.
        answer = self.client.scrub(rank, version, self.settings.bucket_bytes, checksums, timeout=timeout)
        return TargetVerdict(ok=answer.ok, mismatched=answer.mismatched, error=answer.error)

    def score(self, input_ids: Sequence[int], timeout: float, *, round_id: str) -> list[float | None]:
        logits = self.client.forward(input_ids, timeout=timeout)
        return [_log_softmax_at(row, token) for row, token in zip(logits, input_ids[1:], strict=False)]

    def commit(self, version: int, timeout: float, *, round_id: str) -> None:
        self.client.commit(version, timeout=timeout, round_id=round_id)

    def abort(self, version: int, timeout: float, *, round_id: str, written: bool = True) -> None:
        self.client.abort(version, timeout=timeout, round_id=round_id, written=written)

    # --- A round whose coordinator is gone (LeftRoundProbe) ------------------------------------------

    def left_round(self, timeout: float) -> LeftRound | None:
        status = self.client.status(timeout=timeout)
        held = status.get("round")
        open_round = held if isinstance(held, dict) and isinstance(held.get("round_id"), str) else None
        paused_by = status.get("paused_by") if status.get("paused") else None
        if open_round is None and not isinstance(paused_by, str):
            return None  # idle, or paused by hand (no round id): nothing a coordinator left
        round_id = open_round["round_id"] if open_round is not None else paused_by
        version = str(open_round.get("version")) if open_round is not None else ""
        return LeftRound(str(round_id), int(version) if version.isdigit() else None, paused=isinstance(paused_by, str))

    def close_left(self, left: LeftRound, timeout: float) -> bool:
        if left.version is not None:
            # "Nothing written" makes the engine re-verify its live memory against what it last verified (after its
            # window closed); whatever the round did write, the engine then refuses to serve it.
            self.client.abort(left.version, timeout=timeout, round_id=left.round_id, written=False)
        if not left.paused:
            return True
        try:
            self.client.continue_generation(timeout=timeout, round_id=left.round_id)
        except HttpCallError as exc:
            if exc.status == 409:  # its live weights were written: paused until a round lands
                return False
            raise
        return True

    # --- Broadcast reception -----------------------------------------------------------------------

    def join_broadcast(
        self,
        init_method: str,
        world_size: int,
        members: list[dict[str, Any]],
        backend: str,
        timeout: float,
        group_name: str = "",
    ) -> None:
        # group_name: the engine's weightsync group has one fixed store prefix; a re-join replaces it.
        body = {
            "init_method": init_method,
            "world_size": world_size,
            "members": members,
            "backend": backend,
            "timeout_seconds": timeout,
        }
        # Joining blocks until the whole group formed: allow the collective's timeout plus one call.
        self.client.request("POST", JOIN_BROADCAST_ROUTE, body=body, timeout=timeout + self.settings.call_timeout)

    def arm_broadcast(self, version: int, timeout: float, *, round_id: str | None = None) -> None:
        body = {"version": str(version)} if round_id is None else {"version": str(version), "round_id": round_id}
        self.client.request("POST", ARM_BROADCAST_ROUTE, body=body, timeout=timeout)

    def receive_broadcast(self, version: int, tensors: Sequence[FullTensor], group_name: str, timeout: float) -> None:
        raise HttpCallError(
            ARM_BROADCAST_ROUTE, None, "the reference engine takes weightsync's buckets, not announced tensors"
        )

    def leave_broadcast(self, group_name: str, timeout: float) -> None:
        """Nothing to do: a failed collective breaks the engine's group and the next join replaces it."""


def reference_adapter(
    engine: int,
    url: str,
    *,
    bucket_bytes: int,
    ranks: int = 1,
    verify: bool = True,
    call_timeout: float = HTTP_CALL_SECONDS,
    token: ApiKey = None,
) -> ReferenceAdapter:
    """A reference engine's adapter from its URL (tests, benchmarks and the testbed drive engines directly)."""
    settings = AdapterSettings(
        engine, url, ranks, bucket_bytes, verify=verify, call_timeout=call_timeout, api_key=token
    )
    return ReferenceAdapter(settings)


def _log_softmax_at(row: Sequence[float], token: int) -> float:
    """``log_softmax(row)[token]``, stable (the largest logit is subtracted first)."""
    top = max(row)
    return row[token] - top - math.log(sum(math.exp(x - top) for x in row))
