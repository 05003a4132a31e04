"""A small async Kubernetes REST client on aiohttp: get, list, watch, create, merge-patch, delete.

Why not the ``kubernetes`` package's generated API: that client is synchronous (it would need a
thread per call) and turns objects into model classes; the operator builds and compares plain
camelCase dicts. Credentials come from the same place as kopf's: :func:`login` (the ``kubernetes``
package's in-cluster or kubeconfig loading, via kopf's piggybacking), so there is one auth path.
On a 401 the client logs in again once (service account tokens rotate).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
import kopf

from weightsync_operator import metrics

logger = logging.getLogger(__name__)

ConnectFn = Callable[[], kopf.ConnectionInfo]

Items = list[dict[str, Any]]

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"


#: ``ApiError.status`` when the API server did not answer at all (refused, reset, timed out).
UNAVAILABLE = 0


class ApiError(Exception):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, reason: str, message: str, *, method: str = "", path: str = "") -> None:
        super().__init__(f"{method} {path}: {status} {reason}: {message}".strip())
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409


@dataclass(frozen=True)
class Kind:
    api_version: str
    plural: str
    namespaced: bool = True

    def base(self) -> str:
        return f"/api/{self.api_version}" if "/" not in self.api_version else f"/apis/{self.api_version}"

    def collection(self, namespace: str | None) -> str:
        if self.namespaced and namespace:
            return f"{self.base()}/namespaces/{quote(namespace)}/{self.plural}"
        return f"{self.base()}/{self.plural}"

    def item(self, namespace: str | None, name: str) -> str:
        return f"{self.collection(namespace)}/{quote(name)}"


KINDS: dict[str, Kind] = {
    "Pod": Kind("v1", "pods"),
    "Service": Kind("v1", "services"),
    "ConfigMap": Kind("v1", "configmaps"),
    "Secret": Kind("v1", "secrets"),
    "ServiceAccount": Kind("v1", "serviceaccounts"),
    "Event": Kind("v1", "events"),
    "Role": Kind("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": Kind("rbac.authorization.k8s.io/v1", "rolebindings"),
    "NetworkPolicy": Kind("networking.k8s.io/v1", "networkpolicies"),
    "WeightSyncGroup": Kind("weightsync.io/v1alpha1", "weightsyncgroups"),
}


def kind_of(obj: Mapping[str, Any]) -> Kind:
    try:
        return KINDS[str(obj["kind"])]
    except KeyError as exc:
        raise ValueError(f"the operator does not manage objects of kind {obj.get('kind')!r}") from exc


def path_of(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return kind_of(obj).item(meta.get("namespace"), str(meta["name"]))


def login(**kwargs: Any) -> kopf.ConnectionInfo:
    """Credentials, as kopf would find them: through the ``kubernetes`` package (in-cluster service
    account, else the kubeconfig it finds), else kopf's own minimal service-account/kubeconfig readers
    (which read ``$KUBECONFIG`` at call time)."""
    settings = kwargs.pop("settings", None) or kopf.OperatorSettings()
    log = kwargs.pop("logger", None) or logger
    info: kopf.ConnectionInfo | None = None
    try:
        info = kopf.login_via_client(logger=log, settings=settings)
    except kopf.LoginError as exc:
        log.debug("kubernetes client login failed (%s); trying the service account and $KUBECONFIG", exc)
    if info is None:
        info = kopf.login_with_service_account(settings=settings)
    if info is None:
        info = kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.LoginError("no credentials: neither a service account nor a kubeconfig was found")
    return info


class KubeApi:
    """The operator's API access. One aiohttp session, created lazily in the running loop."""

    def __init__(
        self,
        connect: ConnectFn,
        *,
        timeout: float = 30.0,
        user_agent: str = "weightsync-operator",
        max_connections: int = 32,
    ) -> None:
        self._connect = connect
        self._max_connections = max_connections
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._user_agent = user_agent
        self._info: kopf.ConnectionInfo | None = None
        self._session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()

    async def _ensure(self, *, fresh: bool = False) -> tuple[aiohttp.ClientSession, kopf.ConnectionInfo]:
        async with self._lock:
            if fresh or self._session is None or self._info is None or self._session.closed:
                if self._session is not None and not self._session.closed:
                    await self._session.close()
                info = await asyncio.to_thread(self._connect)
                use_tls = info.server.startswith("https")
                ssl = info.as_ssl_context() if use_tls else False
                connector = aiohttp.TCPConnector(ssl=ssl, limit=self._max_connections)
                headers = {"User-Agent": self._user_agent, "Accept": JSON, **info.as_http_headers()}
                self._session = aiohttp.ClientSession(
                    base_url=info.server.rstrip("/") + "/",
                    connector=connector,
                    headers=headers,
                    timeout=self._timeout,
                    trust_env=info.trust_env,
                )
                self._info = info
            return self._session, self._info

    async def login_again(self) -> None:
        """A fresh session with fresh credentials (after a 401 outside :meth:`request`, e.g. on a watch)."""
        await self._ensure(fresh=True)

    async def close(self) -> None:
        async with self._lock:
            if self._session is not None and not self._session.closed:
                await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = JSON,
    ) -> Any:
        for attempt in (1, 2):
            session, _ = await self._ensure(fresh=attempt == 2)
            metrics.API_REQUESTS.labels(verb=_verb(method, params)).inc()
            data = json.dumps(body) if body is not None else None
            headers = {"Content-Type": content_type} if data is not None else {}
            try:
                async with session.request(
                    method, path.lstrip("/"), params=params, data=data, headers=headers
                ) as response:
                    text = await response.text()
                    status = response.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                # No answer (refused, reset, timed out): an API error like any other, retried on the next resync,
                # not a bug with a traceback.
                raise ApiError(
                    UNAVAILABLE, "Unavailable", f"no answer from the API server: {exc!r}", method=method, path=path
                ) from exc
            if status == 401 and attempt == 1:
                logger.info("API server answered 401; logging in again")
                continue
            if status >= 400:
                reason, message = _error_of(status, text)
                raise ApiError(status, reason, message, method=method, path=path)
            return json.loads(text) if text else None
        raise AssertionError("unreachable")  # pragma: no cover

    # --- Verbs -----------------------------------------------------------------------------------

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            result = await self.request("GET", path)
        except ApiError as exc:
            if exc.not_found:
                return None
            raise
        return result if isinstance(result, dict) else None

    async def list(self, path: str, *, label_selector: str | None = None) -> list[dict[str, Any]]:
        return (await self.list_versioned(path, label_selector=label_selector))[0]

    async def list_versioned(self, path: str, *, label_selector: str | None = None) -> tuple[Items, str | None]:
        """The items, and the list's own ``resourceVersion`` (what the watch is ordered against)."""
        params = {"labelSelector": label_selector} if label_selector else {}
        result = await self.request("GET", path, params=params or None)
        # A real API server leaves kind/apiVersion off the items of a List; put them back from the
        # list's own kind ("PodList" -> "Pod") so every item can be addressed on its own.
        kind = str((result or {}).get("kind") or "").removesuffix("List")
        api_version = (result or {}).get("apiVersion")
        items = [i for i in (result or {}).get("items") or [] if isinstance(i, dict)]
        version = ((result or {}).get("metadata") or {}).get("resourceVersion")
        listed = [{"apiVersion": api_version, "kind": kind, **i} if kind and api_version else i for i in items]
        return listed, str(version) if version is not None else None

    async def watch(
        self, path: str, params: Mapping[str, str], *, read_timeout: float, max_event_bytes: int
    ) -> AsyncIterator[dict[str, Any]]:
        """The events of one watch request (``watch=true`` is added), each decoded from its JSON line, until the
        server ends the stream. Errors as :meth:`request`'s: ApiError for a non-2xx answer or no answer (also when
        nothing arrives for ``read_timeout`` seconds); a line over ``max_event_bytes`` cuts the stream."""
        session, _ = await self._ensure()
        metrics.API_REQUESTS.labels(verb="watch").inc()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._timeout.total, sock_read=read_timeout)
        try:
            async with session.get(path.lstrip("/"), params={**params, "watch": "true"}, timeout=timeout) as response:
                if response.status >= 400:
                    reason, message = _error_of(response.status, await response.text())
                    raise ApiError(response.status, reason, message, method="WATCH", path=path)
                buffer = b""
                async for chunk in response.content.iter_any():
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        if line.strip():
                            yield json.loads(line)
                    if len(buffer) > max_event_bytes:
                        raise ApiError(UNAVAILABLE, "EventTooLarge", f"a watch event over {max_event_bytes} bytes",
                                       method="WATCH", path=path)  # fmt: skip
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ApiError(
                UNAVAILABLE, "Unavailable", f"the watch stream broke: {exc!r}", method="WATCH", path=path
            ) from exc

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj.get("metadata") or {}
        path = kind_of(obj).collection(meta.get("namespace"))
        result = await self.request("POST", path, body=obj)
        return result if isinstance(result, dict) else dict(obj)

    async def merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        result = await self.request("PATCH", path, body=patch, content_type=MERGE_PATCH)
        return result if isinstance(result, dict) else {}

    async def delete(self, path: str, *, uid: str | None = None) -> bool:
        """Delete (background propagation); with ``uid``, only that incarnation. False if absent."""
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "propagationPolicy": "Background",
        }
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            await self.request("DELETE", path, body=body)
        except ApiError as exc:
            if exc.not_found or exc.conflict:  # gone, or already replaced by a new incarnation
                return False
            raise
        return True


