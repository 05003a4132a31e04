"""The plan's seal: proof that a plan document comes from whoever holds the group's token (the operator).

The plan's own hash (``Plan.hash``) proves integrity, not origin: anyone who may edit the plan ConfigMap can write a
self-consistent plan (``transfer.verify: false``, other targets or ports), and agents acted on it until the operator's
next reconcile restored its own. The seal is an HMAC-SHA256 of the exact document text, keyed with the group's token,
which only the operator (it made the Secret) and the group's agents hold. Agents take a plan only with a seal made
by one of the tokens they accept (the current one, or the previous one during a rotation window).

Pure: no I/O. The domain prefix keeps a seal from being valid as any other HMAC made with the same token.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

DOMAIN = b"weightsync plan seal v1\n"


def seal(token: str, text: str) -> str:
    """The seal of plan document ``text`` under ``token`` (hex)."""
    return hmac.new(token.encode(), DOMAIN + text.encode(), hashlib.sha256).hexdigest()


def sealed_by(tokens: Iterable[str], text: str, given: str | None) -> bool:
    """Whether ``given`` is the seal of ``text`` under one of ``tokens`` (every token compared in constant time)."""
    if not given:
        return False
    matches = [hmac.compare_digest(seal(token, text), given) for token in tokens]
    return any(matches)
