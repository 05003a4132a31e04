"""Driving a (local) cluster the way a user does: kubectl, helm, the operator and agents as processes.

Shared by ``weightsync demo`` and the end-to-end tests, so the demo shows exactly what is tested.
Agents run as local processes *bound to their pods* (the pods themselves run on kwok nodes, which have
no container runtime): each gets the environment the operator wrote into the pod's sidecar, with the
downward-API fields resolved as a kubelet would (POD_IP becomes loopback, where its data plane listens).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightsync.api import names
from weightsync.api.v1alpha1 import AGENT_CONTAINER
from weightsync.ports import free_port
from weightsync_tools.localcluster.binaries import Binaries
from weightsync_tools.localcluster.cluster import ClusterState
from weightsync_tools.localcluster.pki import Pki, kubeconfig

if TYPE_CHECKING:  # the agent side pulls in torch: only load it when agents actually start
    from weightsync.api.v1alpha1 import WeightSyncGroupSpec
    from weightsync_agent.client import WeightSyncClient
    from weightsync_testing.engine_harness import EngineHarness
    from weightsync_testing.pod_sandbox import PodSandboxes
    from weightsync_testing.reference_engine.launch import EngineProcess

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "weightsync"


class CommandError(RuntimeError):
    """kubectl or helm exited non-zero; ``program``, ``returncode`` and ``stderr`` say how."""

    def __init__(self, program: str, args: tuple[str, ...], returncode: int, stderr: str) -> None:
        super().__init__(f"{program} {' '.join(args)} failed:\n{stderr}")
        self.program = program
        self.returncode = returncode
        self.stderr = stderr


@dataclass
class Kube:
    """kubectl and helm bound to one kubeconfig."""

    kubeconfig: Path
    binaries: Binaries

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.binaries.kubectl), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and result.returncode != 0:
            raise CommandError("kubectl", args, result.returncode, result.stderr)
        return result

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.binaries.helm), f"--kubeconfig={self.kubeconfig}", *args],
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if check and result.returncode != 0:
            raise CommandError("helm", args, result.returncode, result.stderr)
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60, interval: float = 0.5) -> Any:
    """Poll ``check`` until it returns something truthy; an AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def token_kubeconfig(state: ClusterState, admin: Kube, namespace: str, service_account: str, path: Path) -> Path:
    """A kubeconfig with a ServiceAccount's token: run as that account, so its RBAC is what's tested."""
    token = admin.kubectl("-n", namespace, "create", "token", service_account, "--duration=2h").stdout.strip()
    path.write_text(kubeconfig(Pki(Path(state.directory) / "pki"), state.server, token=token, user=service_account))
    return path


@dataclass
class PodCredentials:
    """What the kubelet gives a pod's agent: a ServiceAccount token *bound to the pod* (a TokenRequest with
    ``boundObjectRef`` kind Pod, name and uid, as for the projected volume), as a kubeconfig per pod.

    The API server then knows which pod a request comes from (``authentication.kubernetes.io/pod-name`` in the
    user's extra), which the chart's admission policy checks, and the token dies with the pod."""

    state: ClusterState
    admin: Kube
    directory: Path

    def __call__(self, pod: dict[str, Any]) -> Path:
        meta = pod["metadata"]
        account = pod["spec"]["serviceAccountName"]
        token = self.admin.kubectl(
            "-n", meta["namespace"], "create", "token", account,
            "--bound-object-kind=Pod", f"--bound-object-name={meta['name']}", f"--bound-object-uid={meta['uid']}",
            "--duration=2h",
        ).stdout.strip()  # fmt: skip
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{meta['name']}.kubeconfig"
        pki = Pki(Path(self.state.directory) / "pki")
        path.write_text(kubeconfig(pki, self.state.server, token=token, user=account))
        return path


