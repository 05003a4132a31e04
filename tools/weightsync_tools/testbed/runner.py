"""``weightsync bench``: run a scenario on emulated nodes and compare p2p, broadcast and the link bound.

What runs where (scenario A: 4 trainer nodes -> 2 engines x TP2 on 4 inference nodes; see netns.py for
the picture):

* every **engine** is a reference engine process (``launch_engine``) in its own namespace, one capped link
  per rank, rank r's Mooncake session on link r (``--rank-hosts``); its broadcast member (gloo) uses the
  link of rank 0;
* every **trainer node** runs a real ``weightsync agent`` (sources, replicas in /dev/shm; node 0's agent is
  the coordinator) with ``POD_IP`` set to the node's address; the trainer processes' side (stage the
  full tensors into the replica files, ``publish(v)`` on every rank at once) is this process, through
  :class:`~weightsync_agent.client.trainer.WeightSyncClient` and the agents' HTTP API: a p2p round is the
  coordinator's ``RoundResult``;
* **broadcast** runs in trainer node 0's namespace (:mod:`~weightsync_tools.testbed.broadcast_worker`):
  the project's ``BroadcastSource`` and ``RoundDriver`` over ``broadcast_round_plan(plan)``, gloo.

Rounds alternate between the modes (broadcast, then p2p, per repetition) so that machine load hits
both alike; p2p and broadcast push different weights (seeds 1 and 2), so every round changes every byte.
The round time is ``RoundResult.duration_seconds`` (pause, begin, transfer, verify, commit, resume).
Per round the links' byte counters are read too (what really crossed the busiest link).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from weightsync.api import names
from weightsync.api.token import new_token
from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync.plan import Plan, plan_for
from weightsync_tools.testbed import cpu, netns
from weightsync_tools.testbed.repeat import Metric
from weightsync_tools.testbed.scenario import (
    Layout,
    Link,
    MiB,
    Stats,
    Target,
    bound_seconds,
    broadcast_link_loads,
    busiest,
    engine_node,
    format_rate,
    model_shape,
    p2p_link_loads,
    parse_rate,
    trainer_node,
)

Say = Callable[[str], None]
TEMPLATE = {"spec": {"containers": [{"name": "main"}]}}
P2P_SEED, BROADCAST_SEED = 1, 2
AGENT_PORT = 9470
STORE_PORT = 29471
GATHER_PORT = 9480
GATHER_SOURCE_PORT = 29480  # + the trainer node's index, on the bridge's address
#: Gathers a rank asks for ahead of the tensor it stages (see ``Group._stage_all``).
GATHER_AHEAD = 2

SCENARIOS: dict[str, tuple[Layout, int]] = {"A": (Layout(trainers=4, engines=2, tp=2), 512)}
TARGET_SPEEDUP = 3.5  # p2p at least this much faster than broadcast
TARGET_OVER_BOUND = 1.3  # p2p at most this much slower than the link bound
#: What ``--repeat`` summarizes for scenario A (top-level keys of a run's report).
METRICS: tuple[Metric, ...] = (
    Metric("speedup", "broadcast / p2p", (">=", TARGET_SPEEDUP)),
    Metric("p2p_over_bound", "p2p / link bound", ("<=", TARGET_OVER_BOUND)),
    Metric("p2p_s", "p2p round, s (median of its rounds)"),
    Metric("broadcast_s", "broadcast round, s (median of its rounds)"),
)


@dataclass
class Options:
    scenario: str = "A"
    caps: bool = True
    rate: str | None = None  # per link and direction; the scenario's by default
    rounds: int = 5
    mib: int | None = None  # model size; the scenario's by default
    bucket_mib: int = 64
    #: The p2p plans' bucket, when not ``bucket_mib`` (scenario B: a streamed round drains its last bucket after
    #: the trainer staged it, so its buckets are small; broadcast keeps ``bucket_mib``).
    p2p_bucket_mib: int | None = None
    sweep: list[int] = field(default_factory=lambda: list(range(1, 9)))
    sweep_mib: int = 128
    sweep_rounds: int = 1
    plot: Path | None = None
    layout: Layout | None = None  # override the scenario's (tests)
    timeout_seconds: int = 600
    check: bool = True  # compare every target's bytes with the source's full tensors after the rounds
    #: Trainer shard-group size: before staging a tensor, a rank receives (S - 1)/S of its bytes over its node's
    #: inbound link (the emulated all-gather, ``gather.py``); 1 = the rank holds full tensors (no gather);
    #: None = the scenario's (A: 1, B: 2).
    gather_shards: int | None = None
    #: Every emulated link's MTU (``netns.Testbed.mtu``: what tbf charges per segment).
    mtu: int = netns.DEFAULT_MTU

    @property
    def p2p_bucket(self) -> int:
        """The p2p plans' bucket in MiB."""
        return self.p2p_bucket_mib or self.bucket_mib

    @property
    def shards(self) -> int:
        """The trainer's shard-group size, 1 where the scenario does not gather."""
        return self.gather_shards or 1


# ------------------------------------------------------------------------------------------- the network


