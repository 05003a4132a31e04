"""The agent's Prometheus metrics (served on the agent port at ``/metrics``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

PLAN_REVISION = Gauge("weightsync_agent_plan_revision", "Revision of the plan this agent runs", ["group"])
WEIGHT_VERSION = Gauge(
    "weightsync_agent_weight_version",
    "Newest version committed (coordinator) or held by the engine (engine agents); numeric versions only",
    ["group"],
)
ROUNDS = Counter("weightsync_agent_rounds_total", "Sync rounds this coordinator ran", ["group", "kind", "result"])
ROUND_SECONDS = Histogram(
    "weightsync_agent_round_seconds",
    "Duration of sync rounds, pause to resume",
    ["group", "kind"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
ROUND_BYTES = Counter("weightsync_agent_round_bytes_total", "Bytes written in successful rounds", ["group", "kind"])
SOURCE_BYTES = Counter("weightsync_agent_source_bytes_total", "Bytes this trainer rank wrote", ["group", "rank"])
SOURCE_SECONDS = Histogram(
    "weightsync_agent_source_publish_seconds",
    "Time one trainer rank spent writing its targets",
    ["group", "rank"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
)
SOURCE_FAILURES = Counter(
    "weightsync_agent_source_failures_total", "Publishes of this trainer rank that failed", ["group", "rank"]
)
