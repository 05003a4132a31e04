"""The operator's entry point, its environment and the kopf settings it installs."""

from __future__ import annotations

import logging
from typing import Any

import kopf
import pytest

from weightsync.api import names
from weightsync_operator import handlers, main
from weightsync_operator.config import (
    ENV_CREATE_CONCURRENCY,
    ENV_POD_RELIST_SECONDS,
    ENV_STATUS_INTERVAL,
    OperatorConfig,
)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(main.kopf, "run", lambda **kw: seen.setdefault("run", kw))
    monkeypatch.setattr(main.kopf, "configure", lambda **kw: seen.setdefault("configure", kw))
    monkeypatch.setattr(main.prometheus_client, "start_http_server", lambda port: seen.setdefault("metrics", port))
    return seen


def test_run_in_namespaces_with_probes_and_metrics(calls: dict[str, Any]) -> None:
    main.run(namespaces=["ml", "rl"], liveness="http://0.0.0.0:8080/healthz", metrics_port=9090, verbose=True)
    assert calls["run"] == {
        "standalone": True,
        "clusterwide": False,
        "namespaces": ["ml", "rl"],
        "liveness_endpoint": "http://0.0.0.0:8080/healthz",
    }
    assert calls["metrics"] == 9090
    assert calls["configure"] == {"verbose": True}
    assert handlers.WATCH_NAMESPACES == ("ml", "rl")
    # The CEL library traces every evaluation step at DEBUG: kept out of the log even with --verbose.
    assert logging.getLogger("celpy").getEffectiveLevel() == logging.WARNING
    assert logging.getLogger("celpy.Evaluator").getEffectiveLevel() == logging.WARNING


def test_run_clusterwide_by_default(calls: dict[str, Any]) -> None:
    main.run()
    assert calls["run"]["clusterwide"] is True and calls["run"]["namespaces"] == ()
    assert calls["run"]["liveness_endpoint"] is None
    assert "metrics" not in calls


def test_config_from_env() -> None:
    assert OperatorConfig.from_env({}) == OperatorConfig(agent_image=None, resync_seconds=30.0)
    assert OperatorConfig.from_env({}).create_concurrency == 32
    scale = OperatorConfig.from_env(
        {ENV_CREATE_CONCURRENCY: "8", ENV_STATUS_INTERVAL: "0.5", ENV_POD_RELIST_SECONDS: "120"}
    )
    assert (scale.create_concurrency, scale.status_interval, scale.pod_relist_seconds) == (8, 0.5, 120.0)
    with pytest.raises(ValueError, match=ENV_CREATE_CONCURRENCY):
        OperatorConfig.from_env({ENV_CREATE_CONCURRENCY: "1.5"})
    with pytest.raises(ValueError, match="positive"):
        OperatorConfig.from_env({ENV_CREATE_CONCURRENCY: "0"})
    env = {names.OPERATOR_ENV_AGENT_IMAGE: " reg/agent:1 ", names.OPERATOR_ENV_RESYNC_SECONDS: "5"}
    assert OperatorConfig.from_env(env) == OperatorConfig(agent_image="reg/agent:1", resync_seconds=5.0)
    with pytest.raises(ValueError, match=names.OPERATOR_ENV_RESYNC_SECONDS):
        OperatorConfig.from_env({names.OPERATOR_ENV_RESYNC_SECONDS: "soon"})
    with pytest.raises(ValueError, match="positive"):
        OperatorConfig.from_env({names.OPERATOR_ENV_RESYNC_SECONDS: "0"})


def test_the_startup_waits_for_what_kopf_will_watch() -> None:
    assert handlers.served_paths(()) == [
        ("/apis/weightsync.io/v1alpha1/weightsyncgroups", None),
        ("/api/v1/pods", names.LABEL_GROUP),
    ]
    assert handlers.served_paths(("ml", "rl")) == [
        ("/apis/weightsync.io/v1alpha1/namespaces/ml/weightsyncgroups", None),
        ("/apis/weightsync.io/v1alpha1/namespaces/rl/weightsyncgroups", None),
        ("/api/v1/namespaces/ml/pods", names.LABEL_GROUP),
        ("/api/v1/namespaces/rl/pods", names.LABEL_GROUP),
    ]


def test_namespace_patterns_are_refused_before_anything_runs() -> None:
    assert handlers.namespace_patterns(("ml", "rl-*", "team-[ab]")) == ["rl-*", "team-[ab]"]
    with pytest.raises(ValueError, match=r"patterns are not supported \(rl-\*\): name each namespace"):
        main.run(namespaces=["ml", "rl-*"])


def test_kopf_settings_keep_kopf_out_of_the_way() -> None:
    settings = kopf.OperatorSettings()
    handlers.configure(settings)
    assert settings.persistence.finalizer == "weightsync.io/finalizer"
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert settings.persistence.progress_storage.prefix == "weightsync.io"
    assert isinstance(settings.persistence.diffbase_storage, kopf.AnnotationsDiffBaseStorage)
    assert settings.persistence.diffbase_storage.prefix == "weightsync.io"
    assert settings.posting.level == logging.WARNING
    assert not settings.watching.label_selectors  # kopf watches only the groups: the pods have their own watch


def test_no_handler_needs_a_finalizer() -> None:
    """Deletion of a group is never blocked by the operator: no delete handlers, timers or daemons."""
    registry = kopf.get_default_registry()
    changing = list(registry._changing.get_all_handlers())
    assert len(changing) == 3  # create, update, resume
    assert list(registry._spawning.get_all_handlers()) == []  # timers and daemons add finalizers
    for handler in changing:
        assert not handler.requires_finalizer, handler
