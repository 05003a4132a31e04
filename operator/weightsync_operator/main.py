"""Run the operator: what ``weightsync operator`` calls."""

from __future__ import annotations

import logging

import kopf
import prometheus_client

from weightsync_operator import handlers  # importing registers the handlers with kopf

#: Loggers that stay at WARNING even with ``--verbose``: cel-python traces every evaluation step at DEBUG
#: (~275 KB of log per reconcile of a 1,024-pod group); kopf's verbosity is about the operator's own work.
QUIET_LOGGERS = ("celpy",)


def run(
    *,
    namespaces: list[str] | None = None,
    liveness: str | None = None,
    metrics_port: int | None = None,
    verbose: bool = False,
) -> None:
    """Run the operator in the foreground until it is stopped.

    ``namespaces``: watch only these (names, not patterns: ValueError); ``None`` or empty: the whole cluster.
    ``liveness``: e.g. ``http://0.0.0.0:8080/healthz`` (kopf's liveness endpoint).
    ``metrics_port``: serve Prometheus metrics on this port (all interfaces).
    """
    patterns = handlers.namespace_patterns(tuple(namespaces or ()))
    if patterns:
        raise ValueError(
            f"namespace patterns are not supported ({', '.join(patterns)}): name each namespace (the chart makes "
            "a Role in each one listed)"
        )
    kopf.configure(verbose=verbose)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    handlers.WATCH_NAMESPACES = tuple(namespaces or ())
    if metrics_port is not None:
        prometheus_client.start_http_server(metrics_port)
    kopf.run(
        standalone=True,  # one replica (Recreate); no peering objects needed
        clusterwide=not namespaces,
        namespaces=namespaces or (),
        liveness_endpoint=liveness,
    )