async def wait_until_served(
    api: KubeApi,
    paths: list[tuple[str, str | None]],
    *,
    timeout: float = 60.0,
    clock: Callable[[], float] | None = None,
) -> bool:
    """Wait until the API server answers a LIST of each of ``paths`` (path, label selector) with anything but
    429 Too Many Requests.

    Why: right after a CRD is created (``helm install``), the API server's watch cache for the new resource is
    still filling, and it answers LISTs and WATCHes with ``429 storage is (re)initializing`` (``Retry-After: 1``).
    kopf retries those, but logs every failed attempt at ERROR level. Run before kopf starts its watches (a
    startup handler), this wait takes that window out of kopf's view. Any other answer (2xx, 403, 404, ...)
    ends the wait for that path: it is not a cache still initializing. Returns False on timeout (the operator
    starts anyway; kopf then retries as it always does)."""
    now = clock or asyncio.get_running_loop().time
    deadline = now() + timeout
    for path, selector in paths:
        params = {"limit": "1", **({"labelSelector": selector} if selector else {})}
        while True:
            try:
                await api.request("GET", path, params=params)
                break
            except ApiError as exc:
                if exc.status == UNAVAILABLE:
                    logger.info("the API server is not answering %s yet (%s); waiting", path, exc.message)
                elif exc.status != 429:
                    break
                else:
                    logger.info("the API server is still initializing its cache for %s (%s); waiting", path,
                                exc.message)  # fmt: skip
            if now() >= deadline:
                return False
            await asyncio.sleep(1.0)
    return True


def _verb(method: str, params: Mapping[str, str] | None) -> str:
    """The Kubernetes verb of a request (a GET with a label selector is a LIST)."""
    if method == "GET":
        return "list" if params and ("labelSelector" in params or "limit" in params) else "get"
    return {"POST": "create", "PATCH": "patch", "DELETE": "delete", "PUT": "update"}.get(method, method.lower())


def _error_of(status: int, text: str) -> tuple[str, str]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return str(status), text[:500]
    if isinstance(data, dict):
        return str(data.get("reason") or status), str(data.get("message") or "")[:500]
    return str(status), text[:500]
