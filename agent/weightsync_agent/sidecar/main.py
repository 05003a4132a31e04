"""``weightsync agent``: load identity and plan, check them, run the role and serve its HTTP API."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

from weightsync.api import names
from weightsync.plan import Plan, PlanError
from weightsync_agent.config import AgentConfig, AgentConfigError, replica_dir
from weightsync_agent.directory import Directory, DirectoryError, FileDirectory, PodDirectory
from weightsync_agent.http.credential import Credential, CredentialError
from weightsync_agent.http.server import BackgroundServer
from weightsync_agent.kube import kube_core_api
from weightsync_agent.plan_loader import PlanSource, plan_source
from weightsync_agent.sidecar.duties import duties
from weightsync_agent.sidecar.report import PodReporter
from weightsync_agent.sidecar.routes import build_app
from weightsync_agent.sidecar.runtime import AgentRuntime
from weightsync_agent.transport.base import Transport

log = logging.getLogger("weightsync.agent")

#: How long an agent told to stop (SIGTERM, SIGINT) takes at most to stop serving and exit.
STOP_SECONDS = 3.0


def make_directory(config: AgentConfig, plan: Plan) -> Directory:
    """A local directory file when given (runs without a cluster), else the pods' annotations."""
    if config.directory_file:
        return FileDirectory(config.directory_file)
    return PodDirectory(kube_core_api(), config.namespace, config.group, plan.layout, loopback=config.loopback_peers)


def make_transport(config: AgentConfig, plan: Plan) -> Transport:
    from weightsync_agent.transport.mooncake import MooncakeTransport

    devices = os.environ.get(names.ENV_DEVICES, "")
    return MooncakeTransport(
        config.host,
        plan.transfer.protocol,
        devices,
        timeout_seconds=plan.transfer.timeouts.peer_stall,
        ports=(plan.transfer.mooncake_ports.start, plan.transfer.mooncake_ports.end),
    )


def replica_root(config: AgentConfig, rank: int) -> Path:
    """Where rank ``rank``'s replica files go; ``WEIGHTSYNC_REPLICA_PATH`` names it for one-rank pods."""
    explicit = os.environ.get(names.ENV_REPLICA_PATH)
    if explicit and len(config.ranks) == 1:
        return Path(explicit)
    return replica_dir(config.group, rank)


def run(plan_file: Path | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = AgentConfig.from_env()
        try:
            keys = Credential.from_sources(config.credentials_dir, config.group_token)
        except CredentialError as exc:
            raise AgentConfigError(
                f"{exc} (the operator mounts the Secret {names.group_secret(config.group)} at "
                f"{names.CREDENTIALS_PATH}; docs/security.md)"
            ) from exc
        reporter = PodReporter(kube_core_api(), config.namespace, config.pod_name) if config.pod_name else None
        source: PlanSource = plan_source(config, plan_file, keys, reporter.resync_soon if reporter else None)
        plan = source()
        work = duties(config, plan)
        directory = make_directory(config, plan)
    except (AgentConfigError, PlanError, DirectoryError, OSError) as exc:
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
    runtime = AgentRuntime(
        config,
        source,
        directory,
        make_transport=lambda p: make_transport(config, p),
        replica_root=lambda rank: replica_root(config, rank),
        reporter=reporter,
        engine_url=config.advertised_engine_url(plan.layout.engine_port) if config.role == "engine" else None,
        agent_url=config.advertised_agent_url(),
        tick_seconds=float(os.environ.get("WEIGHTSYNC_TICK_SECONDS", "2")),
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    # The pod's IP for peers, its loopback for the trainer containers beside it (WeightSyncClient.from_env).
    server = BackgroundServer(build_app(runtime), config.host, config.agent_port, also_loopback=True).start()
    log.info("agent listening on %s", server.url)
    try:
        runtime.start()
        stop.wait()
        log.info("stopping: what is in flight is dropped")
    finally:

        def shut_down() -> None:
            server.stop()
            runtime.stop()
            source.close()

        stopping = threading.Thread(target=shut_down, name="shutdown", daemon=True)
        stopping.start()
        stopping.join(STOP_SECONDS)
    # Whatever still waits must not hold the pod past SIGTERM: a trainer's publish waits for its round (up to its
    # budget), a peer's long poll up to a minute, a tick may be mid-catch-up; the kubelet would wait out the pod's grace
    # period and kill it anyway (a trainer pod deleted mid-round took 10 s to stop: docs/faults.md). Those callers see
    # the connection close, as when a pod goes.
    logging.shutdown()
    os._exit(0)