class OperatorProcess:
    """``weightsync operator`` as a local process."""

    def __init__(self, kubeconfig_path: Path, log: Path, *, resync_seconds: int = 5, verbose: bool = True) -> None:
        self.verbose = verbose
        self.kubeconfig = kubeconfig_path
        self.log = log
        self.resync_seconds = resync_seconds
        self.metrics_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            names.OPERATOR_ENV_RESYNC_SECONDS: str(self.resync_seconds),
            names.OPERATOR_ENV_AGENT_IMAGE: "ghcr.io/weightsync/weightsync-agent:local",
        }
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "weightsync_tools.cli.main",
                    "operator",
                    *(["--verbose"] if self.verbose else []),
                    "--liveness",
                    f"http://127.0.0.1:{free_port()}/healthz",
                    "--metrics-port",
                    str(self.metrics_port),
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def reconciles(self) -> float:
        """Group reconciles since this process started (its Prometheus counter); 0 while it is starting."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as response:
                text = response.read().decode()
        except OSError:
            return 0.0
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("weightsync_operator_reconciles_total{")
        )


SecretReader = Callable[[str, str, str], str]


def secret_reader(admin: Kube) -> SecretReader:
    """``(namespace, secret, key) -> value``: how a kubelet resolves ``secretKeyRef`` (with the admin's rights:
    the agents' own ServiceAccount may not read Secrets)."""

    def read(namespace: str, name: str, key: str) -> str:
        data = admin.json("-n", namespace, "get", "secret", name).get("data") or {}
        return base64.b64decode(data[key]).decode()

    return read


def agent_env(pod: dict[str, Any], secrets: SecretReader | None = None, pod_ip: str | None = None) -> dict[str, str]:
    """The environment of a pod's agent sidecar, resolved as a kubelet would: on loopback (``pod_ip`` None) with a
    free local port; in the pod's own network namespace (``weightsync_testing.pod_sandbox``) at ``pod_ip`` with the
    spec's port."""
    sidecar = next(c for c in pod["spec"]["initContainers"] if c["name"] == AGENT_CONTAINER)
    env: dict[str, str] = {}
    for item in sidecar.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        secret = item.get("valueFrom", {}).get("secretKeyRef")
        if secret is not None:
            if secrets is None:
                raise ValueError(f"{item['name']} comes from Secret {secret.get('name')}: pass a secret reader")
            env[item["name"]] = secrets(pod["metadata"]["namespace"], secret["name"], secret["key"])
            continue
        field = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if field == "metadata.name":
            env[item["name"]] = pod["metadata"]["name"]
        elif field == "metadata.namespace":
            env[item["name"]] = pod["metadata"]["namespace"]
        elif field == "status.podIP":
            env[item["name"]] = pod_ip or "127.0.0.1"
    if pod_ip is None:
        env[names.ENV_AGENT_PORT] = str(free_port())
    return env


def engine_token(pod: dict[str, Any], secrets: SecretReader | None) -> str | None:
    """The group token the engine container (the first container) gets from its ``secretKeyRef``, as a kubelet
    resolves it when the container starts (and never again while it runs)."""
    for item in pod["spec"]["containers"][0].get("env") or []:
        ref = (item.get("valueFrom") or {}).get("secretKeyRef")
        if item["name"] == names.ENV_GROUP_TOKEN and ref is not None and secrets is not None:
            return secrets(pod["metadata"]["namespace"], ref["name"], ref["key"])
    return None


def write_secret_volume(pod: dict[str, Any], mount_path: str, folder: Path, secrets: SecretReader) -> None:
    """What a kubelet keeps in a Secret volume: the agent container's volume mounted at ``mount_path``, one file
    per key (``token``, ``previous``), each renamed in at once; a key the Secret dropped disappears."""
    sidecar = next(c for c in pod["spec"]["initContainers"] if c["name"] == AGENT_CONTAINER)
    mount = next(m for m in sidecar.get("volumeMounts") or [] if m["mountPath"] == mount_path)
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    secret = volume["secret"]["secretName"]
    folder.mkdir(parents=True, exist_ok=True)
    for key in (names.SECRET_TOKEN_KEY, names.SECRET_PREVIOUS_KEY):
        path = folder / key
        try:
            value = secrets(pod["metadata"]["namespace"], secret, key)
        except KeyError:
            path.unlink(missing_ok=True)
            continue
        tmp = folder / f".{key}.tmp"
        tmp.write_text(value)
        os.replace(tmp, path)


class Agents:
    """What kubelets would run for a group's pods, as local processes stopped together.

    Every pod gets its agent (``weightsync agent`` bound to the pod, with a token of the group's agent
    ServiceAccount bound to that pod: ``credentials``, e.g. :class:`PodCredentials`); the first pod of each
    engine also gets its engine's processes, whose URL the
    agent advertises: a reference engine, or what ``engines`` starts for the group's ``spec`` (stock
    SGLang servers: ``weightsync_testing.engine_harness``). Trainer code is the caller: :meth:`client`
    gives a pod's trainer-side client. ``secrets`` reads the group's Secret as a kubelet would: into each
    agent's Secret volume (a local folder, refreshed by :meth:`sync_credentials`, as kubelets do about once a
    minute) and, for the engine container's ``secretKeyRef``, once when the engine starts.
    """

    def __init__(
        self,
        credentials: Callable[[dict[str, Any]], Path],
        logs: Path,
        *,
        staged: bool = False,
        engines: tuple[EngineHarness, WeightSyncGroupSpec] | None = None,
        secrets: SecretReader | None = None,
        network: PodSandboxes | None = None,
        engine_agent_env: Mapping[str, str] | None = None,
    ) -> None:
        self.credentials = credentials
        #: Pods as network namespaces: each agent runs in its pod's, at the pod's IP, and engines are the pods' own
        #: containers (``weightsync_testing.container_spec``), not started here.
        self.network = network
        #: What the engine pods' agent image has in its environment where no harness starts the engine (the engine's
        #: interpreter, ``WEIGHTSYNC_ENGINE_PYTHON``, for tracing with its own code).
        self.engine_agent_env = dict(engine_agent_env or {})
        self.secrets = secrets
        self.logs = logs
        self.staged = staged
        self.harness = engines
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.engines: dict[str, EngineProcess] = {}  # reference engines, by pod
        self.harnessed: dict[str, Callable[[], None]] = {}  # how to stop each pod's harness-started engine
        self.envs: dict[str, dict[str, str]] = {}
        #: The admin key each engine started with (its container's ``secretKeyRef``, resolved once), by pod.
        self.engine_tokens: dict[str, str] = {}
        #: Pods whose agent reads the group's Secret from a volume: (pod, mount path, the local folder).
        self.mounted: dict[str, tuple[dict[str, Any], str, Path]] = {}

    def sync_credentials(self) -> None:
        """A kubelet's periodic refresh of every running agent's Secret volume (about a minute in a cluster; here
        when called): the files take the Secret's current keys."""
        assert self.secrets is not None
        for name, (pod, mount_path, folder) in list(self.mounted.items()):
            if name in self.processes:
                write_secret_volume(pod, mount_path, folder, self.secrets)

    def start(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        self.stop(name)
        pod_ip = pod["status"]["podIP"] if self.network is not None else None
        env = agent_env(pod, self.secrets, pod_ip)
        mounted = env.get(names.ENV_CREDENTIALS_DIR)
        if mounted:
            # The Secret volume, as the kubelet mounts it: a folder of this pod's, kept fresh by sync_credentials.
            if self.secrets is None:
                raise ValueError(f"{name} mounts the group's Secret: pass a secret reader")
            folder = self.logs / "credentials" / name
            write_secret_volume(pod, mounted, folder, self.secrets)
            env[names.ENV_CREDENTIALS_DIR] = str(folder)
            self.mounted[name] = (pod, mounted, folder)
        token = engine_token(pod, self.secrets)
        if token is not None:
            self.engine_tokens[name] = token
        if env.get(names.ENV_ROLE) == "engine":
            env = {**self.engine_agent_env, **env}
        if self.network is None and env.get(names.ENV_ROLE) == "engine" and env.get(names.ENV_POD_INDEX) == "0":
            index = int(env[names.ENV_ENGINE_INDEX])
            if self.harness is not None:
                harness, spec = self.harness
                started = harness.start(index, spec, seed=index, token=token)
                self.harnessed[name] = started.stop
                env[names.ENV_ENGINE_URL] = started.url
                env.update(started.agent_env)
            else:
                from weightsync_testing.reference_engine.launch import launch_engine

                ranks = len(env[names.ENV_RANKS].split(","))
                engine = launch_engine(index, ranks, seed=index, staged=self.staged, token=token)
                self.engines[name] = engine
                env[names.ENV_ENGINE_URL] = engine.url
        self.envs[name] = env
        kubeconfig_path = self.credentials(pod)
        # Agents on loopback are bound to pods whose podIP is kwok's; in the pods' namespaces they are at it.
        peers = {names.ENV_LOOPBACK_PEERS: "1"} if self.network is None else {}
        wrap = self.network.wrap(name) if self.network is not None else []
        with open(self.logs / f"{name}.log", "ab") as out:
            self.processes[name] = subprocess.Popen(
                [*wrap, sys.executable, "-m", "weightsync_tools.cli.main", "agent"],
                env={**os.environ, **env, "KUBECONFIG": str(kubeconfig_path), "WEIGHTSYNC_TICK_SECONDS": "1", **peers},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def client(self, name: str, *, timeout: float = 60.0) -> WeightSyncClient:
        """Trainer code's client in pod ``name`` (it attaches to the replicas its agent built, and publishes with the
        pod-local token the agent leaves there: trainer code never holds the group's credential)."""
        from weightsync_agent.client import WeightSyncClient

        env = {k: v for k, v in self.envs[name].items() if k not in (names.ENV_GROUP_TOKEN, names.ENV_CREDENTIALS_DIR)}
        return WeightSyncClient.from_env(env, sidecar_timeout=timeout)

    def stop(self, name: str) -> None:
        self.mounted.pop(name, None)
        process = self.processes.pop(name, None)
        if process and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        engine = self.engines.pop(name, None)
        if engine is not None:
            engine.stop()
        stop_harnessed = self.harnessed.pop(name, None)
        if stop_harnessed is not None:
            stop_harnessed()

    def stop_all(self) -> None:
        for name in list(self.processes):
            self.stop(name)

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def group_pods(admin: Kube, namespace: str, group: str) -> dict[str, dict[str, Any]]:
    """The group's pods that are not being deleted, by name."""
    items = admin.json("-n", namespace, "get", "pods", "-l", f"{names.LABEL_GROUP}={group}")["items"]
    return {p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")}


def group_picture(admin: Kube, namespace: str, group: str, events: int = 15) -> str:
    """What a test that waited in vain for a group's pods needs to know, in a few lines: each pod's phase, node and
    IP, the group's status, and the namespace's latest events (a failure names the step, this names the cause)."""
    lines: list[str] = []
    try:
        for name, pod in sorted(group_pods(admin, namespace, group).items()):
            status = pod.get("status") or {}
            lines.append(f"pod {name}: {status.get('phase')} on {pod['spec'].get('nodeName') or '(unscheduled)'}"
                         f" ip={status.get('podIP')}")  # fmt: skip
        group_status = admin.json("-n", namespace, "get", "wsg", group).get("status") or {}
        lines.append(f"group status: {json.dumps(group_status)[:1500]}")
        listed = admin.json("-n", namespace, "get", "events", "--sort-by=.lastTimestamp")["items"][-events:]
        lines += [f"event {e.get('reason')} {e['involvedObject'].get('name')}: {e.get('message')}" for e in listed]
    except (CommandError, subprocess.TimeoutExpired) as error:
        lines.append(f"(the API server did not answer: {error})")
    return "\n".join(lines)


def install_chart(admin: Kube, *, release: str = "weightsync", namespace: str = "weightsync-system") -> None:
    admin.helm(
        "install", release, str(CHART), "--namespace", namespace, "--create-namespace", "--wait", "--timeout", "2m"
    )
