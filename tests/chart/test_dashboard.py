"""The chart's Grafana dashboard and the agents' PodMonitor: off by default, rendered with the discovery label when
asked, and every series and label the dashboard queries is one the agents export (so no panel is silently empty)."""

from __future__ import annotations

import json
import re
from typing import Any

import kubernetes_validate
import prometheus_client
import pytest
from test_chart import CHART, KUBE_VERSIONS, NAMESPACE, Renderer, _by_kind, _one

from weightsync.api import names
from weightsync_agent import metrics

DASHBOARD = CHART / "dashboards" / "weightsync-rounds.json"
ON = ("--set", "dashboards.enabled=true", "--set", "metrics.podMonitor.enabled=true")
#: What a histogram exports besides its name.
SUFFIXES = ("_bucket", "_sum", "_count")
#: Labels Prometheus adds or a histogram has on its own.
IMPLICIT_LABELS = {"le", "__name__", "job", "instance", "namespace", "pod"}


@pytest.fixture(scope="module")
def render(helm_bin: str, helm_env: dict[str, str]) -> Renderer:
    return Renderer(helm_bin, helm_env)


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def queries(board: dict[str, Any]) -> list[str]:
    found = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    found += [v["query"]["query"] for v in board["templating"]["list"] if isinstance(v.get("query"), dict)]
    return found


def exported() -> dict[str, set[str]]:
    """Every series the agents export: name (histograms with their suffixes) -> its label names."""
    series: dict[str, set[str]] = {}
    for value in vars(metrics).values():
        if isinstance(value, prometheus_client.metrics.MetricWrapperBase):
            base = value._name
            labels = set(value._labelnames)
            kind = value._type
            names_ = [f"{base}_total"] if kind == "counter" else [base]
            if kind == "histogram":
                names_ += [base + suffix for suffix in SUFFIXES]
            for name in names_:
                series[name] = labels
    return series


def test_the_dashboard_is_grafana_json_with_panels_that_query_prometheus() -> None:
    board = dashboard()
    assert board["uid"] and board["title"] and len(board["panels"]) >= 8
    for panel in board["panels"]:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"


def test_every_series_and_label_the_dashboard_uses_is_exported() -> None:
    series = exported()
    used: set[str] = set()
    for expr in queries(dashboard()):
        for name in re.findall(r"\bweightsync_[a-z_]+\b", expr):
            assert name in series, f"{name} is not exported by the agents (used in {expr})"
            used.add(name)
        for selector in re.findall(r"\{([^}]*)\}", expr):
            for label in re.findall(r"(\w+)\s*(?:=~|!=|!~|=)", selector):
                owners = [n for n in re.findall(r"\bweightsync_[a-z_]+\b", expr)]
                assert any(label in series[n] or label in IMPLICIT_LABELS for n in owners), (label, expr)
        for label in re.findall(r"by \(([^)]*)\)", expr):
            for name in (x.strip() for x in label.split(",")):
                owners = re.findall(r"\bweightsync_[a-z_]+\b", expr)
                assert any(name in series[n] or name in IMPLICIT_LABELS for n in owners), (name, expr)
    # The round record's series are all on the dashboard.
    for wanted in ("weightsync_agent_round_phase_seconds", "weightsync_agent_round_paused_seconds",
                   "weightsync_agent_round_slowest_seconds", "weightsync_agent_rounds_total",
                   "weightsync_agent_round_peer_seconds"):  # fmt: skip
        assert any(n.startswith(wanted) for n in used), wanted


def test_a_query_naming_a_series_nobody_exports_is_caught() -> None:
    """Negative control for the check above."""
    with pytest.raises(AssertionError):
        for expr in ["rate(weightsync_agent_round_nap_seconds_sum[5m])"]:
            for name in re.findall(r"\bweightsync_[a-z_]+\b", expr):
                assert name in exported()


def test_off_by_default(render: Renderer) -> None:
    docs = render()
    assert not [d for d in _by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboards")]
    assert not _by_kind(docs, "PodMonitor")


def test_the_dashboard_configmap_carries_the_discovery_label_and_the_file(render: Renderer) -> None:
    docs = render(*ON)
    configmap = _one(docs, "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == NAMESPACE
    assert json.loads(configmap["data"]["weightsync-rounds.json"]) == dashboard()
    moved = _one(render(*ON, "--set", "dashboards.namespace=monitoring", "--set",
                        "dashboards.annotations.grafana_folder=weightsync"), "ConfigMap")  # fmt: skip
    assert moved["metadata"]["namespace"] == "monitoring"
    assert moved["metadata"]["annotations"] == {"grafana_folder": "weightsync"}
    for kube_version in KUBE_VERSIONS:
        kubernetes_validate.validate(configmap, kube_version, strict=True)


def test_the_podmonitor_scrapes_every_groups_agents_on_their_named_port(render: Renderer) -> None:
    monitor = _one(render(*ON), "PodMonitor")
    assert monitor["spec"]["selector"] == {"matchExpressions": [{"key": names.LABEL_GROUP, "operator": "Exists"}]}
    assert monitor["spec"]["podMetricsEndpoints"] == [{"port": names.AGENT_PORT_NAME, "path": "/metrics",
                                                       "interval": "30s"}]  # fmt: skip
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    scoped = _one(render(*ON, "--set", "watchNamespaces={team-a}"), "PodMonitor")
    assert scoped["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--set", "dashboards.labels=null"), "dashboards"),
        (("--set", "metrics.podMonitor.interval=soon"), "interval"),
        (("--set", "dashboards.namespace=Not_A_Namespace"), "namespace"),
    ],
)
def test_bad_values_are_refused_by_the_schema(render: Renderer, args: tuple[str, ...], message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        render.raw(*args)
