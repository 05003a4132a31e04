"""Where an agent (or an in-process trainer) reads the group's plan: a file, or the plan ConfigMap."""

from __future__ import annotations

from pathlib import Path

from weightsync.api import names
from weightsync.plan import Plan, PlanError
from weightsync_agent.config import AgentConfig
from weightsync_agent.kube import kube_core_api, transport_errors


def load_plan(config: AgentConfig, plan_file: Path | None) -> Plan:
    path = plan_file or (Path(config.plan_file) if config.plan_file else None)
    if path is not None:
        return Plan.from_json(path.read_text())
    if not config.plan_config_map:
        raise PlanError(f"no plan: set {names.ENV_PLAN_CONFIG_MAP} or {names.ENV_PLAN_FILE}")
    from kubernetes.client.exceptions import ApiException

    try:
        cm = kube_core_api().read_namespaced_config_map(config.plan_config_map, config.namespace)
    except ApiException as exc:
        raise PlanError(f"cannot read ConfigMap {config.plan_config_map}: {exc.status} {exc.reason}") from exc
    except transport_errors() as exc:
        cause = f"no answer from the API server ({exc})"
        raise PlanError(f"cannot read ConfigMap {config.plan_config_map}: {cause}") from exc
    data = (cm.data or {}).get(names.PLAN_KEY)
    if not data:
        raise PlanError(f"ConfigMap {config.plan_config_map} has no {names.PLAN_KEY}")
    return Plan.from_json(data)
