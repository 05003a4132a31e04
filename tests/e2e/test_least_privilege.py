"""Least privilege on the real API server (docs/security.md, "Least privilege").

The TCP example's pods are admitted where Pod Security enforces ``baseline`` (and a pod that violates it is
refused there, so the check can fail); only the agent container holds API credentials; and with an engine agent's
pod-bound token (what the kubelet projects, minted here by :class:`PodCredentials`) the chart's admission policy
lets the agent patch only its own pod's weightsync annotations and readiness condition.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import Kube, OperatorProcess, load_example, wait_for

from weightsync.api import names
from weightsync.api.load import parse_group
from weightsync.api.v1alpha1 import AGENT_CONTAINER
from weightsync_operator.builders import BuildOptions, build_engine_pod
from weightsync_tools.localcluster.pki import Pki, kubeconfig
from weightsync_tools.localcluster.session import PodCredentials, group_pods

NS = "e2e-baseline"
GROUP = "demo"
SA_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
OWN = f"{GROUP}-engine-0-0"
OTHER = f"{GROUP}-engine-1-0"
EXPECTED = {f"{GROUP}-trainer-0", f"{GROUP}-trainer-1", OWN, OTHER}


@pytest.fixture(scope="module")
def baseline_group(admin: Kube, operator: OperatorProcess) -> dict[str, dict[str, Any]]:
    admin.kubectl("create", "namespace", NS)
    admin.kubectl("label", "namespace", NS, "pod-security.kubernetes.io/enforce=baseline")
    admin.kubectl("apply", "-f", "-", input=yaml.safe_dump(load_example("tcp-group.yaml", NS)))
    found: dict[str, dict[str, Any]] = wait_for(
        "the TCP group's pods under enforce=baseline",
        lambda: (p := group_pods(admin, NS, GROUP)) and set(p) == EXPECTED and p,
        timeout=90,
    )
    return found


@pytest.fixture(scope="module")
def engine_agent(
    cluster: Any, admin: Kube, baseline_group: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Kube:
    """kubectl as engine 0's agent, with a token bound to its pod, as the kubelet would give it."""
    state, _ = cluster
    path = PodCredentials(state, admin, tmp_path_factory.mktemp("lp"))(baseline_group[OWN])
    return Kube(path, admin.binaries)


def _refused(result: Any, *words: str) -> None:
    assert result.returncode != 0, "the API server accepted it"
    assert "ValidatingAdmissionPolicy" in result.stderr, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


def _patch(kube: Kube, pod: str, body: dict[str, Any], *, status: bool = False) -> Any:
    extra = ["--subresource=status"] if status else []
    return kube.kubectl("-n", NS, "patch", "pod", pod, *extra, "--type=strategic", "-p", json.dumps(body), check=False)


READY = {
    "type": names.CONDITION_AGENT_READY,
    "status": "False",
    "reason": "Probe",
    "message": "set by the least-privilege test",
    "lastTransitionTime": "2026-01-01T00:00:00Z",
}


# --- Pod Security and credentials ---------------------------------------------------------------------


def test_the_tcp_groups_pods_are_admitted_under_baseline(admin: Kube, baseline_group: dict[str, Any]) -> None:
    assert set(baseline_group) == EXPECTED
    ns = admin.json("get", "namespace", NS)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "baseline"


