"""A whole group as local processes, no cluster: reference engines, one agent per trainer pod.

What ``weightsync demo --local`` and the agent integration tests run. Every piece is the real thing
(``weightsync agent`` processes, reference engine processes, Mooncake over TCP on loopback); only the
discovery differs from a cluster: agents read the plan from a file and find their peers in a directory
file (``WEIGHTSYNC_DIRECTORY_FILE``) instead of the plan ConfigMap and pod annotations.

The trainer side is whatever process calls :meth:`LoopbackGroup.client`: it attaches to a rank's replica
files and publishes through that rank's agent, as trainer code does in a pod.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from weightsync.api import names
from weightsync.api.token import new_token
from weightsync.api.v1alpha1 import TransferSpec, WeightSyncGroupSpec
from weightsync.plan import Plan, plan_for, replan
from weightsync.ports import free_port
from weightsync_agent.client import WeightSyncClient
from weightsync_agent.directory import StaticDirectory
from weightsync_agent.http.client import JsonHttpClient
from weightsync_agent.layout.manifest import Manifest
from weightsync_agent.rounds.remote import AgentClient, AgentError
from weightsync_agent.targets.registry import adapter_class
from weightsync_testing.engine_harness import EngineHarness, ReferenceEngines, StartedEngine
from weightsync_testing.reference_engine.launch import stop_process
from weightsync_testing.server_process import retire, stop_side_by_side


@dataclass
class AgentProcess:
    pod: int
    port: int
    env: dict[str, str]
    process: subprocess.Popen[bytes]
    log: IO[bytes] = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, *, kill: bool = False) -> None:
        stop_process(self.process, kill=kill)
        self.log.close()

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")


class LoopbackGroup:
    def __init__(
        self,
        spec: WeightSyncGroupSpec,
        *,
        group: str = "local",
        workdir: Path | None = None,
        engines: EngineHarness | None = None,
        mounted_credentials: bool = False,
        engine_agents: bool = False,
    ) -> None:
        """``mounted_credentials``: agents read the group's credential from files (``token``, ``previous``), one
        folder per agent, as from the Secret volume a kubelet refreshes (:meth:`write_credentials`); else from
        ``WEIGHTSYNC_GROUP_TOKEN``. ``engine_agents``: every engine gets its pod's agent, as on a cluster (by
        default only engines whose adapter takes its manifests from that agent, SGLang's, get one)."""
        if spec.trainer.ranks_per_pod != 1:
            raise ValueError("local groups run one trainer rank per agent (trainer.ranksPerPod: 1)")
        if spec.inference.ranks_per_pod != spec.inference.ranks_per_engine:
            raise ValueError("local groups run each engine as one process (inference.ranksPerPod = ranksPerEngine)")
        self.spec = spec
        self.group = group
        self._own_workdir = workdir is None
        # Replicas are memory-backed files: keep them on tmpfs, like the pods' /dev/shm.
        root = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix=f"weightsync-{group}-", dir=root))
        self.plan: Plan = plan_for(spec, group=group, namespace="local")
        self.harness: EngineHarness = engines or ReferenceEngines()
        self.engines: dict[int, StartedEngine] = {}
        self.agents: dict[int, AgentProcess] = {}
        self.engine_agents: dict[int, AgentProcess] = {}
        self.directory = StaticDirectory({}, {})
        #: The group's credential, as the operator's Secret would hold it: agents and engines require it.
        self.token = new_token()
        self.mounted_credentials = mounted_credentials
        self.with_engine_agents = engine_agents
        self.previous_token: str | None = None

    # --- Files the agents read ---------------------------------------------------------------------

    @property
    def plan_file(self) -> Path:
        return self.workdir / "plan.json"

    @property
    def directory_file(self) -> Path:
        return self.workdir / "directory.json"

    def _write(self, path: Path, text: str) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)  # agents never read half a file

    def credentials_dir(self, agent: str) -> Path:
        """Agent ``agent``'s (``agent-<pod>``, ``engine-<e>``) copy of the Secret's files."""
        return self.workdir / "credentials" / agent

    def write_credentials(self, token: str, previous: str | None = None, *, agents: list[str] | None = None) -> None:
        """The Secret changed (a rotation): refresh the agents' files as their kubelets would, each file renamed in
        at once, ``previous`` removed when None. ``agents``: only those (a kubelet that has not refreshed yet)."""
        if not self.mounted_credentials:
            raise ValueError("this group's agents read the token from their environment (mounted_credentials)")
        self.token, self.previous_token = token, previous
        names_ = agents if agents is not None else [*(f"agent-{p}" for p in self.agents),
                                                    *(f"engine-{e}" for e in self.engine_agents)]  # fmt: skip
        for agent in names_:
            self._write_secret_files(self.credentials_dir(agent), token, previous)

    def _write_secret_files(self, folder: Path, token: str, previous: str | None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self._write(folder / names.SECRET_TOKEN_KEY, token)
        if previous is None:
            (folder / names.SECRET_PREVIOUS_KEY).unlink(missing_ok=True)
        else:
            self._write(folder / names.SECRET_PREVIOUS_KEY, previous)

    def _credential_env(self, agent: str) -> dict[str, str]:
        if not self.mounted_credentials:
            return {names.ENV_GROUP_TOKEN: self.token}
        folder = self.credentials_dir(agent)
        if not (folder / names.SECRET_TOKEN_KEY).exists():
            self._write_secret_files(folder, self.token, self.previous_token)
        return {names.ENV_CREDENTIALS_DIR: str(folder)}

    def _publish_files(self) -> None:
        self._write(self.plan_file, self.plan.to_json())
        self._write(self.directory_file, json.dumps(self.directory.to_json()))

    # --- Lifecycle ---------------------------------------------------------------------------------

    def start(self, *, seed: int = 0, timeout: float = 90.0) -> LoopbackGroup:
        try:
            for engine in range(self.spec.inference.engines):
                self._start_engine(engine, seed)
            for pod in range(self.spec.trainer.replicas):
                self.directory.trainers[pod] = f"http://127.0.0.1:{free_port()}"
            self._publish_files()
            for pod in range(self.spec.trainer.replicas):
                self.start_agent(pod)
            self.wait_built(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_engine(self, engine: int, seed: int) -> None:
        started = self.harness.start(engine, self.spec, seed + engine, token=self.token)
        self.engines[engine] = started
        self.directory.engines[engine] = started.url
        adapter = adapter_class(self.spec.inference.adapter)
        if self.with_engine_agents or (adapter is not None and adapter.manifests_from_engine_agent):
            self.directory.engine_agents[engine] = f"http://127.0.0.1:{free_port()}"
            self._publish_files()
            self._spawn_engine_agent(engine)

    def _spawn_engine_agent(self, engine: int) -> AgentProcess:
        """Engine ``engine``'s pod agent, at the port the directory gives it."""
        port = int(self.directory.engine_agents[engine].rsplit(":", 1)[1])
        agent = self._spawn(f"engine-{engine}", self.engine_agent_env(engine, port, self.engines[engine]))
        self.engine_agents[engine] = agent
        return agent

    def engine_agent_env(self, engine: int, port: int, started: StartedEngine) -> dict[str, str]:
        ranks = range(self.spec.inference.ranks_per_engine)
        return {
            names.ENV_GROUP: self.group,
            names.ENV_NAMESPACE: "local",
            names.ENV_ROLE: "engine",
            names.ENV_POD_INDEX: "0",
            names.ENV_ENGINE_INDEX: str(engine),
            names.ENV_RANKS: ",".join(str(r) for r in ranks),
            names.ENV_PLAN_FILE: str(self.plan_file),
            names.ENV_DIRECTORY_FILE: str(self.directory_file),
            names.ENV_AGENT_PORT: str(port),
            names.ENV_ENGINE_URL: started.url,
            **self._credential_env(f"engine-{engine}"),
            "WEIGHTSYNC_TICK_SECONDS": "0.5",
            **started.agent_env,
        }

    def agent_env(self, pod: int) -> dict[str, str]:
        port = int(self.directory.trainers[pod].rsplit(":", 1)[1])
        return {
            names.ENV_GROUP: self.group,
            names.ENV_NAMESPACE: "local",
            names.ENV_ROLE: "trainer",
            names.ENV_POD_INDEX: str(pod),
            names.ENV_RANKS: str(pod),
            names.ENV_PLAN_FILE: str(self.plan_file),
            names.ENV_DIRECTORY_FILE: str(self.directory_file),
            names.ENV_AGENT_PORT: str(port),
            names.ENV_REPLICA_PATH: str(self.workdir / f"replica-{pod}"),
            **self._credential_env(f"agent-{pod}"),
            "WEIGHTSYNC_TICK_SECONDS": "0.5",
        }

    def start_agent(self, pod: int) -> AgentProcess:
        agent = self._spawn(f"agent-{pod}", self.agent_env(pod), pod)
        self.agents[pod] = agent
        return agent

    def restart_agent(self, pod: int, timeout: float = 60.0) -> AgentProcess:
        """Trainer pod ``pod``'s agent SIGKILLed (if it still runs) and started again, as a kubelet restarts a sidecar
        (same replica files); returns once every agent built its sources."""
        self.agents[pod].stop(kill=True)
        agent = self.start_agent(pod)
        self.wait_built(timeout)
        return agent

    def _spawn(self, name: str, env: dict[str, str], pod: int = 0) -> AgentProcess:
        log = (self.workdir / f"{name}.log").open("ab")
        process = subprocess.Popen(
            [sys.executable, "-m", "weightsync_tools.cli.main", "agent"],
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return AgentProcess(pod, int(env[names.ENV_AGENT_PORT]), env, process, log)

    def wait_built(self, timeout: float = 90.0, *, plan_hash: str | None = None) -> None:
        """Until every agent built its sources (for ``plan_hash``, when given)."""
        deadline = time.monotonic() + timeout
        for pod, agent in self.agents.items():
            client = AgentClient(agent.url, timeout=5.0, token=self.token)
            while True:
                if agent.process.poll() is not None:
                    raise RuntimeError(f"agent of trainer pod {pod} exited:\n{agent.log_text()[-3000:]}")
                try:
                    sources = client.state().get("sources") or {}
                    plan = sources.get("plan") or {}
                    if sources.get("built") and (plan_hash is None or plan.get("hash") == plan_hash):
                        break
                except AgentError:
                    pass
                if time.monotonic() > deadline:
                    logs = [(f"trainer pod {pod}", agent), *((f"engine {e}", a) for e, a in self.engine_agents.items())]
                    tails = "".join(f"\n--- agent of {who}:\n{a.log_text()[-1500:]}" for who, a in logs)
                    raise TimeoutError(f"agent of trainer pod {pod} not built after {timeout:.0f} s{tails}")
                time.sleep(0.2)

    def committed(self) -> int:
        """The version the coordinator (trainer pod 0's agent) committed last (0: none yet)."""
        return int(AgentClient(self.agents[0].url, timeout=10.0, token=self.token).state()["committed"] or 0)

    def client(self, rank: int, *, sidecar_timeout: float = 60.0) -> WeightSyncClient:
        """The trainer-side client of ``rank``, as trainer code in that rank's pod builds it."""
        # Trainer code's environment: the pod's identity, not the group's credential (its sidecar hands it a
        # pod-local token through the replica folder).
        env = {
            k: v for k, v in self.agent_env(rank).items() if k not in (names.ENV_GROUP_TOKEN, names.ENV_CREDENTIALS_DIR)
        }
        env = {**env, "LOCAL_RANK": "0"}
        return WeightSyncClient.from_env(env, plan=self.plan, sidecar_timeout=sidecar_timeout)

    def manifest(self, engine: int, rank: int = 0) -> Manifest:
        """Rank ``rank``'s manifest as engine ``engine``'s agent serves it to the sources."""
        client = JsonHttpClient(self.engine_agents[engine].url, timeout=120, api_key=self.token)
        _, answer = client.request("GET", "/v1/engine/manifest", query={"rank": rank})
        return Manifest.model_validate(answer)

    @contextlib.contextmanager
    def clients(self, *, sidecar_timeout: float = 60.0) -> Iterator[list[WeightSyncClient]]:
        """One trainer-side client per trainer pod (:meth:`client`), closed on exit."""
        made = [self.client(rank, sidecar_timeout=sidecar_timeout) for rank in range(self.spec.trainer.replicas)]
        try:
            yield made
        finally:
            for client in made:
                client.close()

    def scale_engines(self, engines: int, *, seed: int = 100) -> Plan:
        """Add engines (the operator's replan, by hand): start them, then hand the agents the new plan."""
        spec = self.spec.model_copy(update={"inference": self.spec.inference.model_copy(update={"engines": engines})})
        for engine in range(self.spec.inference.engines, engines):
            self._start_engine(engine, seed)
        self.spec = spec
        self.plan = replan(self.plan, spec)
        self._publish_files()
        return self.plan

    def update_transfer(self, **changes: object) -> Plan:
        """Edit ``spec.transfer`` (camelCase keys, as in YAML) and hand the agents the replanned plan, as the operator
        does after an edit; the caller waits for it with :meth:`wait_built` (``plan_hash``)."""
        transfer = TransferSpec.model_validate({**self.spec.transfer.model_dump(by_alias=True), **changes})
        self.spec = self.spec.model_copy(update={"transfer": transfer})
        self.plan = replan(self.plan, self.spec)
        self._publish_files()
        return self.plan

    def restart_engine_agent(self, engine: int) -> AgentProcess:
        """Stop engine ``engine``'s agent (SIGKILL) and start it again, as a kubelet restarts a pod's sidecar."""
        self.engine_agents[engine].stop(kill=True)
        return self._spawn_engine_agent(engine)

    def restart_engine(self, engine: int, *, seed: int = 0, token: str | None = None) -> StartedEngine:
        """Crash engine ``engine`` (SIGKILL) and start a fresh one on the same port, as a pod's engine container
        restarts: its agent keeps running; the fresh engine holds the checkpoint, at new addresses. ``token``: its
        admin key from now on (restarted after a rotation), else the one it had."""
        started = self.harness.restart(engine, self.spec, seed + engine, token=token)
        if started.url != self.engines[engine].url:
            raise RuntimeError(f"engine {engine} came back at {started.url}, not {self.engines[engine].url}")
        self.engines[engine] = started
        return started

    def stop(self, *, wait: bool = True) -> None:
        """Stop the agents, then the engines side by side. ``wait=False`` (leaving the ``with`` block): the engines
        stop in the background (``retire``: a stock server's shutdown mostly waits), for runs that start nothing
        on their ports again."""
        for agent in [*self.agents.values(), *self.engine_agents.values()]:
            agent.stop()
        stops = [engine.stop for engine in self.engines.values()]
        workdir = self.workdir if self._own_workdir else None

        def stop_engines() -> None:
            stop_side_by_side(*stops)
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)

        if wait:
            stop_engines()
        else:
            retire(stop_engines)

    def __enter__(self) -> LoopbackGroup:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop(wait=False)
