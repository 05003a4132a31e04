"""An engine's HTTP API as the round driver's ``EngineControl``.

Engines that speak weightsync's extension routes (the reference engine) get the full protocol: begin,
per-bucket verify, commit, abort. The version an engine reports changes only on its own commit, which
the engine refuses unless every rank verified.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightsync_agent.engines.api import EngineClient, PauseMode
from weightsync_agent.rounds import VerifyReport


class HttpEngineControl:
    def __init__(
        self,
        index: int,
        client: EngineClient,
        *,
        bucket_bytes: int,
        pause_mode: PauseMode = "abort",
        verify: bool = True,
    ) -> None:
        self.index = index
        self.name = f"engine {index} ({client.base_url})"
        self.client = client
        self.bucket_bytes = bucket_bytes
        self.pause_mode = pause_mode
        self.verify_rounds = verify

    def pause(self, timeout: float) -> None:
        self.client.pause_generation(self.pause_mode, timeout=timeout)

    def resume(self, timeout: float) -> None:
        self.client.continue_generation(timeout=timeout)

    def begin(self, version: int, timeout: float) -> None:
        self.client.begin(version, timeout=timeout, verify=self.verify_rounds)

    def verify(self, rank: int, version: int, checksums: Sequence[str], timeout: float) -> VerifyReport:
        report = self.client.verify(rank, version, self.bucket_bytes, checksums, timeout=timeout)
        return VerifyReport(ok=report.ok, mismatched=report.mismatched, error=report.error)

    def commit(self, version: int, timeout: float) -> None:
        self.client.commit(version, timeout=timeout)

    def abort(self, version: int, timeout: float) -> None:
        self.client.abort(version, timeout=timeout)
