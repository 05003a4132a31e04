"""``weightsync agent``: load identity and plan, check them, serve health and metrics."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

from prometheus_client import Gauge, start_http_server

from weightsync.api import names
from weightsync.plan import Plan, PlanError
from weightsync_agent.config import AgentConfig, AgentConfigError
from weightsync_agent.duties import duties
from weightsync_agent.report import PodReporter, kube_core_api

log = logging.getLogger("weightsync.agent")

PLAN_REVISION = Gauge("weightsync_agent_plan_revision", "Revision of the plan this agent runs", ["group"])


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
    data = (cm.data or {}).get(names.PLAN_KEY)
    if not data:
        raise PlanError(f"ConfigMap {config.plan_config_map} has no {names.PLAN_KEY}")
    return Plan.from_json(data)


def run(plan_file: Path | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = AgentConfig.from_env()
        plan = load_plan(config, plan_file)
        work = duties(config, plan)
    except (AgentConfigError, PlanError, OSError) as exc:
        log.error("%s", exc)
        return 2
    log.info(
        "group %s, %s pod %d, plan revision %d (%s)",
        config.group,
        config.role,
        config.pod_index,
        plan.revision,
        plan.hash,
    )
    for duty in work:
        log.info("  %s", duty)
    PLAN_REVISION.labels(config.group).set(plan.revision)
    start_http_server(config.agent_port)
    if config.pod_name:
        # Bound to a pod: tell the operator (through the readiness gate) that this agent is up.
        PodReporter(kube_core_api(), config.namespace, config.pod_name).set_ready(
            True, "PlanLoaded", f"plan revision {plan.revision} ({plan.hash})"
        )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    return 0