class Net:
    """Where nodes live: namespaces of a :class:`~weightsync_tools.testbed.netns.Testbed`, or loopback."""

    def __init__(self, testbed: netns.Testbed | None) -> None:
        self.testbed = testbed

    def address(self, node: str) -> str:
        return self.testbed.links[node].address if self.testbed else "127.0.0.1"

    def wrap(self, namespace: str, env: Mapping[str, str] | None = None) -> tuple[str, ...]:
        if self.testbed is not None:
            return self.testbed.wrap(namespace, env)
        return ("env", *(f"{k}={v}" for k, v in env.items())) if env else ()

    def gateway(self) -> str:
        """The root namespace's address every node reaches (the bridge's), or loopback."""
        return self.testbed.gateway if self.testbed else "127.0.0.1"

    def interface(self, node: str) -> str:
        return self.testbed.links[node].ns_if if self.testbed else "lo"

    def port(self, fixed: int) -> int:
        """A port for a listener: fixed inside a namespace of its own, any free one on loopback."""
        if self.testbed is not None:
            return fixed
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])

    def counters(self) -> dict[str, tuple[int, int]] | None:
        return self.testbed.counters() if self.testbed else None


def build_testbed(layout: Layout, rate_bits: int | None, mtu: int = netns.DEFAULT_MTU) -> netns.Testbed:
    subnet = netns.free_subnet(list(range(16 + os.getpid() % 200, 250)) + list(range(16, 250)))
    namespace_links: dict[str, list[tuple[str, str]]] = {}
    for i in range(layout.trainers):
        node = trainer_node(i)
        namespace_links[node] = [(node, layout.address(node, subnet))]
    for e in range(layout.engines):
        nodes = [engine_node(e, r) for r in range(layout.tp)]
        namespace_links[f"e{e}"] = [(n, layout.address(n, subnet)) for n in nodes]
    return netns.Testbed(namespace_links, subnet, rate_bits, mtu)


# ---------------------------------------------------------------------------------------------- the group


def group_plan(
    layout: Layout,
    engines: int,
    mode: str,
    bucket_mib: int,
    timeout: int,
    planner: str = "balanced",
    *,
    pause: str = "minimal",
    staging: str = "live",
) -> Plan:
    spec = WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": layout.trainers, "template": TEMPLATE},
            "inference": {
                "engines": engines,
                "ranksPerEngine": layout.tp,
                "ranksPerPod": layout.tp,  # the reference engine is one process; its ranks still get a link each
                "adapter": "reference",
                "template": TEMPLATE,
            },
            "transfer": {
                "mode": mode,
                "protocol": "tcp",
                "planner": planner,
                "pause": pause,
                "targetStaging": staging,
                "bucketSizeMiB": bucket_mib,
                "timeoutSeconds": timeout,
            },
        }
    )
    return plan_for(spec, group="bench", namespace="testbed")


