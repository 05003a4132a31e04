"""Offline checks of the Helm chart: lint, render, schema-validate, and assert on the rendered objects.

No cluster is used: `helm lint --strict`, `helm template` and `helm install --dry-run=client` only.
Rendered objects are validated with kubernetes-validate --strict (the Kubernetes OpenAPI schemas, rejecting
unknown fields) against the newest bundled version and the oldest the chart supports (kubeVersion >=1.30).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from weightsync.api import names
from weightsync.api.crd import render_crd
from weightsync_operator.config import OperatorConfig
from weightsync_tools.cli.main import app

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "weightsync"
RELEASE = "ws"
NAMESPACE = "weightsync-system"
FULLNAME = "ws-weightsync"
CRD_FILE = CHART / "crds" / "weightsync.io_weightsyncgroups.yaml"
#: Kubernetes versions to validate against: the chart's minimum and the newest schema bundled.
KUBE_VERSIONS = ("1.30", "1.37")
#: Kinds whose schemas kubernetes-validate does not ship (CRD-defined); excluded explicitly, by name.
NOT_IN_KUBERNETES_SCHEMAS = {("monitoring.coreos.com/v1", "ServiceMonitor")}

# ---------------------------------------------------------------------------------------------------
# The operator's RBAC, as (apiGroup, resource, verb) triples. Must match _helpers.tpl exactly: a verb,
# resource or group added there (or here) fails the test, on purpose.
# ---------------------------------------------------------------------------------------------------


def _triples(group: str, resources: list[str], verbs: list[str]) -> set[tuple[str, str, str]]:
    return {(group, r, v) for r in resources for v in verbs}


CLUSTER_SCOPED_RULES = _triples("apiextensions.k8s.io", ["customresourcedefinitions"], ["list", "watch"]) | _triples(
    "", ["namespaces"], ["list", "watch"]
)
# Mirrors operator/weightsync_operator/rbac.md.
NAMESPACED_RULES = (
    _triples("", ["events"], ["create"])
    | _triples("weightsync.io", ["weightsyncgroups"], ["list", "watch", "patch"])
    | _triples("weightsync.io", ["weightsyncgroups/status"], ["patch"])
    | _triples("", ["pods"], ["get", "list", "watch", "create", "delete", "patch"])
    | _triples("", ["pods/status"], ["get", "patch"])
    | _triples("", ["configmaps"], ["get", "list", "watch", "create", "patch"])
    | _triples("", ["services", "serviceaccounts"], ["get", "create", "patch"])
    | _triples("", ["secrets"], ["get", "create", "patch"])
    | _triples("networking.k8s.io", ["networkpolicies"], ["get", "create", "patch", "delete"])
    | _triples("rbac.authorization.k8s.io", ["roles", "rolebindings"], ["get", "create", "patch"])
)

HARDENED_CONTAINER = {
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}

# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------


def _helm(helm_bin: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm_bin, *args], capture_output=True, text=True, env=env, timeout=60, check=False)


class Renderer:
    """``render(*helm_args)`` -> rendered objects. Cached: each value set is rendered once per module."""

    def __init__(self, helm_bin: str, env: dict[str, str]) -> None:
        self._helm_bin, self._env = helm_bin, env

    @cache  # noqa: B019 - one instance per module, freed with it
    def raw(self, *args: str) -> str:
        proc = _helm(self._helm_bin, self._env, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)
        assert proc.returncode == 0, f"helm template {' '.join(args)} failed:\n{proc.stderr}"
        return proc.stdout

    def __call__(self, *args: str) -> list[dict[str, Any]]:
        return [d for d in yaml.safe_load_all(self.raw(*args)) if d]


@pytest.fixture(scope="module")
def render(helm_bin: str, helm_env: dict[str, str]) -> Renderer:
    return Renderer(helm_bin, helm_env)


def _by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = _by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def _rule_triples(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    out: set[tuple[str, str, str]] = set()
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, f"unexpected rule fields: {rule}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    out.add((group, resource, verb))
    return out


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield str(key)
            yield from _strings(value)
    elif isinstance(node, list):
        for item in node:
            yield from _strings(item)
    elif isinstance(node, str):
        yield node


def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    containers = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


NS_ARGS = ("--set", "watchNamespaces={team-a,team-b}")
SM_ARGS = (
    "--set",
    "metrics.serviceMonitor.enabled=true",
    "--set",
    "metrics.serviceMonitor.labels.release=kps",
)
VALUE_SETS = {"default": (), "namespaced": NS_ARGS, "servicemonitor": SM_ARGS, "both": NS_ARGS + SM_ARGS}

# ---------------------------------------------------------------------------------------------------
# lint / render / validate
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [(), NS_ARGS + SM_ARGS], ids=["default", "all-features"])
def test_helm_lint_strict(helm_bin: str, helm_env: dict[str, str], args: tuple[str, ...]) -> None:
    proc = _helm(helm_bin, helm_env, "lint", "--strict", str(CHART), *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values", VALUE_SETS, ids=list(VALUE_SETS))
def test_rendered_objects_pass_kubernetes_validate_strict(render: Renderer, values: str, kube_version: str) -> None:
    docs = render(*VALUE_SETS[values])
    skipped = []
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in NOT_IN_KUBERNETES_SCHEMAS:
            skipped.append(doc["kind"])
            continue
        kubernetes_validate.validate(doc, kube_version, strict=True)  # raises on any error
    assert skipped == (["ServiceMonitor"] if "metrics.serviceMonitor.enabled=true" in VALUE_SETS[values] else [])


def test_kubernetes_validate_cli_strict_on_rendered_output(render: Renderer, tmp_path: Path) -> None:
    """The same check through the `kubernetes-validate --strict` CLI, on the whole default render."""
    out = tmp_path / "rendered.yaml"
    out.write_text(render.raw())
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("kubernetes-validate")), "--strict", "--quiet", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_validation_is_actually_strict(render: Renderer) -> None:
    """Negative control: an unknown Deployment field must be rejected, or the checks above mean nothing."""
    deployment = json.loads(json.dumps(_one(render(), "Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[-1], strict=True)


def test_rendered_kinds(render: Renderer) -> None:
    policy = ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    kinds = sorted(d["kind"] for d in render())
    assert kinds == sorted(["ClusterRole", "ClusterRoleBinding", "Deployment", "Service", "ServiceAccount", *policy])
    kinds = sorted(d["kind"] for d in render(*VALUE_SETS["both"]))
    assert kinds == sorted(
        [
            *policy,
            "ClusterRole",
            "ClusterRoleBinding",
            "Deployment",
            "Service",
            "ServiceAccount",
            "ServiceMonitor",
            "Role",
            "Role",
            "RoleBinding",
            "RoleBinding",
        ]
    )


def test_namespaced_objects_go_to_release_namespace(render: Renderer) -> None:
    for doc in render(*VALUE_SETS["servicemonitor"]):
        if doc["kind"] in {"Deployment", "Service", "ServiceAccount", "ServiceMonitor"}:
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["kind"]


def test_kube_version_floor(helm_bin: str, helm_env: dict[str, str]) -> None:
    no_policy = ("--set", "agentPodPolicy.enabled=false")
    ok = _helm(helm_bin, helm_env, "template", RELEASE, str(CHART), "--kube-version", "1.30.0", *no_policy)
    assert ok.returncode == 0, ok.stderr
    # The agents' pod policy checks the pod a token is bound to, which the API server names from 1.32 on.
    policy = _helm(helm_bin, helm_env, "template", RELEASE, str(CHART), "--kube-version", "1.31.9")
    assert policy.returncode != 0
    assert (
        "agentPodPolicy needs Kubernetes >= 1.32" in policy.stderr and "agentPodPolicy.enabled=false" in policy.stderr
    )
    ok = _helm(helm_bin, helm_env, "template", RELEASE, str(CHART), "--kube-version", "1.32.0")
    assert ok.returncode == 0, ok.stderr
    old = _helm(helm_bin, helm_env, "template", RELEASE, str(CHART), "--kube-version", "1.29.9")
    assert old.returncode != 0
    assert ">=1.30.0-0" in old.stderr


# ---------------------------------------------------------------------------------------------------
# Deployment
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", VALUE_SETS, ids=list(VALUE_SETS))
def test_deployment_single_replica_recreate(render: Renderer, values: str) -> None:
    spec = _one(render(*VALUE_SETS[values]), "Deployment")["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()


def test_deployment_is_hardened(render: Renderer) -> None:
    pod = _one(render(), "Deployment")["spec"]["template"]["spec"]
    container = _container(render())
    sc = container["securityContext"]
    for key, value in HARDENED_CONTAINER.items():
        assert sc[key] == value, key
    assert sc.get("privileged", False) is False
    assert "add" not in sc["capabilities"]
    psc = pod["securityContext"]
    assert psc["runAsNonRoot"] is True
    assert psc["runAsUser"] == 65532
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    # Read-only root fs: /tmp is the one writable mount, an emptyDir.
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(volumes) == {"tmp"} and "emptyDir" in volumes["tmp"]
    assert pod["serviceAccountName"] == FULLNAME


def test_deployment_args_default(render: Renderer) -> None:
    container = _container(render())
    assert container["args"] == [
        "operator",
        "--metrics-port",
        "9090",
        "--liveness",
        "http://0.0.0.0:8080/healthz",
    ]
    assert container["image"] == "ghcr.io/weightsync/weightsync-operator:0.1.0"
    env = _env(container)
    assert env[names.OPERATOR_ENV_AGENT_IMAGE] == "ghcr.io/weightsync/weightsync-agent:0.1.0"
    assert env[names.OPERATOR_ENV_RESYNC_SECONDS] == "30"
    # The scale settings reach the operator under the names it reads (and parse there).
    config = OperatorConfig.from_env(env)
    assert (config.create_concurrency, config.status_interval, config.pod_relist_seconds) == (32, 1.0, 600.0)
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"healthz": 8080, "metrics": 9090}
    assert probe["port"] == "healthz"


def test_deployment_args_namespaced_and_overrides(render: Renderer) -> None:
    docs = render(
        *NS_ARGS,
        "--set",
        "agentImage.tag=v9",
        "--set",
        "image.tag=v8",
        "--set",
        "verbose=true",
        "--set",
        "liveness.port=8181",
        "--set",
        "metrics.port=9191",
    )
    container = _container(docs)
    assert container["args"] == [
        "operator",
        "--metrics-port",
        "9191",
        "--liveness",
        "http://0.0.0.0:8181/healthz",
        "--namespace",
        "team-a",
        "--namespace",
        "team-b",
        "--verbose",
    ]
    assert container["image"].endswith(":v8")
    assert _env(container)[names.OPERATOR_ENV_AGENT_IMAGE] == "ghcr.io/weightsync/weightsync-agent:v9"


def test_deployment_args_are_accepted_by_the_cli(render: Renderer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chart's args parse with `weightsync operator` (catches drift of the CLI contract).

    The operator itself is replaced by a stub that records what the CLI would run it with.
    """
    calls: list[dict[str, Any]] = []
    stub = types.ModuleType("weightsync_operator.main")
    stub.run = lambda **kwargs: calls.append(kwargs)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "weightsync_operator.main", stub)
    args = _container(render(*NS_ARGS, "--set", "verbose=true"))["args"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    [kwargs] = calls
    # Checked by value, not by keyword name: that naming is between the CLI and the operator.
    values = list(kwargs.values())
    for expected in (["team-a", "team-b"], "http://0.0.0.0:8080/healthz", 9090, True):
        assert expected in values, f"{expected!r} not passed to the operator: {kwargs}"


def test_metrics_disabled_drops_flag_service_and_port(render: Renderer) -> None:
    docs = render("--set", "metrics.enabled=false")
    container = _container(docs)
    assert "--metrics-port" not in container["args"]
    assert [p["name"] for p in container["ports"]] == ["healthz"]
    assert not _by_kind(docs, "Service")


# ---------------------------------------------------------------------------------------------------
# RBAC
# ---------------------------------------------------------------------------------------------------


def test_rbac_cluster_wide_is_exact(render: Renderer) -> None:
    docs = render()
    role = _one(docs, "ClusterRole")
    assert _rule_triples(role) == CLUSTER_SCOPED_RULES | NAMESPACED_RULES
    assert not _by_kind(docs, "Role") and not _by_kind(docs, "RoleBinding")
    binding = _one(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]


def test_rbac_namespaced_is_exact(render: Renderer) -> None:
    docs = render(*NS_ARGS)
    cluster_role = _one(docs, "ClusterRole")
    assert _rule_triples(cluster_role) == CLUSTER_SCOPED_RULES
    cluster_binding = _one(docs, "ClusterRoleBinding")
    assert cluster_binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    roles = _by_kind(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert _rule_triples(role) == NAMESPACED_RULES
    bindings = _by_kind(docs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for binding in bindings:
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": FULLNAME,
        }
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]


@pytest.mark.parametrize("values", VALUE_SETS, ids=list(VALUE_SETS))
def test_no_wildcards_anywhere(render: Renderer, values: str) -> None:
    for doc in render(*VALUE_SETS[values]):
        assert "*" not in set(_strings(doc)), f"wildcard in {doc['kind']}/{doc['metadata']['name']}"


def test_existing_service_account(render: Renderer, helm_bin: str, helm_env: dict[str, str]) -> None:
    docs = render("--set", "serviceAccount.create=false", "--set", "serviceAccount.name=ops-sa")
    assert not _by_kind(docs, "ServiceAccount")
    assert _one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops-sa"
    assert _one(docs, "ClusterRoleBinding")["subjects"][0]["name"] == "ops-sa"
    proc = _helm(helm_bin, helm_env, "template", RELEASE, str(CHART), "--set", "serviceAccount.create=false")
    assert proc.returncode != 0
    assert "serviceAccount.name" in proc.stderr


# ---------------------------------------------------------------------------------------------------
# Metrics / ServiceMonitor / NOTES
# ---------------------------------------------------------------------------------------------------


def test_service_monitor_only_when_enabled(render: Renderer) -> None:
    assert not _by_kind(render(), "ServiceMonitor")
    docs = render(*SM_ARGS)
    monitor = _one(docs, "ServiceMonitor")
    service = _one(docs, "Service")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics"
    assert [p["name"] for p in service["spec"]["ports"]] == ["metrics"]
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"


def test_notes(helm_bin: str, helm_env: dict[str, str]) -> None:
    proc = _helm(
        helm_bin,
        helm_env,
        "install",
        RELEASE,
        str(CHART),
        "--dry-run=client",
        "--namespace",
        NAMESPACE,
        *NS_ARGS,
    )
    assert proc.returncode == 0, proc.stderr
    assert "kubectl get wsg" in proc.stdout
    assert "team-a, team-b" in proc.stdout
    assert f"deployment/{FULLNAME}" in proc.stdout


# ---------------------------------------------------------------------------------------------------
# values.schema.json: bad values are rejected, naming the value
# ---------------------------------------------------------------------------------------------------

BAD_VALUES = {
    "replicas-2": (["--set", "replicaCount=2"], "/replicaCount"),
    "replicas-string": (["--set-string", "replicaCount=1"], "/replicaCount"),
    "replicas-null": (["--set", "replicaCount=null"], "replicaCount"),
    "metrics-port-range": (["--set", "metrics.port=99999"], "/metrics/port"),
    "metrics-port-zero": (["--set", "metrics.port=0"], "/metrics/port"),
    "liveness-port-type": (["--set", "liveness.port=http"], "/liveness/port"),
    "bad-namespace": (["--set", "watchNamespaces[0]=Bad_NS"], "/watchNamespaces/0"),
    "duplicate-namespace": (["--set", "watchNamespaces={a,a}"], "/watchNamespaces"),
    "namespaces-not-list": (["--set", "watchNamespaces=team-a"], "/watchNamespaces"),
    "unknown-top-level": (["--set", "unknownKey=1"], "unknownKey"),
    "unknown-nested": (["--set", "metrics.prot=1"], "prot"),
    "image-tag-number": (["--set", "image.tag=123"], "/image/tag"),
    "image-tag-null": (["--set", "image.tag=null"], "tag"),
    "image-tag-object": (["--set-json", 'image.tag={"a":1}'], "/image/tag"),
    "pull-policy": (["--set", "image.pullPolicy=Sometimes"], "/image/pullPolicy"),
    "resync-zero": (["--set", "resyncSeconds=0"], "/resyncSeconds"),
    "resync-type": (["--set-string", "resyncSeconds=30"], "/resyncSeconds"),
    "verbose-type": (["--set-string", "verbose=yes"], "/verbose"),
    "create-concurrency-zero": (["--set", "createConcurrency=0"], "/createConcurrency"),
    "status-interval-zero": (["--set", "statusIntervalSeconds=0"], "/statusIntervalSeconds"),
    "pod-relist-too-often": (["--set", "podRelistSeconds=1"], "/podRelistSeconds"),
    "monitor-without-metrics": (
        ["--set", "metrics.enabled=false", "--set", "metrics.serviceMonitor.enabled=true"],
        "/metrics/enabled",
    ),
    "monitor-interval": (
        ["--set", "metrics.serviceMonitor.interval=often"],
        "/metrics/serviceMonitor/interval",
    ),
    "node-selector-type": (["--set-json", "nodeSelector=[1]"], "/nodeSelector"),
    "run-as-user-type": (["--set-string", "securityContext.runAsUser=root"], "/securityContext/runAsUser"),
    "same-ports": (["--set", "metrics.port=8080"], "metrics.port"),
}


#: `helm install --dry-run=client` runs the same schema check; exercised on a representative subset.
INSTALL_CASES = [
    "replicas-2",
    "metrics-port-range",
    "bad-namespace",
    "unknown-top-level",
    "image-tag-number",
    "same-ports",
]
BAD_CASES = [("template", case) for case in BAD_VALUES] + [("install", case) for case in INSTALL_CASES]


@pytest.mark.parametrize(("command", "case"), BAD_CASES, ids=[f"{c}-{k}" for c, k in BAD_CASES])
def test_bad_values_rejected(helm_bin: str, helm_env: dict[str, str], command: str, case: str) -> None:
    args, name = BAD_VALUES[case]
    extra = ["--dry-run=client"] if command == "install" else []
    proc = _helm(helm_bin, helm_env, command, RELEASE, str(CHART), "--namespace", NAMESPACE, *extra, *args)
    assert proc.returncode != 0, f"{args} was accepted:\n{proc.stdout[:500]}"
    assert name in proc.stderr, proc.stderr


def test_schema_covers_values_yaml_and_back() -> None:
    """Every top-level key in values.yaml is in the schema and vice versa (except Helm's `global`)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) - {"global"} == set(values)
    assert set(schema["required"]) <= set(values)


# ---------------------------------------------------------------------------------------------------
# CRD
# ---------------------------------------------------------------------------------------------------


def test_chart_crd_is_generated_copy() -> None:
    regenerate = f"weightsync crd > {CRD_FILE.relative_to(REPO)}"
    expected = render_crd().encode()
    assert CRD_FILE.read_bytes() == expected, f"the chart's CRD is stale; regenerate with: {regenerate}"


def test_chart_crd_matches_top_level_crds_dir() -> None:
    top = REPO / "crds" / CRD_FILE.name
    if not top.exists():
        pytest.skip(f"{top.relative_to(REPO)} not generated yet")
    assert top.read_bytes() == CRD_FILE.read_bytes()


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_crd_passes_kubernetes_validate_strict(kube_version: str) -> None:
    docs = [d for d in yaml.safe_load_all(CRD_FILE.read_text()) if d]
    assert [d["kind"] for d in docs] == ["CustomResourceDefinition"]
    kubernetes_validate.validate(docs[0], kube_version, strict=True)


def test_crd_installed_by_helm(helm_bin: str, helm_env: dict[str, str]) -> None:
    proc = _helm(helm_bin, helm_env, "template", RELEASE, str(CHART), "--include-crds")
    assert proc.returncode == 0, proc.stderr
    kinds = [(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(proc.stdout) if d]
    assert ("CustomResourceDefinition", "weightsyncgroups.weightsync.io") in kinds


# ---------------------------------------------------------------------------------------------------
# The agents' pod policy (its behaviour is tested on the real API server: tests/e2e/test_least_privilege.py)
# ---------------------------------------------------------------------------------------------------


def test_agent_pod_policy_names_what_agents_write(render: Renderer) -> None:
    from weightsync.api import names

    policy = _one(render(), "ValidatingAdmissionPolicy")
    binding = _one(render(), "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert binding["spec"]["paramRef"] == {"selector": {}, "parameterNotFoundAction": "Allow"}
    assert policy["spec"]["paramKind"] == {"apiVersion": "weightsync.io/v1alpha1", "kind": "WeightSyncGroup"}
    assert policy["spec"]["failurePolicy"] == "Fail"
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["operations"] == ["UPDATE"] and rule["resources"] == ["pods", "pods/status"]
    # Only the groups' pods: never the cluster's other pod updates (tests/e2e/test_least_privilege.py).
    selector = policy["spec"]["matchConstraints"]["objectSelector"]
    assert selector == {"matchExpressions": [{"key": names.LABEL_GROUP, "operator": "Exists"}]}
    text = json.dumps(policy)
    # The names the agents use (weightsync.api.names), spelled the same in the policy's CEL.
    assert f"'{names.CONDITION_AGENT_READY}'" in text
    # Exactly the annotations agents write (weightsync_agent's reporters), and no other weightsync.io/ key.
    (listed,) = [v["expression"] for v in policy["spec"]["variables"] if v["name"] == "agentAnnotations"]
    written = {names.ANNOTATION_WEIGHT_VERSION, names.ANNOTATION_LAST_ROUND, names.ANNOTATION_ENGINE_URL,
               names.ANNOTATION_SYNC_PATHS, names.ANNOTATION_AGENT_URL}  # fmt: skip
    assert set(re.findall(r"'([^']+)'", listed)) == written
    assert names.ANNOTATION_SPEC_HASH not in listed and "startsWith('weightsync.io/')" not in text
    assert "+ '-agent'" in text and names.agent_service_account("g") == "g-agent"


def test_agent_pod_policy_can_be_turned_off(render: Renderer) -> None:
    kinds = {d["kind"] for d in render("--set", "agentPodPolicy.enabled=false")}
    assert not kinds & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
