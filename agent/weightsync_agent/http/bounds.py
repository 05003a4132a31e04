"""The caps of the HTTP surface (agents and the reference engine), and parsing a request body into a bounded model.

Every value a peer sends is checked against a cap before it is used: a request is refused with a 400 in the one
error shape naming the field, never a 500. docs/security.md ("Bounds") lists each cap and why it has its value.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Final, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from weightsync.api.v1alpha1 import MAX_RANKS, MAX_WEIGHT_VERSION

#: Largest request body (bytes), checked from Content-Length and while reading, before any parsing. The largest
#: legitimate body is the coordinator's call to a source: one 16-hex-digit placement per target, at most
#: ``MAX_RANKS`` targets (about 0.5 MB); a verify's checksums are 16 hex digits per bucket.
MAX_BODY_BYTES: Final = 4 << 20
#: Versions are JSON numbers: above 2^53 a JavaScript or float reader rounds them (10^15 is fine, 2^60 is not).
MAX_VERSION: Final = MAX_WEIGHT_VERSION
#: A trainer rank or an engine rank: the spec caps ranks at MAX_RANKS (trainer and inference each).
MAX_RANK: Final = MAX_RANKS - 1
#: A request's own timeout: the spec's own maximum ``timeoutSeconds`` (one day). Sources also clamp it to their
#: plan's round budget, so a request cannot hold a rank longer than a round may last.
MAX_REQUEST_SECONDS: Final = 86400.0
#: The longest a long poll (``GET /v1/rounds/{v}?wait=``) waits before answering ``pending``.
MAX_POLL_SECONDS: Final = 60.0
#: Concurrent long polls per agent; one more is answered 429 at once (the caller retries), so waiters cannot
#: pile up without end. Every trainer pod of the largest group waits at most once.
MAX_WAITERS: Final = 4096
#: Seconds a connection may take to send a request's headers, from its opening or from the end of its previous answer
#: (aiohttp's ``keepalive_timeout``, which also closes a connection idle that long between requests). Every client
#: of ours sends its headers in one write; a client trickling them (slowloris) is cut off here.
HEADER_READ_SECONDS: Final = 10.0
#: Seconds a request's body (at most MAX_BODY_BYTES) may take to arrive once its headers did: a 408 beyond.
BODY_READ_SECONDS: Final = 30.0
#: Connections one server holds at once; one more is answered 503 and closed at once, never queued. Room for every
#: long poll (MAX_WAITERS) plus each rank's publish and its coordinator's calls, probes and scrapes.
MAX_CONNECTIONS: Final = MAX_WAITERS + 1024
#: A version label (engines take strings: SGLang's ``weight_version``).
MAX_LABEL_CHARS: Final = 128
#: A round id is the coordinator's uuid4 hex (32 characters); anything much longer is not one.
MAX_ROUND_ID: Final = 64
#: Smallest bucket a checksum request may ask for. One 64-bit checksum (about 19 bytes of JSON) per bucket:
#: ``bucket_bytes=1`` made a 6.7 MB answer for a 345 KB rank; from 64 bytes on an answer is at most a third of the
#: bytes it describes (groups use ``bucketSizeMiB`` >= 1; tests use buckets of 100 bytes and up).
MIN_BUCKET_BYTES: Final = 64
#: Most buckets one answer (checksums) or request (a verify's list) carries, about 20 MB of JSON: 1 TiB of one
#: rank in the spec's smallest bucket (1 MiB).
MAX_BUCKETS: Final = 1 << 20
#: The largest answer a peer may send back to ``JsonHttpClient`` (a manifest of a big rank is a few MB).
MAX_ANSWER_BYTES: Final = 64 << 20

Version = Annotated[int, Field(ge=0, le=MAX_VERSION, strict=True)]
Rank = Annotated[int, Field(ge=0, le=MAX_RANK, strict=True)]
RequestSeconds = Annotated[float, Field(ge=0, le=MAX_REQUEST_SECONDS, allow_inf_nan=False)]


class RequestModel(BaseModel):
    """A request body: unknown fields are refused (a typo must not pass silently), every value bounded."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


M = TypeVar("M", bound=BaseModel)


class BadRequestError(ValueError):
    """A request field is missing, malformed or over its cap: answered 400, naming the field."""


def parse_body(model: type[M], body: Any) -> M:
    """``body`` (decoded JSON) as ``model``, or :class:`BadRequestError` naming every bad field in one line."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise BadRequestError(validation_message(exc)) from None


def validation_message(exc: ValidationError) -> str:
    """One line per problem, ``field: message (got <value cut short>)``, without pydantic's URLs."""
    parts = []
    for error in exc.errors(include_url=False)[:10]:
        where = ".".join(str(p) for p in error["loc"]) or "body"
        got = "" if error["type"] == "missing" else f" (got {short(error.get('input'))})"
        parts.append(f"{where}: {error['msg']}{got}")
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def short(value: Any, limit: int = 80) -> str:
    """``repr`` of a refused value cut to ``limit`` characters: an error message never echoes a huge input."""
    text = json.dumps(value) if isinstance(value, str | int | float | bool | None) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
