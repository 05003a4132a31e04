"""An ASGI middleware for the stock vLLM server (``--middleware weightsync_engine.vllm.guard.BearerGuard``): every HTTP
path but ``/health`` needs ``Authorization: Bearer $WEIGHTSYNC_GROUP_TOKEN``.

vLLM's own ``--api-key`` checks only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``, leaving the dev-mode RL routes
(``/pause``, ``/update_weights``, ``/weight_checker`` whose ``reset`` zeros every weight, ``/collective_rpc``, ...)
open to anyone who reaches the port (docs/engines/vllm.md, "Limits"). vLLM's stock ``--middleware`` hook closes
them with this. vLLM adds a middleware class with ``app.add_middleware(cls)``, no arguments, so the token comes
from the environment (where the operator already puts it in engine containers). Standalone: starlette only
(vLLM's own dependency).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

OPEN = frozenset({"/health"})  # kubelet probes carry no token


class BearerGuard:
    def __init__(self, app: Any) -> None:
        self.app = app
        token = os.environ.get("WEIGHTSYNC_GROUP_TOKEN")
        if not token:
            raise RuntimeError("BearerGuard: WEIGHTSYNC_GROUP_TOKEN is not set")
        self.digest = hashlib.sha256(token.encode()).digest()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN:
            await self.app(scope, receive, send)
            return
        scheme, _, given = (Headers(scope=scope).get("authorization") or "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(hashlib.sha256(given.encode()).digest(), self.digest):
            await self.app(scope, receive, send)
            return
        await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
