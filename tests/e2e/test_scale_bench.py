"""``weightsync bench --scenario scale`` at a small size: the machinery works and its measurements are sane.

Not timed: the benchmark prints the timings; this checks that it measures what it says (docs/scale.md). Its own
local cluster (64 kwok nodes, audit log), the chart, the operator and stand-in agents for 32 pods.
"""

from __future__ import annotations

from pathlib import Path

from weightsync_tools.localcluster.scale_bench import Bench, count_requests, user_class


def test_the_scale_bench_measures_a_small_group(tmp_path: Path) -> None:
    said: list[str] = []
    progress: list[tuple[str, int, int]] = []
    bench = Bench(tmp_path / "cluster", said.append, lambda *p: progress.append(p), idle_seconds=10)
    report = bench.run([32])
    assert report.standin_errors == []
    (size,) = report.sizes
    assert (size.pods, size.trainer_pods, size.engine_pods) == (32, 8, 24)
    assert size.first_status_s is not None and size.ready_s is not None
    assert 0 < size.first_status_s <= size.ready_s
    assert size.delete_s is not None and size.left_behind == []
    assert (report.scale_out_from, report.scale_out_to) == (32, 36)
    assert report.scale_out_ready_s is not None and report.moved_targets == 0
    # Every pod reached Ready through its stand-in: the progress shows all of them.
    assert ("scale-32 Ready", 32, 32) in progress and ("scale-32 Ready", 36, 36) in progress
    # The audit log was read: the control plane's own components ask while idle. The operator asks only at its
    # resync (about 9 GETs per group, every 30 s), so a 10 s window may hold none of its requests, never many: at
    # most one resync and the reconciles of status reports that land late on a slow machine (an AMD EPYC 2-core run
    # counted 11, 1.1/s). An operator that polled would show several per second per group.
    assert report.idle_window_s is not None and report.idle_rps.get("other", 0) > 0
    assert report.idle_rps.get("operator", 0) <= 2.0
    assert report.idle_agent_rps_per_100_pods is not None and report.idle_agent_rps_per_100_pods <= 1.0
    assert report.operator_cpu_s is not None and report.operator_cpu_s > 0
    assert report.operator_peak_rss_mib is not None and 20 < report.operator_peak_rss_mib < 2000
    assert "stand-ins" in report.note


def test_requests_are_counted_once_per_audit_id_and_by_user(tmp_path: Path) -> None:
    import json
    from datetime import UTC, datetime

    log = tmp_path / "audit.log"
    events = [
        ("a", "system:serviceaccount:scale:g-agent", "ResponseStarted", "watch"),
        ("a", "system:serviceaccount:scale:g-agent", "ResponseComplete", "watch"),
        ("b", "system:serviceaccount:weightsync-system:weightsync", "ResponseComplete", "list"),
        ("c", "kubernetes-admin", "ResponseComplete", "get"),
    ]
    at = "2026-01-01T00:00:01.000000Z"
    log.write_text("\n".join(json.dumps({"auditID": i, "user": {"username": u}, "stage": s, "verb": v,
                                         "requestReceivedTimestamp": at, "objectRef": {"resource": "pods"}})
                             for i, u, s, v in events) + "\nnot json\n")  # fmt: skip
    start, end = datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 1, 1, 0, 0, 2, tzinfo=UTC)
    by_user, by_verb = count_requests(log, start, end, "scale")
    assert dict(by_user) == {"agents": 1, "operator": 1, "other": 1}
    assert by_verb["agents"] == {"watch pods": 1}
    assert user_class("system:serviceaccount:elsewhere:x", "scale") == "other"
