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
SCRUBS = Counter(
    "weightsync_agent_scrubs_total",
    "Engine ranks a scrub checked against the committed version (result: clean or drift)",
    ["group", "result"],
)
SCRUB_SECONDS = Histogram(
    "weightsync_agent_scrub_seconds",
    "How long one engine rank's scrub took (its engine's checker over the weights it serves)",
    ["group"],
)
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
ROUND_PHASE_SECONDS = Histogram(
    "weightsync_agent_round_phase_seconds",
    "Seconds a sync round spent in each phase (prepare, pause, begin, write, verify, commit, resume)",
    ["group", "kind", "phase"],
    buckets=(0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
ROUND_PAUSED_SECONDS = Histogram(
    "weightsync_agent_round_paused_seconds",
    "How long a sync round kept engines from serving (live: pause to resume; staged: the commit)",
    ["group", "kind"],
    buckets=(0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
#: The slowest peer's seconds of the last round, per role ("source", "target"): which peer it was is in the round's
#: record (``weightsync rounds``), not in a label, so the series count does not grow with the group.
ROUND_SLOWEST_SECONDS = Gauge(
    "weightsync_agent_round_slowest_seconds",
    "Seconds the slowest source or target of the last round took to write or be written",
    ["group", "role"],
)
#: Per peer of the last round: one series per source rank and per engine rank of the group's plan (so bounded by
#: the group's size, not by time; a replan's departed peers are dropped at the next round).
ROUND_PEER_SECONDS = Gauge(
    "weightsync_agent_round_peer_seconds",
    'Seconds each source (peer="source <r>") or target (peer="engine <e> rank <r>") took in the last round',
    ["group", "role", "peer"],
)
ROUND_PEER_BYTES = Gauge(
    "weightsync_agent_round_peer_bytes",
    "Bytes each source wrote or each target received in the last round",
    ["group", "role", "peer"],
)
