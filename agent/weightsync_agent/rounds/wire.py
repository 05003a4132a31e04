"""JSON forms of the round protocol's messages, as agents send them to each other over HTTP.

Both directions live here so a field is spelled once; decoding checks shapes and raises
:class:`WireError` naming the field, because a peer speaking another version must fail loudly rather
than commit something half-understood.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightsync.api.pause import PAUSE_POLICIES, PausePolicy
from weightsync.plan import Target
from weightsync_agent.rounds.driver import PHASES, RoundResult
from weightsync_agent.source.report import SourceReport, Throughput


class WireError(ValueError):
    """A message from another agent is not what this protocol version expects."""


def _target_key(target: Target) -> str:
    return f"{target[0]}/{target[1]}"


def _target_of(key: str) -> Target:
    try:
        engine, rank = key.split("/")
        return int(engine), int(rank)
    except ValueError:
        raise WireError(f"target key {key!r} is not '<engine>/<rank>'") from None


def placements_to_json(placements: Mapping[Target, str] | None) -> dict[str, str] | None:
    return None if placements is None else {_target_key(t): p for t, p in placements.items()}


def placements_from_json(data: Any) -> dict[Target, str] | None:
    if data is None:
        return None
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise WireError("placements must map '<engine>/<rank>' to a placement string, or be null")
    return {_target_of(str(k)): v for k, v in data.items()}


def source_report_to_json(report: SourceReport) -> dict[str, Any]:
    return {
        "source": report.source,
        "ok": report.ok,
        "checksums": {_target_key(t): list(sums) for t, sums in report.checksums.items()},
        "bytes": report.bytes,
        "seconds": report.seconds,
        "error": report.error,
        "failedTarget": list(report.failed_target) if report.failed_target else None,
        "failedBucket": report.failed_bucket,
        "wrote": report.wrote,
        "streamed": report.streamed,
        "targets": _throughputs_to_json({_target_key(t): stat for t, stat in report.targets.items()}),
    }


def source_report_from_json(data: Any) -> SourceReport:
    if not isinstance(data, dict):
        raise WireError(f"a source report must be an object, got {type(data).__name__}")
    try:
        checksums = data.get("checksums") or {}
        if not isinstance(checksums, dict) or not all(isinstance(v, list) for v in checksums.values()):
            raise WireError("checksums must map '<engine>/<rank>' to a list of bucket checksums")
        failed = data.get("failedTarget")
        return SourceReport(
            source=int(data["source"]),
            ok=bool(data["ok"]),
            checksums={_target_of(k): tuple(str(x) for x in v) for k, v in checksums.items()},
            bytes=int(data.get("bytes", 0)),
            seconds=float(data.get("seconds", 0.0)),
            error=data.get("error"),
            failed_target=(int(failed[0]), int(failed[1])) if failed else None,
            failed_bucket=None if data.get("failedBucket") is None else int(data["failedBucket"]),
            wrote=bool(data.get("wrote", True)),
            streamed=bool(data.get("streamed", False)),
            targets={_target_of(k): v for k, v in _throughputs(data.get("targets"), "targets").items()},
        )
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        if isinstance(exc, WireError):
            raise
        raise WireError(f"malformed source report: {exc!r}") from exc


def round_result_to_json(result: RoundResult) -> dict[str, Any]:
    """The whole record, per-peer throughput included (what trainer ranks get back from their publish; the pod
    annotation and the group's status carry only the slowest peers, so their size does not grow with the group)."""
    return {
        **result.as_status(),
        "attempts": result.attempts,
        "enginesPaused": result.engines_paused,
        "roundId": result.round_id,
        "committed": result.committed,
        "sources": _throughputs_to_json({str(s): stat for s, stat in result.sources.items()}),
        "targets": _throughputs_to_json({_target_key(t): stat for t, stat in result.targets.items()}),
    }


def _throughputs_to_json(stats: Mapping[str, Throughput]) -> dict[str, list[float]]:
    return {peer: [stat.bytes, stat.seconds] for peer, stat in stats.items()}


def _throughputs(data: Any, what: str) -> dict[str, Throughput]:
    """Peer -> throughput from ``{"<peer>": [bytes, seconds]}`` (absent or empty: none)."""
    if not data:
        return {}
    if not isinstance(data, dict) or not all(isinstance(v, list) and len(v) == 2 for v in data.values()):
        raise WireError(f"{what} must map each peer to [bytes, seconds]")
    return {str(k): Throughput(int(v[0]), float(v[1])) for k, v in data.items()}


def round_result_from_json(data: Any) -> RoundResult:
    if not isinstance(data, dict):
        raise WireError(f"a round result must be an object, got {type(data).__name__}")
    try:
        outcome = data["result"]
        if outcome not in ("Succeeded", "Failed", "Aborted"):
            raise WireError(f"round result {outcome!r} is not Succeeded, Failed or Aborted")
        return RoundResult(
            version=int(data["version"]),
            result=outcome,
            started_at=str(data["startedAt"]),
            duration_seconds=float(data["durationSeconds"]),
            bytes=int(data["bytes"]),
            gbps=float(data["gbps"]),
            attempts=int(data.get("attempts", 1)),
            reason=data.get("reason"),
            engines_paused=bool(data.get("enginesPaused", False)),
            round_id=None if data.get("roundId") is None else str(data["roundId"]),
            committed=bool(data.get("committed", outcome == "Succeeded")),
            phases=_phases_from_json(data.get("phases")),
            paused_seconds=None if data.get("pausedSeconds") is None else float(data["pausedSeconds"]),
            sources={int(k): v for k, v in _throughputs(data.get("sources"), "sources").items()},
            targets={_target_of(k): v for k, v in _throughputs(data.get("targets"), "targets").items()},
            gate_gap=None if data.get("gateGap") is None else float(data["gateGap"]),
            pause_policy=_pause_policy(data.get("pausePolicy")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, WireError):
            raise
        raise WireError(f"malformed round result: missing or bad {exc!r}") from exc


def _phases_from_json(data: Any) -> dict[str, float]:
    if data is None:
        return {}
    if not isinstance(data, dict) or not set(data) <= set(PHASES):
        raise WireError(f"phases must map some of {', '.join(PHASES)} to seconds")
    return {phase: float(data[phase]) for phase in PHASES if phase in data}


def _pause_policy(data: Any) -> PausePolicy | None:
    if data is None:
        return None
    for policy in PAUSE_POLICIES:
        if data == policy:
            return policy
    raise WireError(f"pausePolicy must be one of {', '.join(PAUSE_POLICIES)}, got {data!r}")
