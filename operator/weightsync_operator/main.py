"""Run the operator: what ``weightsync operator`` calls."""

from __future__ import annotations

import kopf
import prometheus_client

import weightsync_operator.handlers  # noqa: F401  (importing registers the handlers with kopf)


def run(
    *,
    namespaces: list[str] | None = None,
    liveness: str | None = None,
    metrics_port: int | None = None,
    verbose: bool = False,
) -> None:
    """Run the operator in the foreground until it is stopped.

    ``namespaces``: watch only these (kopf patterns allowed); ``None`` or empty: the whole cluster.
    ``liveness``: e.g. ``http://0.0.0.0:8080/healthz`` (kopf's liveness endpoint).
    ``metrics_port``: serve Prometheus metrics on this port (all interfaces).
    """
    kopf.configure(verbose=verbose)
    if metrics_port is not None:
        prometheus_client.start_http_server(metrics_port)
    kopf.run(
        standalone=True,  # one replica (Recreate); no peering objects needed
        clusterwide=not namespaces,
        namespaces=namespaces or (),
        liveness_endpoint=liveness,
    )