class LineReader:
    """Lines of a child's stdout through a queue, so reads can time out."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line)
        self.lines.put("")

    def json(self, timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{what}: no answer within {timeout:.0f} s") from None
            if not line:
                raise RuntimeError(f"{what}: the process exited")
            if line.startswith("{"):
                return dict(json.loads(line))


class Group:
    """Engines, agents and the broadcast sender of one model, on ``net``."""

    def __init__(self, net: Net, layout: Layout, model: dict[str, Any], options: Options, workdir: Path, say: Say):
        self.net, self.layout, self.model, self.options, self.say = net, layout, model, options, say
        self.workdir = workdir
        self.engines: dict[int, Any] = {}
        self.engine_urls: dict[int, str] = {}
        self.agents: dict[int, subprocess.Popen[bytes]] = {}
        self.agent_urls: dict[int, str] = {}
        self.clients: list[Any] = []
        #: The trainer pod of each client (same order), and its gather link when the gather is emulated.
        self.client_pods: list[int] = []
        self.gather_links: list[Any] = []
        #: The gather's processes (each node's source and sink), and each node's sink address.
        self.gather_processes: list[subprocess.Popen[bytes]] = []
        self._gather_address: dict[int, tuple[str, int]] = {}
        self.broadcaster: subprocess.Popen[str] | None = None
        self.broadcast_lines: LineReader | None = None
        self.p2p_plan: Plan | None = None
        self.broadcast_plan: Plan | None = None
        self._full: dict[int, Any] = {}
        self._logs: list[IO[bytes]] = []
        #: The group's credential: engines and agents require it (docs/security.md).
        self.token = new_token()
        #: The p2p plan's planner (``transfer.planner``): scenario B runs the agents with both.
        self.planner = "balanced"
        #: The p2p plan's ``transfer.pause`` and ``targetStaging``: scenario B runs ours with each policy and staged.
        self.pause = "minimal"
        self.staging = "live"

    # --- engines ---------------------------------------------------------------------------------

    def start_engines(self, count: int) -> None:
        from weightsync_testing.reference_engine.launch import launch_engine

        config = {k: v for k, v in self.model.items() if k != "num_layers"}
        timeout = self.options.timeout_seconds

        def launch(e: int) -> Any:
            hosts = [self.net.address(engine_node(e, r)) for r in range(self.layout.tp)]
            gloo = {"GLOO_SOCKET_IFNAME": self.net.interface(engine_node(e, 0))}
            extra = ("--layers", str(self.model["num_layers"]), "--model-config", json.dumps(config),
                     "--rank-hosts", ",".join(hosts), "--transfer-timeout", str(timeout))  # fmt: skip
            return launch_engine(e, self.layout.tp, seed=100 + e, host=hosts[0], extra=extra, timeout=600,
                                 wrap=self.net.wrap(f"e{e}", gloo), token=self.token)  # fmt: skip

        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=min(count, 4)) as pool:
            futures = {e: pool.submit(launch, e) for e in range(count)}
            for e, future in futures.items():
                self.engines[e] = future.result()  # on failure stop() stops those that started
                self.engine_urls[e] = self.engines[e].url
        self.say(f"  {count} engine(s) up in {time.monotonic() - started:.1f} s")

    # --- agents (p2p) ----------------------------------------------------------------------------

    def _p2p_plan(self, engines: int) -> Plan:
        opts = self.options
        return group_plan(self.layout, engines, "p2p", opts.p2p_bucket, opts.timeout_seconds, self.planner,
                          pause=self.pause, staging=self.staging)  # fmt: skip

    def _write_files(self, engines: int, p2p_plan: Plan) -> Path:
        opts = self.options
        self.p2p_plan = p2p_plan
        self.broadcast_plan = group_plan(self.layout, engines, "broadcast", opts.bucket_mib, opts.timeout_seconds)
        (self.workdir / "plan.json").write_text(self.p2p_plan.to_json())
        (self.workdir / "plan-broadcast.json").write_text(self.broadcast_plan.to_json())
        directory = {
            "engines": {str(e): u for e, u in self.engine_urls.items() if e < engines},
            "trainers": {str(p): u for p, u in self.agent_urls.items()},
        }
        (self.workdir / "directory.json").write_text(json.dumps(directory))
        return self.workdir / "plan.json"

    def agent_env(self, pod: int, port: int) -> dict[str, str]:
        return {
            names.ENV_GROUP: "bench",
            names.ENV_NAMESPACE: "testbed",
            names.ENV_ROLE: "trainer",
            names.ENV_POD_INDEX: str(pod),
            names.ENV_RANKS: str(pod),
            names.ENV_PLAN_FILE: str(self.workdir / "plan.json"),
            names.ENV_DIRECTORY_FILE: str(self.workdir / "directory.json"),
            names.ENV_AGENT_PORT: str(port),
            names.ENV_REPLICA_PATH: str(self.workdir / f"replica-{pod}"),
            names.ENV_POD_IP: self.net.address(trainer_node(pod)),
            names.ENV_GROUP_TOKEN: self.token,
            # One tick builds the sources; later ticks would "catch up" engines that a broadcast round moved
            # to another version, in the middle of the benchmark.
            "WEIGHTSYNC_TICK_SECONDS": "86400",
        }

    def start_agents(self, engines: int) -> None:
        from weightsync_agent.client import SidecarPublisher, WeightSyncClient
        from weightsync_agent.rounds.remote import AgentClient, AgentError

        self.stop_agents()
        plan = self._p2p_plan(engines)
        # A trainer rank the plan gives no target (fewer targets than trainer ranks) has nothing to do: no agent.
        ports = {a.source: self.net.port(AGENT_PORT) for a in plan.sources if a.targets}
        self.agent_urls = {p: f"http://{self.net.address(trainer_node(p))}:{ports[p]}" for p in ports}
        self._write_files(engines, plan)
        started = time.monotonic()
        for pod, port in ports.items():
            env = self.agent_env(pod, port)
            log = (self.workdir / f"agent-{pod}.log").open("ab")
            self._logs.append(log)
            command = [*self.net.wrap(trainer_node(pod)), sys.executable, "-m", "weightsync_tools.cli.main", "agent"]
            self.agents[pod] = subprocess.Popen(
                command, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 300
        for pod, url in self.agent_urls.items():
            client = AgentClient(url, timeout=5.0, token=self.token)
            while True:
                if self.agents[pod].poll() is not None:
                    tail = (self.workdir / f"agent-{pod}.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"agent of trainer node {pod} exited:\n{tail}")
                with contextlib.suppress(AgentError):
                    if (client.state().get("sources") or {}).get("built"):
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"agent of trainer node {pod} did not build its sources (see its log)")
                time.sleep(0.3)
        assert self.p2p_plan is not None
        for pod, port in ports.items():
            env = {**self.agent_env(pod, port), "LOCAL_RANK": "0"}
            publisher = SidecarPublisher(self.agent_urls[pod], pod, env[names.ENV_REPLICA_PATH])
            self.clients.append(WeightSyncClient.from_env(env, publisher=publisher, plan=self.p2p_plan))
            self.client_pods.append(pod)
        self.say(f"  {len(ports)} agents built their sources in {time.monotonic() - started:.1f} s")
        if self.options.shards > 1:
            self._start_gather()

    def _start_gather(self) -> None:
        """A gather source (root namespace) and sink (the node's namespace) for every client's trainer node, and
        each client's link to its sink (see ``gather.py``)."""
        from weightsync_tools.testbed.gather import GatherLink

        module = (sys.executable, "-m", "weightsync_tools.testbed.gather")
        for pod in self.client_pods:
            if pod in self._gather_address:
                continue
            source = (self.net.gateway(), self.net.port(GATHER_SOURCE_PORT + pod))
            host, port = self.net.address(trainer_node(pod)), self.net.port(GATHER_PORT)
            for role, command in (
                ("source", [*module, "source", "--host", source[0], "--port", str(source[1])]),
                ("sink", [*self.net.wrap(trainer_node(pod)), *module, "sink", "--host", host, "--port", str(port),
                          "--source", f"{source[0]}:{source[1]}"]),
            ):  # fmt: skip
                process = subprocess.Popen(command, stdout=subprocess.PIPE, start_new_session=True)
                self.gather_processes.append(process)
                assert process.stdout is not None
                if not process.stdout.readline():  # its "gather <role> on ..." line: listening
                    raise RuntimeError(f"the gather {role} of trainer node {pod} did not start")
            self._gather_address[pod] = (host, port)
        self.gather_links = [GatherLink(*self._gather_address[pod]) for pod in self.client_pods]

    def _stage_all(self, index: int, full: Mapping[str, Any], stage: Callable[[str, Any], Any]) -> None:
        """Rank ``index`` stages every tensor its targets need, in bucket order, each once gathered.

        The rank asks for the next :data:`GATHER_AHEAD` tensors' gathers before it stages this one, as FSDP
        prefetches the next all-gather: the gather streams without a gap between tensors (a request waiting
        behind the node's outbound writes would otherwise idle its inbound link once per tensor)."""
        from weightsync_tools.testbed.gather import gathered_bytes

        client = self.clients[index]
        order = client.staging_order()
        if not self.gather_links:
            for name in order:
                stage(name, full[name])
            return
        link, shards = self.gather_links[index], self.options.shards

        def ask(position: int) -> None:
            if position < len(order):
                tensor = full[order[position]]
                link.request(gathered_bytes(tensor.numel() * tensor.element_size(), shards))

        for position in range(GATHER_AHEAD):
            ask(position)
        for position, name in enumerate(order):
            link.wait()
            ask(position + GATHER_AHEAD)
            stage(name, full[name])

    def stop_agents(self) -> None:
        for link in self.gather_links:
            link.close()
        self.gather_links = []
        for client in self.clients:
            client.close()
        self.clients = []
        self.client_pods = []
        for process in self.agents.values():
            _stop(process)
        self.agents = {}

    # --- broadcast sender ------------------------------------------------------------------------

    def start_broadcaster(self, engines: int) -> None:
        self.stop_broadcaster()
        node = trainer_node(0)
        config = {
            "plan_file": str(self.workdir / "plan-broadcast.json"),
            "engines": {str(e): self.engine_urls[e] for e in range(engines)},
            "model": {k: v for k, v in self.model.items()},
            "seed": BROADCAST_SEED,
            "host": self.net.address(node),
            "port": self.net.port(STORE_PORT),
            "receivers": "engine",
            "token": self.token,
        }
        path = self.workdir / "broadcast.json"
        path.write_text(json.dumps(config))
        log = (self.workdir / "broadcast.log").open("ab")
        self._logs.append(log)
        gloo = {"GLOO_SOCKET_IFNAME": self.net.interface(node)}
        command = [*self.net.wrap(node, gloo), sys.executable, "-m", "weightsync_tools.testbed.broadcast_worker",
                   str(path)]  # fmt: skip
        self.broadcaster = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True
        )
        assert self.broadcaster.stdout is not None
        self.broadcast_lines = LineReader(self.broadcaster.stdout)
        try:
            self.broadcast_lines.json(self.options.timeout_seconds, "broadcast sender start")
        except (RuntimeError, TimeoutError) as exc:
            tail = (self.workdir / "broadcast.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{exc}:\n{tail}") from exc

    def stop_broadcaster(self) -> None:
        process, self.broadcaster = self.broadcaster, None
        if process is None:
            return
        with contextlib.suppress(OSError, ValueError):
            assert process.stdin is not None
            process.stdin.write("\n")
            process.stdin.flush()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _stop(process)

    # --- rounds ----------------------------------------------------------------------------------

    def full(self, seed: int) -> dict[str, Any]:
        if seed not in self._full:
            from weightsync_testing.reference_engine.model import full_state

            self._full = {seed: full_state(seed, _model_config(self.model))}  # one model in memory at a time
        full: dict[str, Any] = self._full[seed]
        return full

    def p2p_round(self, version: int) -> Round:
        full = self.full(P2P_SEED)
        for client in self.clients:
            client.stage_many(full)  # the trainer's side, untimed
        before = self.net.counters()
        with ThreadPoolExecutor(max_workers=len(self.clients)) as pool:
            futures = [pool.submit(c.publish, version, check=False) for c in self.clients]
            outcomes = [f.result() for f in futures]
        after = self.net.counters()
        result = outcomes[0].round
        return Round("p2p", version, result.result, result.duration_seconds, result.bytes, result.reason,
                     _delta(before, after))  # fmt: skip

    def staged_p2p_round(self, version: int) -> TimedRound:
        """A p2p round as a trainer sees it: every rank stages (in parallel, as separate processes would), then
        every rank publishes; the time runs from the first staged byte to the last rank's commit."""
        full = self.full(P2P_SEED)
        before, started = self.net.counters(), time.monotonic()
        with ThreadPoolExecutor(max_workers=len(self.clients)) as pool:
            list(pool.map(lambda i: self._stage_all(i, full, self.clients[i].stage), range(len(self.clients))))
            staged = time.monotonic()
            outcomes = list(pool.map(lambda c: c.publish(version, check=False), self.clients))
        return self._timed(version, outcomes, before, started, staged)

    def streamed_p2p_round(self, version: int) -> TimedRound:
        """A streamed p2p round: every rank opens the version's stream and stages into it, in the order its
        buckets need the tensors, while its buckets go out; the time runs from the streams' opening to the
        last rank's commit, and ``stage_s`` is when the last rank finished staging."""
        full = self.full(P2P_SEED)
        before, started = self.net.counters(), time.monotonic()
        staged: list[float] = []

        def one(index: int) -> Any:
            with self.clients[index].stream(version, check=False) as stream:
                self._stage_all(index, full, stream.stage)
                staged.append(time.monotonic())
            return stream.outcome

        with ThreadPoolExecutor(max_workers=len(self.clients)) as pool:
            outcomes = list(pool.map(one, range(len(self.clients))))
        return self._timed(version, outcomes, before, started, max(staged))

    def _timed(
        self, version: int, outcomes: list[Any], before: Counters | None, started: float, staged: float
    ) -> TimedRound:
        """The round the ranks' outcomes report (they all report the coordinator's), timed from ``started``."""
        ended, after = time.monotonic(), self.net.counters()
        result = outcomes[0].round
        done = Round("p2p", version, result.result, result.duration_seconds, result.bytes, result.reason,
                     _delta(before, after), dict(getattr(result, "phases", {}) or {}),
                     getattr(result, "pause_policy", None))  # fmt: skip
        return TimedRound(done, stage_s=staged - started, total_s=ended - started, pause_s=self.pause_seconds())

    def pause_seconds(self) -> float:
        """The longest time an engine did not serve in the last round (the reference engine measures it)."""
        from weightsync_agent.targets.engine_client import EngineClient

        pauses = [
            EngineClient(url, timeout=30, api_key=self.token).status().get("last_pause_seconds")
            for url in self.engine_urls.values()
        ]
        return max((float(p) for p in pauses if p is not None), default=0.0)

    def broadcast_round(self, version: int) -> Round:
        assert self.broadcaster is not None and self.broadcaster.stdin is not None and self.broadcast_lines
        before = self.net.counters()
        self.broadcaster.stdin.write(json.dumps({"version": version}) + "\n")
        self.broadcaster.stdin.flush()
        answer = self.broadcast_lines.json(self.options.timeout_seconds + 60, f"broadcast round {version}")
        after = self.net.counters()
        return Round("broadcast", version, str(answer["result"]), float(answer["durationSeconds"]),
                     int(answer["bytes"]), answer.get("reason"), _delta(before, after))  # fmt: skip

    def check_targets(self, plan: Plan, seed: int) -> list[str]:
        """Targets whose memory does not hold exactly ``full_state(seed)`` cut for them; [] if all do."""
        from weightsync_agent.modes.broadcast.checksums import layout_checksums
        from weightsync_agent.targets.engine_client import EngineClient
        from weightsync_testing.reference_engine.model import quantized_full

        full = quantized_full(self.full(seed), _model_config(self.model))  # what an FP8 target's checkpoint holds
        bucket = plan.transfer.bucket_bytes
        wrong = []
        for engine, rank in plan.layout.all_targets():
            client = EngineClient(self.engine_urls[engine], timeout=120, api_key=self.token)
            expected = layout_checksums(client.manifest(rank), full, bucket)
            if client.checksums(rank, bucket) != expected:
                wrong.append(f"engine {engine} rank {rank}")
        return wrong

    def target_bytes(self, plan: Plan) -> dict[Target, int]:
        from weightsync_agent.targets.engine_client import EngineClient

        return {
            (e, r): EngineClient(self.engine_urls[e], timeout=30, api_key=self.token).manifest(r).total_bytes
            for e, r in plan.layout.all_targets()
        }

    def stop(self) -> None:
        self.stop_broadcaster()
        self.stop_agents()
        for process in self.gather_processes:
            _stop(process)
        self.gather_processes = []
        self._gather_address = {}
        for engine in self.engines.values():
            engine.stop()
        self.engines = {}
        for log in self._logs:
            log.close()
        self._logs = []
        self._full = {}


