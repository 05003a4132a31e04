"""``weightsync demo``: the main job on one machine, on the embedded local cluster.

Starts a real control plane (built from Go modules on first use), installs the Helm chart, runs the
operator with the chart's ServiceAccount, applies the example group, binds agents (and reference
engines) to its pods, waits for the group to be Ready, trains the reference model a few steps with a
verified sync round after each (the status shows version, duration and bytes), then scales the engines:
a replan, and the joiners catch up from the replicas. Everything is torn down at the end unless ``keep``
is set.

``engine`` ``sglang`` or ``vllm`` runs that stock engine instead (``demo_engines``): its pinned venv (built the
first time) and a tiny Llama, its example group shrunk to one CPU machine, a real server bound to the engine pod;
the trainer's weights of each step are published and verified, and the server's greedy generation is compared
with HF ``transformers``' on those weights. The scale step is skipped there: see :data:`STOCK_SCALE_SKIPPED`.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from rich.console import Console

from weightsync.api import names
from weightsync.api.load import parse_group
from weightsync.api.v1alpha1 import WeightSyncGroup
from weightsync.plan import Plan
from weightsync_operator.builders.desired import expected_pod_names
from weightsync_tools.cli.demo_steps import check_data_plane, cleanup, step
from weightsync_tools.cli.plan_view import render_plan
from weightsync_tools.localcluster import binaries as binaries_mod
from weightsync_tools.localcluster.cluster import LocalCluster
from weightsync_tools.localcluster.demo_engines import (
    NEW_TOKENS,
    PROMPTS,
    STOCK,
    StockEngine,
    greedy,
    harness,
    server_footprint,
    shrunk,
)
from weightsync_tools.localcluster.session import (
    REPO,
    Agents,
    Kube,
    OperatorProcess,
    PodCredentials,
    group_pods,
    install_chart,
    secret_reader,
    token_kubeconfig,
    wait_for,
)

if TYPE_CHECKING:
    from weightsync_testing.engine_harness import EngineHarness

NAMESPACE = "demo"
SYSTEM_NS = "weightsync-system"
DEFAULT_EXAMPLE = REPO / "examples" / "tcp-group.yaml"
#: Why a stock engine's demo does not scale out: each joiner is one more real server (its start, its memory: the
#: numbers are this run's) and one more trace, for what the reference engine's demo already shows.
STOCK_SCALE_SKIPPED = (
    "scale-out skipped for stock engines: each joiner is another server (~{start:.0f} s to start and ~{gib:.1f} GiB "
    "here); --engine reference shows the replan and the joiners' catch-up"
)


@contextlib.contextmanager
def _step(console: Console, title: str) -> Iterator[None]:
    """A step shown with a spinner, then a tick; if it fails, the failure names it (``demo_steps.step``)."""
    started = time.monotonic()
    with step(title), console.status(f"[bold]{title}[/]…"):
        yield
    console.print(f"[green]✓[/] {title} [dim]({time.monotonic() - started:.1f} s)[/]")


def _show_groups(admin: Kube, console: Console) -> None:
    console.print(f"[bold]$ kubectl -n {NAMESPACE} get wsg[/]")
    console.print(admin.kubectl("-n", NAMESPACE, "get", "wsg").stdout.rstrip(), highlight=False, markup=False)


def _stored_plan(admin: Kube, group: str) -> Plan:
    cm = admin.json("-n", NAMESPACE, "get", "configmap", names.plan_config_map(group))
    return Plan.from_json(cm["data"][names.PLAN_KEY])


def run_demo(
    directory: Path,
    *,
    example: Path | None = None,
    scale_to: int,
    keep: bool,
    console: Console,
    engine: str = "reference",
) -> int:
    """The demo; a failure raises :class:`~weightsync_tools.cli.demo_steps.StepError` naming its step.

    ``example``: the group (default: ``examples/tcp-group.yaml``, or the stock ``engine``'s example, shrunk)."""
    stock = STOCK.get(engine)
    example = example or (stock.example if stock else DEFAULT_EXAMPLE)
    with step(f"read {example}"):
        group_obj: dict[str, Any] = yaml.safe_load(example.read_text())
        group_obj = shrunk(group_obj) if stock else group_obj
        group_obj["metadata"]["namespace"] = NAMESPACE
        group = group_obj["metadata"]["name"]
    check_data_plane()
    if stock:
        python, model_dir = _prepare_stock(stock, console)

    with _step(console, "control-plane binaries (first run builds them from Go modules: ~12 min)"):
        found = binaries_mod.ensure(quiet=True)
    with step(f"clear the previous demo cluster in {directory}"):
        if directory.exists():
            LocalCluster(directory, found).down()
            shutil.rmtree(directory)
    local = LocalCluster(directory, found)
    operator: OperatorProcess | None = None
    agents: Agents | None = None
    failure: BaseException | None = None
    try:
        with _step(console, "local cluster: etcd, kube-apiserver, controller-manager, scheduler, 4 kwok GPU nodes"):
            state = local.up(nodes=4)
        admin = Kube(state.kubeconfig, found)
        with _step(console, "helm install weightsync charts/weightsync"):
            install_chart(admin, namespace=SYSTEM_NS)
        with _step(console, "operator running as the chart's ServiceAccount"):
            deployment = admin.json("-n", SYSTEM_NS, "get", "deployment", "weightsync")
            account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
            operator_config = token_kubeconfig(state, admin, SYSTEM_NS, account, directory / "operator.kubeconfig")
            operator = OperatorProcess(operator_config, directory / "logs" / "operator.log")
            operator.start()
        with _step(
            console, f"kubectl apply -f {example.relative_to(REPO) if example.is_relative_to(REPO) else example}"
        ):
            admin.kubectl("create", "namespace", NAMESPACE)
            admin.kubectl("apply", "-f", "-", input=yaml.safe_dump(group_obj))
            wait_for("the group's pods", lambda: len(group_pods(admin, NAMESPACE, group)) > 0)
        with _step(console, "agents bound to their pods report ready"):
            wait_for(
                "the agents' ServiceAccount",
                lambda: (
                    admin.kubectl(
                        "-n", NAMESPACE, "get", "sa", names.agent_service_account(group), check=False
                    ).returncode
                    == 0
                ),
            )
            credentials = PodCredentials(state, admin, directory / "agent-kubeconfigs")
            staged = group_obj["spec"].get("transfer", {}).get("targetStaging") == "staged"
            servers = None
            if stock:  # the engine pod's "engine container": a real server, started with its agent
                spec = parse_group(admin.json("-n", NAMESPACE, "get", "wsg", group)).spec
                servers = (harness(stock, python, model_dir, directory / "engines"), spec)
            agents = Agents(
                credentials, directory / "logs", staged=staged, engines=servers, secrets=secret_reader(admin)
            )
            wait_for("every pod", lambda: _all_pods_there(admin, group, group_obj))
            for pod in group_pods(admin, NAMESPACE, group).values():
                agents.start(pod)
            # A stock engine's agent first traces the model with the engine's own code (its venv's torch).
            wait_for("the group to be Ready", lambda: _phase(admin, group) == "Ready", timeout=240 if stock else 120)
        with step("show the group and its plan"):
            _show_groups(admin, console)
            render_plan(_stored_plan(admin, group), console)
            trainers = sorted(n for n, p in group_pods(admin, NAMESPACE, group).items() if _role(p) == "trainer")
        training = (
            f"publish the trainer's weights of {SYNC_STEPS} steps into {stock.title}, a verified round each"
            if stock
            else f"train the reference model {SYNC_STEPS} steps, sync after each (trainer rank 0 coordinates)"
        )
        with _step(console, training):
            if stock:
                full = _publish_steps(agents, trainers, model_dir, SYNC_STEPS, console)
            else:
                full = _train_and_sync(agents, trainers, SYNC_STEPS, console)
            wait_for(
                f"the status to show version {SYNC_STEPS} everywhere",
                lambda: (
                    (s := _status(admin, group)).get("weightVersion") == SYNC_STEPS
                    and (s.get("lastSync") or {}).get("version") == SYNC_STEPS
                    and s.get("phase") == "Ready"
                ),
            )
        with step("show the group's status"):
            _show_groups(admin, console)
            _show_last_sync(admin, group, console)
        if stock:
            assert servers is not None
            _generates_like_hf(stock, servers[0], python, model_dir, full, directory / "hf-reference", console)
            start_s, gib = server_footprint(servers[0], 0)
            console.print(f"[yellow]{STOCK_SCALE_SKIPPED.format(start=start_s, gib=gib)}[/]")
        else:
            _scale_out(admin, agents, group, group_obj, scale_to, full, console)
        if keep:
            console.print(
                f"\n[bold]kept running.[/] export KUBECONFIG={state.kubeconfig}\n"
                f"stop with: weightsync cluster down --dir {directory}"
            )
            operator = agents = None  # they run on in their own sessions
        return 0
    except BaseException as exc:
        failure = exc
        exc.add_note(f"logs of the cluster, the operator and the agents: {directory}")
        raise
    finally:
        with cleanup("tear down the demo cluster", failure):
            if agents:
                agents.stop_all()
            if operator:
                operator.stop()
            if not keep:
                local.down()


def _scale_out(
    admin: Kube,
    agents: Agents,
    group: str,
    group_obj: dict[str, Any],
    scale_to: int,
    full: dict[str, Any],
    console: Console,
) -> None:
    """Scale the engines: a replan, new pods with their agents, the joiners catch up from the replicas."""
    with _step(console, f"scale inference.engines to {scale_to}: replan, new pods, agents ready"):
        admin.kubectl(
            "-n",
            NAMESPACE,
            "patch",
            "wsg",
            group,
            "--type=merge",
            "-p",
            f'{{"spec":{{"inference":{{"engines":{scale_to}}}}}}}',
        )
        wait_for("the new plan", lambda: _stored_plan(admin, group).layout.engines == scale_to)
        group_obj["spec"]["inference"]["engines"] = scale_to
        wait_for("the new pods", lambda: _all_pods_there(admin, group, group_obj))
        for name, pod in group_pods(admin, NAMESPACE, group).items():
            if name not in agents.processes:
                agents.start(pod)
        wait_for("the group to be Ready again", lambda: _phase(admin, group) == "Ready", timeout=120)
    with _step(console, f"joining engines catch up to version {SYNC_STEPS} from the replicas"):
        wait_for(
            "every engine to hold the committed version",
            lambda: _status(admin, group).get("weightVersion") == SYNC_STEPS,
            timeout=120,
        )
        from weightsync_tools.cli.demo_local import max_logit_diff

        diff = max_logit_diff(agents.engines.values(), full)
    with step("show the new plan"):
        console.print(f"  every engine serves the trainer's weights: max |logit diff| {diff:.1e}")
        plan = _stored_plan(admin, group)
        _show_groups(admin, console)
        render_plan(plan, console)
        console.print(f"replan moved {plan.moved_targets} existing target(s); revision {plan.revision}")


SYNC_STEPS = 3


def _role(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["labels"].get(names.LABEL_ROLE, ""))


def _status(admin: Kube, group: str) -> dict[str, Any]:
    return admin.json("-n", NAMESPACE, "get", "wsg", group).get("status") or {}


def _train_and_sync(agents: Agents, trainers: list[str], steps: int, console: Console) -> dict[str, Any]:
    """Trainer code in every trainer pod: a real SGD step of the reference model, stage, publish."""
    from weightsync_testing.reference_engine.model import full_state
    from weightsync_tools.cli.demo_local import max_logit_diff, publish_all, train_step

    clients = [agents.client(name) for name in trainers]
    full = full_state(seed=0)
    try:
        for version in range(1, steps + 1):
            full, loss = train_step(full, version)
            outcomes = publish_all(clients, full, version)
            summary = outcomes[0].summary() if outcomes[0] is not None else "no result"
            if not all(o is not None and o.ok for o in outcomes):
                raise RuntimeError(f"sync of version {version} failed: {summary}")
            console.print(f"  step {version}: loss {loss:.4f}; {summary}")
    finally:
        for client in clients:
            client.close()
    diff = max_logit_diff(agents.engines.values(), full)
    console.print(f"  engines serve the trainer's weights: max |logit diff| {diff:.1e}")
    return full


def _prepare_stock(engine: StockEngine, console: Console) -> tuple[Path, Path]:
    """The engine's venv (built the first time: the step's title says what that costs) and its tiny Llama."""
    # The build's own progress lines (engine_env) print above the spinner; a cached venv returns at once.
    with _step(console, f"{engine.title} venv (the first run builds it: {engine.first_build}; cached)"):
        python = engine.env.python()  # $WEIGHTSYNC_<NAME>_PYTHON, else the cached venv (built if missing)
    with _step(console, f"a tiny Llama for {engine.title}, made with its transformers (once; cached)"):
        from weightsync_testing.sglang_models import ensure_tiny_model

        model_dir = ensure_tiny_model(python, "llama", seed=0, dtype="float32", head_dim=engine.head_dim)
    console.print(f"  [dim]{python}\n  {model_dir}[/]")
    return python, model_dir


def _publish_steps(
    agents: Agents, trainers: list[str], model_dir: Path, steps: int, console: Console
) -> dict[str, Any]:
    """Trainer code in every trainer pod: stage the weights of each step, publish them; returns the last.

    The weights of step ``v`` are the checkpoint moved by a perturbation seeded with ``v``
    (``sglang_models.trained_state``, what the engine tiers publish): this process has no HF model to train the
    Llama with, and what the demo shows is that whatever the trainer holds is what the engine serves."""
    from weightsync_testing.sglang_models import trained_state
    from weightsync_tools.cli.demo_local import publish_all

    clients = [agents.client(name, timeout=120) for name in trainers]
    full: dict[str, Any] = {}
    try:
        for version in range(1, steps + 1):
            full = trained_state(model_dir, version)
            outcomes = publish_all(clients, full, version)
            summary = outcomes[0].summary() if outcomes[0] is not None else "no result"
            if not all(o is not None and o.ok for o in outcomes):
                raise RuntimeError(f"sync of version {version} failed: {summary}")
            console.print(f"  step {version}: checkpoint + perturbation seeded {version}, staged; {summary}")
    finally:
        for client in clients:
            client.close()
    return full


def _generates_like_hf(
    engine: StockEngine,
    servers: EngineHarness,
    python: Path,
    model_dir: Path,
    full: dict[str, Any],
    scratch: Path,
    console: Console,
) -> None:
    """The engine's greedy tokens equal HF ``transformers``' forward of the trainer's last weights (run in the
    engine's venv: the project's has no transformers)."""
    title = f"{engine.title} generates what HF transformers generates with the trainer's weights"
    with _step(console, title):
        from weightsync_testing.sglang_models import hf_greedy, with_weights

        reference = hf_greedy(python, with_weights(model_dir, full, scratch), PROMPTS, NEW_TOKENS)
        expected = [r["output_ids"] for r in reference]
        served = greedy(servers, 0, PROMPTS, NEW_TOKENS)
        if served != expected:
            raise RuntimeError(f"{engine.title} generated {served}, HF transformers {expected} (prompts {PROMPTS})")
    for prompt, tokens in zip(PROMPTS, served, strict=True):
        console.print(f"  prompt {list(prompt)} → {tokens} (both)")


def _show_last_sync(admin: Kube, group: str, console: Console) -> None:
    last = _status(admin, group).get("lastSync") or {}
    console.print(
        f"  status.lastSync: version {last.get('version')} {last.get('result')} in {last.get('durationSeconds')} s, "
        f"{last.get('bytes')} bytes"
    )


def _phase(admin: Kube, group: str) -> str | None:
    status: dict[str, Any] = admin.json("-n", NAMESPACE, "get", "wsg", group).get("status") or {}
    return status.get("phase")


def _all_pods_there(admin: Kube, group: str, obj: dict[str, Any]) -> bool:
    expected = set(expected_pod_names(WeightSyncGroup.model_validate(obj)))
    return set(group_pods(admin, NAMESPACE, group)) == expected
