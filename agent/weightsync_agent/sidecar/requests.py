"""The agent's request bodies and queries, each field bounded (caps: :mod:`weightsync_agent.http.bounds`).

The wire names (camelCase) are the aliases; a handler parses with :func:`~weightsync_agent.http.bounds.parse_body`
and gets a 400 naming the field for anything else: a version past 2^53, a negative rank, a timeout of 10^300,
an unknown field, a list of a million engines.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from weightsync.api.v1alpha1 import MAX_RANKS
from weightsync_agent.http.bounds import (
    MAX_POLL_SECONDS,
    MAX_RANK,
    MAX_ROUND_ID,
    MAX_VERSION,
    Rank,
    RequestModel,
    RequestSeconds,
    Version,
)
from weightsync_agent.rounds.canary import Canary

#: A ``<engine>/<rank>`` key of a placement map, and the 16 hex digits of a placement (``Manifest.placement``).
TargetKey = Annotated[str, Field(max_length=32, pattern=r"^[0-9]{1,10}/[0-9]{1,10}$")]
PlacementId = Annotated[str, Field(min_length=1, max_length=64)]
EngineIndex = Annotated[int, Field(ge=0, lt=MAX_RANKS, strict=True)]


class PublishRequest(RequestModel):
    """``POST /v1/publish``: trainer rank ``rank`` staged ``version``."""

    version: Version
    rank: Rank
    timeout_seconds: RequestSeconds | None = Field(default=None, alias="timeoutSeconds")
    #: The semantic gate's prompt and the trainer's logprobs for ``version`` (rank 0's publish only).
    canary: Canary | None = None


class SourceCallRequest(RequestModel):
    """``POST /v1/sources/{rank}/prepare`` and ``.../publish``: the coordinator's call to one source."""

    version: Version
    timeout_seconds: RequestSeconds = Field(alias="timeoutSeconds")
    engines: list[EngineIndex] | None = Field(default=None, max_length=MAX_RANKS)
    plan_hash: str | None = Field(default=None, alias="planHash", min_length=1, max_length=128)
    catch_up: bool = Field(default=False, alias="catchUp")
    placements: dict[TargetKey, PlacementId] | None = Field(default=None, max_length=MAX_RANKS)
    round_id: str | None = Field(default=None, alias="roundId", min_length=1, max_length=MAX_ROUND_ID)


class CommittedRequest(RequestModel):
    """``POST /v1/sources/{rank}/committed``: the group committed ``version``."""

    version: Version


#: Query strings and path segments are text: these parse ``"5"`` (lax), with the same bounds.
QueryVersion = Annotated[int, Field(ge=0, le=MAX_VERSION)]
QueryRank = Annotated[int, Field(ge=0, le=MAX_RANK)]


class RoundQuery(RequestModel):
    """``GET /v1/rounds/{version}?wait=S&seen=ID&round=ID``: the round's result, waiting up to ``wait`` seconds (at
    most :data:`MAX_POLL_SECONDS`: a longer wait is cut to it and answered ``pending``, and the caller asks again);
    ``seen``: the id of a round of ``version`` the caller already heard about, to wait for a later one; ``round``: the
    round the caller's source took part in, answered at once when the coordinator did not run it (its predecessor
    did, and nothing will finish it: ``Coordinator.ended_elsewhere``)."""

    version: QueryVersion
    wait: RequestSeconds = 0.0
    seen: str | None = Field(default=None, min_length=1, max_length=MAX_ROUND_ID, pattern=r"^[\w.-]+$")
    round_id: str | None = Field(default=None, alias="round", min_length=1, max_length=MAX_ROUND_ID,
                                 pattern=r"^[\w.-]+$")  # fmt: skip

    @property
    def poll_seconds(self) -> float:
        return min(self.wait, MAX_POLL_SECONDS)


class RankQuery(RequestModel):
    """A rank in a path (``/v1/sources/{rank}/...``) or a query (``/v1/engine/manifest?rank=r``)."""

    rank: QueryRank


#: A bucket's checksum: xxh3-64 in 16 hex digits (``weightsync_agent.layout.checksums``).
BucketChecksum = Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
#: At most this many buckets per rank (1 TiB at 1 MiB buckets): 16 MiB of digits would pass the body cap anyway.
MAX_BUCKETS = 1 << 20


class VerifyRequest(RequestModel):
    """``POST /v1/engine/verify``: check engine rank ``rank`` against the sources' per-bucket checksums."""

    rank: Rank
    version: Version
    checksums: list[BucketChecksum] = Field(max_length=MAX_BUCKETS)
    round_id: str = Field(alias="roundId", min_length=1, max_length=MAX_ROUND_ID)