def test_baseline_is_enforced_here(admin: Kube, baseline_group: dict[str, Any]) -> None:
    """The negative control: without it the test above could pass in a namespace that checks nothing."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "host-net", "namespace": NS},
        "spec": {
            "hostNetwork": True,
            "serviceAccountName": names.agent_service_account(GROUP),  # exists once the group's pods do
            "containers": [{"name": "c", "image": "python:3.11-slim"}],
        },
    }
    result = admin.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)
    assert result.returncode != 0
    assert 'violates PodSecurity "baseline:latest"' in result.stderr and "hostNetwork" in result.stderr


def test_an_rdma_groups_pods_need_a_privileged_namespace(admin: Kube, baseline_group: dict[str, Any]) -> None:
    """IPC_LOCK is not among baseline's capabilities: an RDMA group's pods are refused here (docs/security.md)."""
    obj = load_example("rdma-group.yaml", NS)
    group = parse_group(obj)
    pod = build_engine_pod(group, 0, 0, BuildOptions(agent_image="agent:1"))
    pod["metadata"].pop("ownerReferences")
    pod["spec"]["serviceAccountName"] = names.agent_service_account(GROUP)  # one that exists here
    result = admin.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)
    assert result.returncode != 0
    assert 'violates PodSecurity "baseline:latest"' in result.stderr and "IPC_LOCK" in result.stderr, result.stderr


def test_only_the_agent_container_holds_api_credentials(baseline_group: dict[str, Any]) -> None:
    for name, pod in baseline_group.items():
        spec = pod["spec"]
        assert spec["automountServiceAccountToken"] is False, name
        # The ServiceAccount admission plugin injected no kube-api-access volume.
        assert not [v for v in spec["volumes"] if v["name"].startswith("kube-api-access")], name
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            at_path = [m for m in c.get("volumeMounts", []) if m["mountPath"] == SA_PATH]
            assert bool(at_path) == (c["name"] == AGENT_CONTAINER), (name, c["name"])
            caps = (c.get("securityContext") or {}).get("capabilities") or {}
            assert not caps.get("add"), (name, c["name"])  # a TCP group adds no capability


# --- The admission policy: an engine agent's pod-bound token -------------------------------------------


def test_the_policy_is_installed(admin: Kube, chart: str) -> None:
    name = f"{chart}-agent-pod-writes"
    # The API server type-checks the CEL against the Pod and WeightSyncGroup schemas, in the background.
    policy = wait_for(
        "the policy's type check",
        lambda: (
            (p := admin.json("get", "validatingadmissionpolicy", name)).get("status", {}).get("typeChecking")
            is not None
            and p
        ),
    )
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert not policy["status"]["typeChecking"].get("expressionWarnings"), policy["status"]
    admin.json("get", "validatingadmissionpolicybinding", f"{chart}-agent-pod-writes")


def test_another_pod_is_refused(engine_agent: Kube) -> None:
    own_only = "may change only their own pod: this token is bound to pod " + OWN
    _refused(
        _patch(engine_agent, OTHER, {"metadata": {"annotations": {names.ANNOTATION_WEIGHT_VERSION: "666"}}}), own_only
    )
    image = {"spec": {"containers": [{"name": "engine", "image": "attacker/engine:1"}]}}
    _refused(_patch(engine_agent, OTHER, image), own_only)
    _refused(_patch(engine_agent, OTHER, {"status": {"phase": "Failed"}}, status=True), own_only)
    _refused(_patch(engine_agent, OTHER, {"status": {"conditions": [READY]}}, status=True), own_only)


def test_its_own_readiness_condition_and_weightsync_annotation_pass(admin: Kube, engine_agent: Kube) -> None:
    result = _patch(engine_agent, OWN, {"status": {"conditions": [READY]}}, status=True)
    assert result.returncode == 0, result.stderr
    result = _patch(engine_agent, OWN, {"metadata": {"annotations": {names.ANNOTATION_WEIGHT_VERSION: "7"}}})
    assert result.returncode == 0, result.stderr
    pod = admin.json("-n", NS, "get", "pod", OWN)
    assert pod["metadata"]["annotations"][names.ANNOTATION_WEIGHT_VERSION] == "7"
    conditions = {c["type"]: c for c in pod["status"]["conditions"]}
    assert conditions[names.CONDITION_AGENT_READY]["reason"] == "Probe"


def test_its_own_labels_spec_status_and_foreign_annotations_are_refused(engine_agent: Kube) -> None:
    _refused(_patch(engine_agent, OWN, {"metadata": {"labels": {names.LABEL_ROLE: "trainer"}}}), "labels")
    _refused(_patch(engine_agent, OWN, {"metadata": {"labels": {"extra": "1"}}}), "labels")
    # The policy matches pods by this label (old or new object): dropping it is checked like any label change.
    _refused(_patch(engine_agent, OWN, {"metadata": {"labels": {names.LABEL_GROUP: None}}}), "labels")
    image = {"spec": {"containers": [{"name": "engine", "image": "attacker/engine:1"}]}}
    _refused(_patch(engine_agent, OWN, image), "may not change a pod spec")
    _refused(_patch(engine_agent, OWN, {"status": {"phase": "Failed"}}, status=True), "agent-ready condition")
    ready = {"type": "Ready", "status": "False", "lastTransitionTime": "2026-01-01T00:00:00Z"}
    _refused(_patch(engine_agent, OWN, {"status": {"conditions": [ready]}}, status=True), "agent-ready condition")
    annotation = {"metadata": {"annotations": {"example.com/owner": "me"}}}
    _refused(_patch(engine_agent, OWN, annotation), "refused: example.com/owner")
    spec_hash = {"metadata": {"annotations": {names.ANNOTATION_SPEC_HASH: "0"}}}
    _refused(_patch(engine_agent, OWN, spec_hash), "refused: " + names.ANNOTATION_SPEC_HASH)
    # Only the annotations agents write: another weightsync.io/ key (the plan's, or one made up) is refused.
    plan_hash = {"metadata": {"annotations": {names.ANNOTATION_PLAN_HASH: "0", "weightsync.io/made-up": "1"}}}
    _refused(_patch(engine_agent, OWN, plan_hash), "may change only the annotations agents write")


def test_a_token_bound_to_no_pod_is_refused(
    cluster: Any, admin: Kube, baseline_group: dict[str, Any], tmp_path: Path
) -> None:
    state, _ = cluster
    account = names.agent_service_account(GROUP)
    token = admin.kubectl("-n", NS, "create", "token", account, "--duration=10m").stdout.strip()
    path = tmp_path / "unbound.kubeconfig"
    path.write_text(kubeconfig(Pki(Path(state.directory) / "pki"), state.server, token=token, user=account))
    unbound = Kube(path, admin.binaries)
    _refused(_patch(unbound, OWN, {"status": {"conditions": [READY]}}, status=True), "bound to no pod")


def test_other_service_accounts_are_not_the_policys_business(
    cluster: Any, admin: Kube, baseline_group: dict[str, Any], tmp_path: Path
) -> None:
    """A ServiceAccount named like an agent but of no group (``build-agent``) patches labels as its RBAC allows."""
    state, _ = cluster
    admin.kubectl("-n", NS, "create", "serviceaccount", "build-agent")
    admin.kubectl("-n", NS, "create", "role", "build-agent", "--verb=get,patch", "--resource=pods")
    admin.kubectl(
        "-n", NS, "create", "rolebinding", "build-agent", "--role=build-agent", f"--serviceaccount={NS}:build-agent"
    )
    token = admin.kubectl("-n", NS, "create", "token", "build-agent", "--duration=10m").stdout.strip()
    path = tmp_path / "other.kubeconfig"
    path.write_text(kubeconfig(Pki(Path(state.directory) / "pki"), state.server, token=token, user="build-agent"))
    other = Kube(path, admin.binaries)
    result = _patch(other, OTHER, {"metadata": {"annotations": {"example.com/built": "yes"}}})
    assert result.returncode == 0, result.stderr


UNSYNCED_NS = "e2e-unsynced-params"


def test_pods_of_no_group_are_not_matched_even_while_params_are_unsynced(admin: Kube, chart: str) -> None:
    """Right after the CRD is installed (or an API server restart) the API server has not synced the
    WeightSyncGroups the policy takes as params, and refuses every request the policy matches (failurePolicy Fail)
    before any condition runs. The installed policy, copied with a param kind that never syncs and bound to one
    namespace, holds that state for good: a pod of no group is updated as usual, a group's pod is refused."""
    installed = wait_for(
        "the installed policy", lambda: admin.json("get", "validatingadmissionpolicy", f"{chart}-agent-pod-writes")
    )
    name = "e2e-unsynced-agent-pod-writes"
    # Narrowed to its own namespace in the policy itself, not only in its binding: a policy whose params cannot be
    # found refuses every request its matchConstraints match, whatever its binding says, so the copy refused kwok's
    # status patches of another test's group pods (in the full run, their pods never got IPs).
    only_here = {"matchLabels": {"kubernetes.io/metadata.name": UNSYNCED_NS}}
    constraints = dict(installed["spec"]["matchConstraints"], namespaceSelector=only_here)
    spec = dict(installed["spec"], paramKind={"apiVersion": "weightsync.io/v1alpha1", "kind": "NeverSynced"},
                matchConstraints=constraints)  # fmt: skip
    policy = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
              "metadata": {"name": name}, "spec": spec}  # fmt: skip
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
            "paramRef": {"selector": {}, "parameterNotFoundAction": "Allow"},
            "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": UNSYNCED_NS}}},
        },
    }
    admin.kubectl("create", "namespace", UNSYNCED_NS)
    try:
        for pod, labels in (("plain", {}), ("grouped", {names.LABEL_GROUP: "g"})):
            body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod, "labels": labels},
                    "spec": {"containers": [{"name": "c", "image": "busybox:1"}]}}  # fmt: skip
            admin.kubectl("-n", UNSYNCED_NS, "create", "-f", "-", input=json.dumps(body))
        admin.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([policy, binding]))

        def patch(pod: str, value: str) -> Any:
            body = json.dumps({"metadata": {"annotations": {"example.com/touched": value}}})
            return admin.kubectl("-n", UNSYNCED_NS, "patch", "pod", pod, "-p", body, check=False)

        # The binding takes effect asynchronously: wait until the group's pod is refused (fail closed) ...
        refused = wait_for(
            "the copied policy to refuse the group's pod", lambda: (r := patch("grouped", "x")).returncode != 0 and r
        )
        assert name in refused.stderr, refused.stderr
        # ... while a pod of no group is not the policy's business, params or not.
        result = patch("plain", "yes")
        assert result.returncode == 0, result.stderr
        assert (
            admin.json("-n", UNSYNCED_NS, "get", "pod", "plain")["metadata"]["annotations"]["example.com/touched"]
            == "yes"
        )
    finally:
        admin.kubectl("delete", "validatingadmissionpolicybinding,validatingadmissionpolicy", name, check=False)
        admin.kubectl("delete", "namespace", UNSYNCED_NS, "--wait=false", check=False)