@dataclass
class Round:
    mode: str
    version: int
    result: str
    seconds: float
    bytes: int
    reason: str | None
    links: dict[Link, int] | None
    #: The coordinator's seconds per phase (p2p ways; empty for broadcast, whose sender reports none).
    phases: dict[str, float] = field(default_factory=dict)
    #: When the coordinator paused the engines (its record's ``pausePolicy``; None for broadcast's sender).
    pause_policy: str | None = None

    def check(self) -> None:
        if self.result != "Succeeded":
            raise RuntimeError(f"{self.mode} round {self.version} {self.result}: {self.reason}")


@dataclass
class TimedRound:
    """A round with the trainer's side: staging time, stage-to-commit time, the engines' pause window."""

    round: Round
    stage_s: float
    total_s: float
    pause_s: float


Counters = dict[str, tuple[int, int]]


def _delta(before: Counters | None, after: Counters | None) -> dict[Link, int] | None:
    if before is None or after is None:
        return None
    return netns.counter_delta(before, after)


def _stop(process: subprocess.Popen[Any]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# ----------------------------------------------------------------------------------------- the scenario


def bounds(layout: Layout, group: Group, plan: Plan, rate_bits: int | None) -> dict[str, Any]:
    """Analytic link loads (payload bytes) of both modes for ``plan``, and the bound where there is a rate."""
    sizes = group.target_bytes(plan)
    p2p = p2p_link_loads({a.source: a.targets for a in plan.sources}, sizes)
    model_bytes = _model_bytes(group.model)
    members = [engine_node(e, 0) for e in range(plan.layout.engines)]  # receivers="engine": rank 0's link
    broadcast = broadcast_link_loads(members, trainer_node(0), model_bytes)
    out: dict[str, Any] = {"model_bytes": model_bytes, "target_bytes": {f"{e}/{r}": b for (e, r), b in sizes.items()}}
    for name, loads in (("p2p", p2p), ("broadcast", broadcast)):
        link, nbytes = busiest(loads)
        out[name] = {
            "busiest_link": f"{link[0]} {link[1]}",
            "busiest_bytes": nbytes,
            "bound_s": None if rate_bits is None else bound_seconds(loads, rate_bits),
        }
    return out


def _model_bytes(model: Mapping[str, Any]) -> int:
    """The trainer's full tensors, in bytes (in the model's dtype)."""
    from weightsync_agent.layout.manifest import ITEMSIZE
    from weightsync_testing.reference_engine.model import full_shapes

    config = _model_config(model)
    total = 0
    for shape in full_shapes(config).values():
        count = 1
        for dim in shape:
            count *= dim
        total += count * ITEMSIZE[config.dtype]
    return total


def _model_config(model: Mapping[str, Any]) -> Any:
    from weightsync_testing.reference_engine.model import ModelConfig

    fields: dict[str, Any] = dict(model)
    return ModelConfig(**fields)


def _measured_links(rounds: list[Round]) -> dict[Link, int] | None:
    """Median bytes per link direction over the rounds, from the link counters (None on loopback)."""
    links = [r.links for r in rounds if r.links]
    if not links:
        return None
    return {k: int(Stats.of(x[k] for x in links).median) for k in links[0]}


def _measured_busiest(rounds: list[Round]) -> dict[str, Any] | None:
    medians = _measured_links(rounds)
    if medians is None:
        return None
    link, nbytes = busiest(medians)
    return {"link": f"{link[0]} {link[1]}", "bytes": nbytes}


def run(options: Options, say: Say) -> dict[str, Any]:
    """Run the scenario; returns the report (``p2p_s``, ``broadcast_s``, ``bound_s``, ...)."""
    if options.scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {options.scenario!r}; known: {sorted(SCENARIOS)}")
    if options.rounds < 1:
        raise ValueError("--rounds must be at least 1")
    layout, default_mib = SCENARIOS[options.scenario]
    layout = options.layout or layout
    mib = options.mib or default_mib
    rate_bits = parse_rate(options.rate or "1gbit") if options.caps else None
    started = time.monotonic()
    max_engines = max([layout.engines, *options.sweep])
    testbed = open_testbed(options, Layout(layout.trainers, max_engines, layout.tp), rate_bits, say)
    workdir = new_workdir()
    report = report_header(options.scenario, layout, options, rate_bits)
    group: Group | None = None
    previous = _exit_on_sigterm()
    try:
        if testbed is not None:
            testbed.create()
            say(f"testbed {testbed.tag}: {len(testbed.links)} node links at {format_rate(rate_bits or 0)} on "
                f"10.231.{testbed.subnet}.0/24")  # fmt: skip
        net = Net(testbed)
        model = model_shape(mib)
        shape = f"{layout.trainers} trainer nodes -> {layout.engines} engines x TP{layout.tp}"
        say(f"scenario {options.scenario}: {shape}, {_model_bytes(model) / MiB:.0f} MiB model, "
            f"{options.rounds} rounds per mode")  # fmt: skip
        group = Group(net, layout, model, options, workdir, say)
        group.start_engines(layout.engines)
        group.start_agents(layout.engines)
        group.start_broadcaster(layout.engines)
        assert group.p2p_plan is not None and group.broadcast_plan is not None
        analytic = bounds(layout, group, group.p2p_plan, rate_bits)
        rounds: dict[str, list[Round]] = {"p2p": [], "broadcast": []}
        version = 0
        wrong: list[str] = []
        window = cpu.Window()
        for rep in range(options.rounds):
            version += 1
            b = group.broadcast_round(version)
            b.check()
            rounds["broadcast"].append(b)
            if rep == 0 and options.check:
                wrong += [f"{w} after broadcast" for w in group.check_targets(group.broadcast_plan, BROADCAST_SEED)]
            version += 1
            p = group.p2p_round(version)
            p.check()
            rounds["p2p"].append(p)
            say(f"  round {rep + 1}/{options.rounds}: broadcast {b.seconds:.2f} s, p2p {p.seconds:.2f} s")
        windows = {"rounds": window.close(report["machine"]["cpus"], caps=options.caps)}
        report["cpu"] = {name: w.as_json() for name, w in windows.items()}
        report["bottleneck"] = cpu.worst(windows)
        say(f"  bottleneck: {windows['rounds'].describe()}")
        if options.check:
            wrong += [f"{w} after p2p" for w in group.check_targets(group.p2p_plan, P2P_SEED)]
        report["model_bytes"] = analytic["model_bytes"]
        report["target_bytes"] = analytic["target_bytes"]
        report["model"] = model
        report["bit_exact"] = not wrong if options.check else None
        if wrong:
            report["not_bit_exact"] = wrong
        for mode in ("p2p", "broadcast"):
            stats = Stats.of(r.seconds for r in rounds[mode])
            report[mode] = {
                **stats.as_json(),
                "rounds_s": [round(r.seconds, 4) for r in rounds[mode]],
                "wire_bytes": rounds[mode][-1].bytes,
                "busiest_link": analytic[mode]["busiest_link"],
                "busiest_link_bytes": analytic[mode]["busiest_bytes"],
                "bound_s": analytic[mode]["bound_s"],
                "measured_busiest_link": _measured_busiest(rounds[mode]),
                "measured_links": {f"{n} {d}": b for (n, d), b in (_measured_links(rounds[mode]) or {}).items()},
            }
        report["p2p_s"] = report["p2p"]["median"]
        report["broadcast_s"] = report["broadcast"]["median"]
        report["bound_s"] = analytic["p2p"]["bound_s"]
        report["speedup"] = report["broadcast_s"] / report["p2p_s"]
        report["p2p_over_bound"] = None if report["bound_s"] is None else report["p2p_s"] / report["bound_s"]
        report["targets"] = {
            "speedup_min": TARGET_SPEEDUP,
            "speedup_met": report["speedup"] >= TARGET_SPEEDUP,
            "p2p_over_bound_max": TARGET_OVER_BOUND,
            "p2p_over_bound_met": None
            if report["p2p_over_bound"] is None
            else report["p2p_over_bound"] <= TARGET_OVER_BOUND,
        }
        group.stop()
        group = None
        if options.sweep:
            report["sweep"] = sweep(net, layout, options, workdir, say, rate_bits)
            if options.plot is not None:
                from weightsync_tools.testbed.plot import plot_sweep

                plot_sweep(report, options.plot)
                report["plot"] = str(options.plot)
    finally:
        tear_down(group, testbed, workdir, previous)
    report["runtime_s"] = round(time.monotonic() - started, 1)
    return report


def open_testbed(options: Options, layout: Layout, rate_bits: int | None, say: Say) -> netns.Testbed | None:
    """The namespaces and capped links for ``layout`` (leftovers of earlier runs removed first), not yet
    created; None on loopback (``--no-caps``)."""
    if not options.caps:
        return None
    netns.check_available()
    removed = netns.cleanup_leftovers()
    if removed:
        say(f"removed leftovers of earlier runs: {', '.join(removed)}")
    return build_testbed(layout, rate_bits, options.mtu)


def new_workdir() -> Path:
    """Where plans, replicas and logs of one run live: /dev/shm where there is one (replicas are memory)."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    return Path(tempfile.mkdtemp(prefix="weightsync-bench-", dir=root))


def report_header(scenario: str, layout: Layout, options: Options, rate_bits: int | None) -> dict[str, Any]:
    """What every scenario's report starts with: the shape, the network and the machine."""
    return {
        "scenario": scenario,
        "layout": {"trainers": layout.trainers, "engines": layout.engines, "tp": layout.tp},
        "caps": options.caps,
        "network": "namespaces, capped links" if options.caps else "loopback, no caps",
        "rate": None if rate_bits is None else format_rate(rate_bits),
        "rate_bits": rate_bits,
        "mtu": options.mtu if options.caps else None,
        "bucket_mib": options.bucket_mib,
        "p2p_bucket_mib": options.p2p_bucket,
        "machine": _machine(),
    }


def tear_down(group: Group | None, testbed: netns.Testbed | None, workdir: Path, previous: Any) -> None:
    """Stop the processes, delete the namespaces and the work directory, restore the SIGTERM handler."""
    if group is not None:
        group.stop()
    if testbed is not None:
        testbed.destroy()
    shutil.rmtree(workdir, ignore_errors=True)
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm() -> Any:
    """SIGTERM unwinds like Ctrl-C (processes stopped, namespaces deleted); returns the old handler."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


def sweep(net: Net, layout: Layout, options: Options, workdir: Path, say: Say, rate_bits: int | None) -> list[Any]:
    """Round time against the number of engines, both modes, smaller model, ``sweep_rounds`` each."""
    model = model_shape(options.sweep_mib)
    say(f"sweep: engines {options.sweep}, {_model_bytes(model) / MiB:.0f} MiB model, "
        f"{options.sweep_rounds} round(s) per mode and point")  # fmt: skip
    group = Group(net, layout, model, options, workdir, say)
    points = []
    try:
        group.start_engines(max(options.sweep))
        version = 0
        for engines in options.sweep:
            group.start_agents(engines)
            group.start_broadcaster(engines)
            assert group.p2p_plan is not None
            analytic = bounds(layout, group, group.p2p_plan, rate_bits)
            times: dict[str, list[float]] = {"p2p": [], "broadcast": []}
            for _ in range(options.sweep_rounds):
                version += 1
                b = group.broadcast_round(version)
                b.check()
                times["broadcast"].append(b.seconds)
                version += 1
                p = group.p2p_round(version)
                p.check()
                times["p2p"].append(p.seconds)
            point = {
                "engines": engines,
                "model_mib": _model_bytes(model) / MiB,
                "p2p_s": Stats.of(times["p2p"]).median,
                "broadcast_s": Stats.of(times["broadcast"]).median,
                "p2p_bound_s": analytic["p2p"]["bound_s"],
                "broadcast_bound_s": analytic["broadcast"]["bound_s"],
            }
            points.append(point)
            say(f"  {engines} engine(s): broadcast {point['broadcast_s']:.2f} s, p2p {point['p2p_s']:.2f} s")
    finally:
        group.stop()
    return points


def _machine() -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpus": len(os.sched_getaffinity(0)), "cpu": model, "load": [round(x, 2) for x in os.getloadavg()]}


# ------------------------------------------------------------------------------------------------ output


def table(report: Mapping[str, Any]) -> str:
    """The human-readable result: one row per mode, the bound, and the ratios against the targets."""
    lay = report["layout"]
    lines = [
        f"# scenario {report['scenario']}: {lay['trainers']} trainer nodes -> {lay['engines']} engines x TP{lay['tp']}"
        f" (one node per engine rank); {report['model_bytes'] / MiB:.0f} MiB model (float32);"
        f" bucket {report['bucket_mib']} MiB; live rounds",
        f"# network: {report['network']}" + (f", {report['rate']} per link and direction" if report["rate"] else "")
        + (f", MTU {report['mtu']}" if report.get("mtu") else "")
        + f"; {report['machine']['cpus']} CPUs ({report['machine']['cpu']}), load {report['machine']['load']}",
        f"{'mode':<34}{'rounds':>7}{'min s':>8}{'median s':>10}{'max s':>8}{'wire MiB':>10}  busiest link (payload)",
    ]  # fmt: skip
    labels = {"p2p": "p2p (agents, Mooncake TCP)", "broadcast": "broadcast (rank 0, gloo)"}
    for mode in ("p2p", "broadcast"):
        row = report[mode]
        busiest_text = f"{row['busiest_link']} {row['busiest_link_bytes'] / MiB:.0f} MiB"
        measured = row.get("measured_busiest_link")
        if measured:
            busiest_text += f" (counted: {measured['link']} {measured['bytes'] / MiB:.0f} MiB)"
        lines.append(
            f"{labels[mode]:<34}{row['n']:>7}{row['min']:>8.3f}{row['median']:>10.3f}{row['max']:>8.3f}"
            f"{row['wire_bytes'] / MiB:>10.1f}  {busiest_text}"
        )
    if report["bound_s"] is not None:
        lines.append(f"{'p2p link bound (busiest / rate)':<34}{'':>7}{'':>8}{report['bound_s']:>10.3f}")
        lines.append(f"{'broadcast link bound':<34}{'':>7}{'':>8}{report['broadcast']['bound_s']:>10.3f}")
    targets = report["targets"]
    text = (
        f"# broadcast / p2p = {report['speedup']:.2f} (target >= {TARGET_SPEEDUP}: "
        f"{'met' if targets['speedup_met'] else 'NOT met'})"
    )
    if report["p2p_over_bound"] is not None:
        text += (
            f"; p2p / bound = {report['p2p_over_bound']:.2f} (target <= {TARGET_OVER_BOUND}: "
            f"{'met' if targets['p2p_over_bound_met'] else 'NOT met'})"
        )
    else:
        text += "; no link bound without caps"
    lines.append(text)
    if report.get("bit_exact") is not None:
        lines.append(f"# bit-exact on every target after broadcast and p2p: {report['bit_exact']}")
    lines += cpu.table_lines(report.get("cpu") or {})
    if report.get("sweep"):
        lines.append("# sweep (time vs engines): engines  p2p s  broadcast s  p2p bound s  broadcast bound s")
        for point in report["sweep"]:
            pb, bb = point["p2p_bound_s"], point["broadcast_bound_s"]
            lines.append(
                f"#   {point['engines']:>2}  {point['p2p_s']:>7.2f}  {point['broadcast_s']:>7.2f}"
                f"  {'-' if pb is None else f'{pb:.2f}':>7}  {'-' if bb is None else f'{bb:.2f}':>7}"
            )
    if report.get("plot"):
        lines.append(f"# plot: {report['plot']}")
    lines.append(f"# runtime {report['runtime_s']:.0f} s")
    return "\n".join(lines)
