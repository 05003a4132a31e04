"""An ASGI middleware for the stock vLLM server (``--middleware weightsync_engine.vllm.guard.BearerGuard``): every HTTP
path but ``/health`` needs ``Authorization: Bearer $WEIGHTSYNC_GROUP_TOKEN``, except that the inference routes
(:data:`SERVING`) also take a serving-only key, ``$WEIGHTSYNC_SERVING_TOKEN``, when one is set.

vLLM's own ``--api-key`` checks only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``, leaving the dev-mode RL routes
(``/pause``, ``/update_weights``, ``/weight_checker`` whose ``reset`` zeros every weight, ``/collective_rpc``, ...)
open to anyone who reaches the port (docs/engines/vllm.md, "Limits"). vLLM's stock ``--middleware`` hook closes
them with this. vLLM adds a middleware class with ``app.add_middleware(cls)``, no arguments, so the tokens come
from the environment (where the operator already puts the group's in engine containers). Standalone: starlette
only (vLLM's own dependency).

The serving key lets rollout clients generate without holding the group's token, which also opens the weight
routes (SGLang keeps ``/generate`` open and its admin key apart for the same reason). vLLM checks its own key
(``VLLM_API_KEY``) on ``/v1`` after this guard; a request the serving key admitted is passed on carrying that key,
so the serving key works whatever vLLM's own is set to (the examples set it to the group's token).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

OPEN = frozenset({"/health"})  # kubelet probes carry no token
#: Generation and what a rollout client asks around it; none of them reads or changes weights.
SERVING = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/responses", "/tokenize", "/detokenize"}
)
ENV_GROUP_TOKEN = "WEIGHTSYNC_GROUP_TOKEN"
ENV_SERVING_TOKEN = "WEIGHTSYNC_SERVING_TOKEN"
ENV_VLLM_KEY = "VLLM_API_KEY"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class BearerGuard:
    def __init__(self, app: Any) -> None:
        self.app = app
        token = os.environ.get(ENV_GROUP_TOKEN)
        if not token:
            raise RuntimeError(f"BearerGuard: {ENV_GROUP_TOKEN} is not set")
        self.digest = _digest(token)
        serving = os.environ.get(ENV_SERVING_TOKEN)
        if serving and hmac.compare_digest(_digest(serving), self.digest):
            raise RuntimeError(f"BearerGuard: {ENV_SERVING_TOKEN} is the group's token: it must be a key of its own")
        self.serving = _digest(serving) if serving else None
        vllm_key = os.environ.get(ENV_VLLM_KEY)
        self.vllm_authorization = f"Bearer {vllm_key}".encode() if vllm_key else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN:
            await self.app(scope, receive, send)
            return
        scheme, _, given = (Headers(scope=scope).get("authorization") or "").partition(" ")
        presented = _digest(given) if scheme.lower() == "bearer" else None
        if presented is not None and hmac.compare_digest(presented, self.digest):
            await self.app(scope, receive, send)
            return
        if (
            presented is not None
            and self.serving is not None
            and scope["path"] in SERVING
            and hmac.compare_digest(presented, self.serving)
        ):
            await self.app(self._as_vllm_client(scope), receive, send)
            return
        await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)

    def _as_vllm_client(self, scope: Any) -> Any:
        """``scope`` carrying vLLM's own key instead of the serving key (vLLM checks its key on ``/v1``)."""
        if self.vllm_authorization is None:
            return scope
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"authorization"]
        return {**scope, "headers": [*headers, (b"authorization", self.vllm_authorization)]}
