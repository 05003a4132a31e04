"""The operator end to end against a fake Kubernetes API (kmock), with kopf running for real.

kopf runs in a thread (``KopfRunner``) against kmock's in-memory API server: it logs in through the
operator's own login handler (a kubeconfig pointing at kmock), watches WeightSyncGroups and pods,
and the operator's REST client creates, patches and deletes objects there. Tests drive the "cluster"
with plain HTTP calls (which kmock turns into watch events) and read kmock's stored objects.

What kmock does not emulate, and how these tests stand in for it:
- no kubelet or scheduler: pods never run; tests patch pod ``status`` themselves to play the
  kubelet and the agent (Ready conditions, failures);
- no garbage collector: deleting a group leaves its pods in kmock; the test checks what the operator
  controls: no finalizer (deletion is immediate), and no recreation of pods once the group is gone;
- no label selectors on list/watch, no defaulting, no uid/generation/resourceVersion bookkeeping:
  the operator filters pods by label and owner itself, and tests set uid/generation explicitly.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import kopf
import pytest
from builders import GroupBuilder
from kopf.testing import KopfRunner
from prometheus_client import REGISTRY

from weightsync.api import names
from weightsync.plan import Plan, PlanError
from weightsync.ports import free_port
from weightsync_operator import apply
from weightsync_operator.apply import Reconciler
from weightsync_operator.builders import secret_token
from weightsync_operator.kube import UNAVAILABLE, ApiError, KubeApi, wait_until_served
from weightsync_operator.podindex import PodIndex
from weightsync_tools.cli.rotation import ROTATED_AT

NS = "ml"
GROUPS = "weightsync.io/v1alpha1/weightsyncgroups"
GROUP_PATH = f"/apis/weightsync.io/v1alpha1/namespaces/{NS}/weightsyncgroups"
POD_PATH = f"/api/v1/namespaces/{NS}/pods"


def declare(k: Any) -> None:
    """The API surface the operator (and kopf itself) uses, as discovery would show it."""
    info = kmock.ResourceInfo
    crud = ["get", "list", "watch", "create", "patch", "delete"]
    k.resources["v1/namespaces"] = info(kind="Namespace", namespaced=False, verbs=["list", "watch"])
    k.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = info(
        kind="CustomResourceDefinition", namespaced=False, verbs=["list", "watch"]
    )
    k.resources[GROUPS] = info(
        kind="WeightSyncGroup",
        namespaced=True,
        verbs=["get", "list", "watch", "patch"],
        subresources=["status"],
    )
    k.resources["v1/pods"] = info(kind="Pod", namespaced=True, verbs=crud, subresources=["status"])
    for plural, kind in [
        ("services", "Service"),
        ("configmaps", "ConfigMap"),
        ("serviceaccounts", "ServiceAccount"),
        ("secrets", "Secret"),
    ]:
        k.resources[f"v1/{plural}"] = info(kind=kind, namespaced=True, verbs=crud)
    for plural, kind in [("roles", "Role"), ("rolebindings", "RoleBinding")]:
        k.resources[f"rbac.authorization.k8s.io/v1/{plural}"] = info(kind=kind, namespaced=True, verbs=crud)
    k.resources["networking.k8s.io/v1/networkpolicies"] = info(kind="NetworkPolicy", namespaced=True, verbs=crud)
    k.resources["v1/events"] = info(kind="Event", namespaced=True, verbs=["create", "list"])


class Cluster:
    """Test-side access to the fake API: HTTP for changes (so watches see them), kmock for reads."""

    def __init__(self, k: Any, session: aiohttp.ClientSession) -> None:
        self.k = k
        self.session = session

    async def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        data = json.dumps(body) if body is not None else None
        async with self.session.request(method, path, data=data, headers={"Content-Type": content_type}) as r:
            assert r.status < 400, f"{method} {path}: {r.status} {await r.text()}"
            return await r.json()

    async def create_group(self, group: dict[str, Any]) -> None:
        await self.call("POST", GROUP_PATH, group)

    async def patch_group(self, name: str, patch: dict[str, Any]) -> None:
        await self.call("PATCH", f"{GROUP_PATH}/{name}", patch, "application/merge-patch+json")

    async def delete(self, path: str) -> None:
        await self.call("DELETE", path)

    async def set_pod_status(self, name: str, status: dict[str, Any]) -> None:
        await self.call("PATCH", f"{POD_PATH}/{name}/status", {"status": status}, "application/merge-patch+json")

    def objects(self, resource: str) -> dict[str, dict[str, Any]]:
        out = {}
        for (res, ns, name), obj in list(self.k.objects.items()):
            if ns == NS and not obj.deleted and f"{res.group}/{res.version}/{res.plural}".lstrip("/") == resource:
                out[name] = obj.raw
        return out

    def pods(self) -> dict[str, dict[str, Any]]:
        return self.objects("v1/pods")

    def group(self, name: str) -> dict[str, Any] | None:
        return self.objects(GROUPS).get(name)

    def status(self, name: str) -> dict[str, Any]:
        return (self.group(name) or {}).get("status") or {}

    def condition(self, name: str, type_: str) -> dict[str, Any]:
        return next((c for c in self.status(name).get("conditions", []) if c["type"] == type_), {})

    def events(self, reason: str | None = None) -> list[dict[str, Any]]:
        events = sorted(self.objects("v1/events").values(), key=lambda e: e["metadata"]["name"])
        return [e for e in events if reason is None or e["reason"] == reason]

    def pod_history(self, name: str) -> list[Any]:
        for (res, ns, pod), obj in self.k.objects.items():
            if res.plural == "pods" and ns == NS and pod == name:
                return list(obj.history)
        return []


async def eventually(check: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
    """Poll ``check`` until it returns something truthy (or stops raising AssertionError)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
            if last:
                return last
        except AssertionError as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}: last {last!r}")
        await asyncio.sleep(0.05)


@pytest.fixture
async def cluster(kmock: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    declare(kmock)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
                "users": [{"name": "test", "user": {"token": "test-token"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test", "namespace": NS}}],
                "current-context": "kmock",
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv(names.OPERATOR_ENV_AGENT_IMAGE, raising=False)
    # Resync rarely: the tests must pass on watch events alone.
    monkeypatch.setenv(names.OPERATOR_ENV_RESYNC_SECONDS, "3600")
    async with aiohttp.ClientSession(base_url=str(kmock.url)) as session:
        yield Cluster(kmock, session)


@pytest.fixture
async def operator(
    cluster: Cluster,
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[KopfRunner]:
    caplog.set_level(logging.INFO)
    resync = getattr(request, "param", None)  # parametrize("operator", [seconds], indirect=True)
    if resync is not None:
        monkeypatch.setenv(names.OPERATOR_ENV_RESYNC_SECONDS, str(resync))
    runner = KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "weightsync_operator.handlers"], timeout=30)
    runner.__enter__()
    try:
        yield runner
    finally:
        # Stopping joins kopf's thread: do it off the loop that serves kmock, or kopf cannot finish.
        await asyncio.to_thread(runner.__exit__, None, None, None)
    assert runner.exception is None
    assert runner.exit_code == 0
    # kopf logs handler failures (and would retry them) at ERROR; the operator must have had none.
    records = [r for when in ("setup", "call") for r in caplog.get_records(when)]
    assert any(r.name.startswith("kopf") for r in records)  # the operator thread's logs are seen
    errors = [
        r.getMessage()
        for r in records
        if r.levelno >= logging.ERROR and r.name.startswith(("kopf", "weightsync_operator"))
    ]
    assert errors == []


def pods_named(cluster: Cluster, *expected: str) -> Callable[[], bool]:
    return lambda: sorted(cluster.pods()) == sorted(expected)


# --- Create --------------------------------------------------------------------------------------


async def test_create_builds_everything_and_reports_status(cluster: Cluster, operator: KopfRunner) -> None:
    group = GroupBuilder("demo", NS).trainers(1).engines(2, tp=2, ranks_per_pod=1).rdma("rdma/ib").build()
    await cluster.create_group(group)

    expected = ["demo-trainer-0", "demo-engine-0-0", "demo-engine-0-1", "demo-engine-1-0", "demo-engine-1-1"]
    await eventually(pods_named(cluster, *expected), what="pods")
    assert set(cluster.objects("v1/services")) == {"demo"}
    assert set(cluster.objects("v1/serviceaccounts")) == {"demo-agent"}
    assert set(cluster.objects("rbac.authorization.k8s.io/v1/roles")) == {"demo-agent"}
    assert set(cluster.objects("rbac.authorization.k8s.io/v1/rolebindings")) == {"demo-agent"}
    secret = cluster.objects("v1/secrets")["demo-credentials"]
    assert secret["metadata"]["ownerReferences"][0]["uid"] == group["metadata"]["uid"]
    assert secret_token(secret) is not None
    cm = cluster.objects("v1/configmaps")["demo-plan"]
    plan = Plan.from_json(cm["data"][names.PLAN_KEY])
    assert plan.layout.engines == 2 and plan.revision == 1

    status = await eventually(lambda: cluster.status("demo").get("phase") == "Pending" and cluster.status("demo"))
    assert status["trainers"] == {"desired": 1, "ready": 0}
    assert status["engines"] == {"desired": 4, "ready": 0}
    assert status["plan"]["hash"] == plan.hash and status["plan"]["configMap"] == "demo-plan"
    assert cluster.condition("demo", "PlanReady")["status"] == "True"
    assert cluster.events("PlanCreated")

    pod = cluster.pods()["demo-engine-1-0"]
    assert pod["metadata"]["ownerReferences"][0]["uid"] == group["metadata"]["uid"]
    assert pod["spec"]["initContainers"][-1]["name"] == "weightsync-agent"

    # kopf kept its bookkeeping under weightsync.io and added no finalizer.
    meta = cluster.group("demo")["metadata"]  # type: ignore[index]
    assert not meta.get("finalizers")
    assert not [a for a in meta.get("annotations", {}) if a.startswith("kopf.zalando.org")]

    # Play the kubelet + agents: pods become Ready; the pod watch folds that into the status.
    for name in expected:
        await cluster.set_pod_status(
            name,
            {
                "phase": "Running",
                "conditions": [
                    {"type": "PodScheduled", "status": "True"},
                    {"type": names.CONDITION_AGENT_READY, "status": "True"},
                    {"type": "Ready", "status": "True"},
                ],
            },
        )
    await eventually(lambda: cluster.status("demo").get("phase") == "Ready", what="Ready")
    assert cluster.status("demo")["engines"] == {"desired": 4, "ready": 4}
    assert cluster.condition("demo", "Ready")["status"] == "True"


# --- Scale ---------------------------------------------------------------------------------------


async def test_scale_engines_up_and_down(cluster: Cluster, operator: KopfRunner) -> None:
    await cluster.create_group(GroupBuilder("s", NS).trainers(2).engines(2, tp=2).build())
    await eventually(pods_named(cluster, "s-trainer-0", "s-trainer-1", "s-engine-0-0", "s-engine-1-0"))
    first = await eventually(lambda: cluster.status("s").get("plan"))
    assert first["revision"] == 1

    await cluster.patch_group("s", {"metadata": {"generation": 2}, "spec": {"inference": {"engines": 4}}})
    await eventually(
        pods_named(cluster, "s-trainer-0", "s-trainer-1", *(f"s-engine-{e}-0" for e in range(4))),
        what="scale up",
    )
    plan = await eventually(lambda: cluster.status("s").get("plan", {}).get("revision") == 2 and cluster.status("s"))
    assert plan["plan"]["targets"] == 8 and plan["observedGeneration"] == 2
    cm = cluster.objects("v1/configmaps")["s-plan"]
    assert cm["metadata"]["annotations"][names.ANNOTATION_PLAN_REVISION] == "2"
    stored = Plan.from_json(cm["data"][names.PLAN_KEY])
    assert stored.layout.engines == 4 and stored.revision == 2
    assert plan["plan"]["movedTargets"] == stored.moved_targets
    (updated,) = cluster.events("PlanUpdated")
    assert f"{stored.moved_targets} targets moved" in updated["message"] and "revision 2" in updated["message"]
    role = cluster.objects("rbac.authorization.k8s.io/v1/roles")["s-agent"]
    assert len(role["rules"][1]["resourceNames"]) == 6

    await cluster.patch_group("s", {"metadata": {"generation": 3}, "spec": {"inference": {"engines": 1}}})
    await eventually(pods_named(cluster, "s-trainer-0", "s-trainer-1", "s-engine-0-0"), what="scale down")
    await eventually(lambda: cluster.status("s").get("plan", {}).get("revision") == 3)
    role = cluster.objects("rbac.authorization.k8s.io/v1/roles")["s-agent"]
    assert role["rules"][1]["resourceNames"] == ["s-trainer-0", "s-trainer-1", "s-engine-0-0"]
    assert cluster.events("PodsRemoved")


# --- Pod loss ------------------------------------------------------------------------------------


async def test_deleted_and_failed_pods_are_recreated(cluster: Cluster, operator: KopfRunner) -> None:
    await cluster.create_group(GroupBuilder("r", NS).trainers(1).engines(1).build())
    await eventually(pods_named(cluster, "r-trainer-0", "r-engine-0-0"))

    await cluster.delete(f"{POD_PATH}/r-engine-0-0")
    # Deleted (a None in kmock's history), then created again by the operator.
    await eventually(lambda: None in cluster.pod_history("r-engine-0-0") and "r-engine-0-0" in cluster.pods())

    await cluster.set_pod_status(
        "r-trainer-0", {"phase": "Failed", "reason": "Evicted", "message": "node low on memory"}
    )
    await eventually(lambda: cluster.events("PodFailed"), what="PodFailed event")
    await eventually(
        lambda: (
            "r-trainer-0" in cluster.pods() and cluster.pods()["r-trainer-0"].get("status", {}).get("phase") != "Failed"
        ),
        what="evicted pod recreated",
    )
    assert "Evicted" in cluster.events("PodFailed")[0]["message"]


# --- Delete --------------------------------------------------------------------------------------


async def test_group_deletion_is_not_blocked_and_nothing_is_recreated(cluster: Cluster, operator: KopfRunner) -> None:
    await cluster.create_group(GroupBuilder("d", NS).build())
    await eventually(pods_named(cluster, "d-trainer-0", "d-engine-0-0"))
    await eventually(lambda: cluster.status("d").get("phase"))
    # Let the reconciles the pods' own creation triggered finish: one already running when the group goes may
    # still create a pod (owned by the deleted group, so a real garbage collector removes it). What this test
    # pins is that nothing is created *after* the operator saw the deletion.
    await asyncio.sleep(1.0)

    await cluster.delete(f"{GROUP_PATH}/d")  # no finalizer: kmock deletes at once
    assert cluster.group("d") is None
    # Play the garbage collector: the pods go; the operator must not bring them back.
    await asyncio.sleep(0.3)
    for name in list(cluster.pods()):
        await cluster.delete(f"{POD_PATH}/{name}")
    await asyncio.sleep(1.0)
    assert cluster.pods() == {}


# --- Template changes and resync ------------------------------------------------------------------


async def test_a_template_change_never_kills_running_pods(cluster: Cluster, operator: KopfRunner) -> None:
    await cluster.create_group(GroupBuilder("t", NS).build())
    await eventually(pods_named(cluster, "t-trainer-0", "t-engine-0-0"))
    old_hash = cluster.pods()["t-trainer-0"]["metadata"]["annotations"][names.ANNOTATION_SPEC_HASH]

    await cluster.patch_group("t", {"metadata": {"generation": 2}, "spec": {"agent": {"image": "agent:2"}}})
    (event,) = await eventually(lambda: cluster.events("PodsOutdated"), what="PodsOutdated")
    assert "t-trainer-0" in event["message"] and "t-engine-0-0" in event["message"]
    assert cluster.pods()["t-trainer-0"]["metadata"]["annotations"][names.ANNOTATION_SPEC_HASH] == old_hash
    assert None not in cluster.pod_history("t-trainer-0")  # never deleted

    # Deleting a pod applies the new spec to it.
    await cluster.delete(f"{POD_PATH}/t-trainer-0")
    await eventually(
        lambda: (
            cluster.pods().get("t-trainer-0", {}).get("spec", {}).get("initContainers", [{}])[-1].get("image")
            == "agent:2"
        ),
        what="recreated with the new image",
    )


@pytest.mark.parametrize("operator", [0.3], indirect=True, ids=["resync=0.3s"])
async def test_periodic_resync_restores_what_no_watch_sees(cluster: Cluster, operator: KopfRunner) -> None:
    await cluster.create_group(GroupBuilder("y", NS).build())
    await eventually(lambda: "y-plan" in cluster.objects("v1/configmaps") and "y" in cluster.objects("v1/services"))
    # The operator watches groups and pods only; a deleted ConfigMap or Service comes back on resync.
    await cluster.delete(f"/api/v1/namespaces/{NS}/configmaps/y-plan")
    await cluster.delete(f"/api/v1/namespaces/{NS}/services/y")
    await eventually(
        lambda: "y-plan" in cluster.objects("v1/configmaps") and "y" in cluster.objects("v1/services"),
        what="restored by resync",
    )


# --- Bad specs -----------------------------------------------------------------------------------


async def test_bad_spec_fails_clearly_without_a_crash_loop(cluster: Cluster, operator: KopfRunner) -> None:
    bad = GroupBuilder("b", NS).set("inference.adapter", "trtllm").build()
    await cluster.create_group(bad)
    await eventually(lambda: cluster.status("b").get("phase") == "Failed", what="Failed")
    degraded = cluster.condition("b", "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert "spec.inference.adapter" in degraded["message"] and "sglang" in degraded["message"]
    (warning,) = cluster.events("InvalidSpec")
    assert warning["type"] == "Warning"
    assert cluster.pods() == {}

    # No retries: one status write, one event, however long we wait.
    patches = len(cluster.k[kmock.method.PATCH, kmock.subresource("status")])
    assert patches >= 1
    await asyncio.sleep(1.0)
    assert len(cluster.k[kmock.method.PATCH, kmock.subresource("status")]) == patches
    assert len(cluster.events("InvalidSpec")) == 1

    # Fixing the spec recovers.
    await cluster.patch_group("b", {"metadata": {"generation": 2}, "spec": {"inference": {"adapter": "reference"}}})
    await eventually(pods_named(cluster, "b-trainer-0", "b-engine-0-0"), what="recovery")
    await eventually(lambda: cluster.condition("b", "Degraded").get("status") == "False")


async def test_invalid_layout_is_caught_by_the_cel_rules(cluster: Cluster, operator: KopfRunner) -> None:
    # ranksPerEngine 3 is not a multiple of ranksPerPod 2: pydantic accepts it, the CRD's CEL does not.
    await cluster.create_group(GroupBuilder("c", NS).engines(1, tp=3, ranks_per_pod=2).build())
    await eventually(lambda: cluster.status("c").get("phase") == "Failed")
    assert "multiple of inference.ranksPerPod" in cluster.condition("c", "Degraded")["message"]
    assert cluster.pods() == {}


async def test_an_adapter_that_cannot_serve_the_spec_is_refused(cluster: Cluster, operator: KopfRunner) -> None:
    # Valid for the API server, but stock SGLang has no staging area: refused, not pods that never get ready.
    await cluster.create_group(GroupBuilder("g", NS).adapter("sglang").set("transfer.targetStaging", "staged").build())
    await cluster.create_group(GroupBuilder("ok", NS).adapter("reference").build())
    await eventually(lambda: cluster.status("g").get("phase") == "Failed", what="Failed")
    ready = cluster.condition("g", "Ready")
    assert ready["status"] == "False" and ready["reason"] == "AdapterLacksCapability"
    assert "sglang" in ready["message"] and "targetStaging" in ready["message"]
    degraded = cluster.condition("g", "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "AdapterLacksCapability"
    plan_ready = cluster.condition("g", "PlanReady")
    assert plan_ready["status"] == "False" and plan_ready["reason"] == "AdapterLacksCapability"
    (warning,) = await eventually(lambda: cluster.events("AdapterLacksCapability"), what="Warning event")
    assert warning["type"] == "Warning" and "sglang" in warning["message"]
    assert warning["involvedObject"]["name"] == "g"
    assert "g-plan" not in cluster.objects("v1/configmaps")

    # The reference group beside it is built as usual.
    await eventually(pods_named(cluster, "ok-trainer-0", "ok-engine-0-0"), what="the reference group's pods")
    await eventually(lambda: cluster.condition("ok", "PlanReady").get("status") == "True", what="PlanReady")
    assert cluster.status("ok")["phase"] != "Failed"
    assert not [p for p in cluster.pods() if p.startswith("g-")]


# --- The reconciler directly (no kopf): what the fake API cannot be made to do -------------------


async def test_planner_errors_become_a_failed_condition(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: Any, **__: Any) -> Any:
        raise PlanError("cannot cover 4 targets with shape limit 1")

    monkeypatch.setattr(apply, "decide_plan", refuse)
    group = GroupBuilder("p", NS).build()
    await cluster.create_group(group)
    api = KubeApi(lambda: kopf.ConnectionInfo(server=str(cluster.k.url)))
    try:
        result = await Reconciler(api).reconcile(group)
    finally:
        await api.close()
    assert result.phase == "Failed" and result.problem is not None and not result.retry
    degraded = cluster.condition("p", "Degraded")
    assert degraded["reason"] == "PlanFailed" and "shape limit" in degraded["message"]
    assert cluster.condition("p", "PlanReady")["status"] == "False"
    assert cluster.events("PlanFailed")[0]["type"] == "Warning"
    assert cluster.pods() == {}


async def test_api_errors_are_reported_and_retried(cluster: Cluster) -> None:
    cluster.k["post", kmock.resource("v1/pods")] << kmock.KubernetesError(403, "Forbidden", "pods is forbidden")
    group = GroupBuilder("e", NS).build()
    await cluster.create_group(group)
    api = KubeApi(lambda: kopf.ConnectionInfo(server=str(cluster.k.url)))
    try:
        result = await Reconciler(api).reconcile(group)
    finally:
        await api.close()
    assert result.retry and result.phase == "Degraded"
    degraded = cluster.condition("e", "Degraded")
    assert degraded["reason"] == "ApiError" and "forbidden" in degraded["message"]


async def test_a_second_reconcile_changes_nothing(cluster: Cluster) -> None:
    group = GroupBuilder("i", NS).trainers(2).engines(2).build()
    await cluster.create_group(group)
    api = KubeApi(lambda: kopf.ConnectionInfo(server=str(cluster.k.url)))
    reconciler = Reconciler(api)
    try:
        await reconciler.reconcile(group)
        writes = [r for r in cluster.k if r.method != "GET"]
        assert len(writes) > 10  # the objects, the pods, the status, the event
        await reconciler.reconcile(group)
        # A fresh operator (no memory) reading the written status back: still nothing to write.
        await Reconciler(api).reconcile(cluster.group("i"))  # type: ignore[arg-type]
    finally:
        await api.close()
    assert [r for r in cluster.k if r.method != "GET"] == writes
    assert len(cluster.events("PlanCreated")) == 1
    assert REGISTRY.get_sample_value("weightsync_operator_groups", {"phase": "Pending"}) >= 1


async def test_the_group_token_is_made_once_and_never_rewritten(cluster: Cluster) -> None:
    group = GroupBuilder("c", NS).trainers(1).engines(1).build()
    await cluster.create_group(group)
    secret_path = f"/api/v1/namespaces/{NS}/secrets/c-credentials"
    api = KubeApi(lambda: kopf.ConnectionInfo(server=str(cluster.k.url)))
    try:
        await Reconciler(api).reconcile(group)
        token = secret_token(cluster.objects("v1/secrets")["c-credentials"])
        assert token is not None and len(token) >= 43
        # Later reconciles, by this operator or a fresh one (no memory), keep it; a label edit is undone, the data not.
        await cluster.call("PATCH", secret_path, {"metadata": {"labels": {names.LABEL_GROUP: "x"}}},
                           "application/merge-patch+json")  # fmt: skip
        await Reconciler(api).reconcile(cluster.group("c"))  # type: ignore[arg-type]
        secret = cluster.objects("v1/secrets")["c-credentials"]
        assert secret_token(secret) == token and secret["metadata"]["labels"][names.LABEL_GROUP] == "c"
        # A rotation (docs/security.md: `token` new, `previous` the old one, the rotation's start annotated) is kept
        # whole: the operator never writes `previous` nor drops it.
        rotated = base64.b64encode(b"rotated-by-hand").decode()
        previous = base64.b64encode(token.encode()).decode()
        await cluster.call("PATCH", secret_path, {"data": {"token": rotated, "previous": previous},
                                                  "metadata": {"annotations": {ROTATED_AT: "2026-11-26T12:00:00Z"}}},
                           "application/merge-patch+json")  # fmt: skip
        await Reconciler(api).reconcile(cluster.group("c"))  # type: ignore[arg-type]
        await Reconciler(api).reconcile(cluster.group("c"))  # type: ignore[arg-type]
        secret = cluster.objects("v1/secrets")["c-credentials"]
        assert secret_token(secret) == "rotated-by-hand" and secret["data"]["previous"] == previous
        assert secret["metadata"]["annotations"][ROTATED_AT] == "2026-11-26T12:00:00Z"
        # Finished (`previous` dropped): stays dropped.
        await cluster.call("PATCH", secret_path, {"data": {"previous": None}}, "application/merge-patch+json")
        await Reconciler(api).reconcile(cluster.group("c"))  # type: ignore[arg-type]
        secret = cluster.objects("v1/secrets")["c-credentials"]
        assert secret_token(secret) == "rotated-by-hand" and "previous" not in secret["data"]
        # A Secret left without a token gets a new one (its pods could not start without).
        await cluster.call("PATCH", secret_path, {"data": {"token": None}}, "application/merge-patch+json")
        await Reconciler(api).reconcile(cluster.group("c"))  # type: ignore[arg-type]
        fresh = secret_token(cluster.objects("v1/secrets")["c-credentials"])
        assert fresh is not None and fresh not in (token, "rotated-by-hand")
    finally:
        await api.close()
    # Only the agent (the Secret as a volume) and the engine container (its env) reference it.
    for pod in cluster.pods().values():
        mounted = {
            v["name"] for v in pod["spec"]["volumes"] if v.get("secret", {}).get("secretName") == "c-credentials"
        }
        containers = [*pod["spec"]["initContainers"], *pod["spec"]["containers"]]
        by_env = {c["name"] for c in containers
                  if any("secretKeyRef" in (e.get("valueFrom") or {}) for e in c.get("env") or [])}  # fmt: skip
        by_mount = {c["name"] for c in containers if mounted & {m["name"] for m in c.get("volumeMounts") or []}}
        role = pod["metadata"]["labels"][names.LABEL_ROLE]
        assert by_mount == {"weightsync-agent"}
        assert by_env == (set() if role == "trainer" else {"engine"})


NETPOLS = "networking.k8s.io/v1/networkpolicies"
NETPOL_PATH = f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies"


async def test_the_network_policy_is_kept_as_built_and_removed_only_when_its_group_opts_out(cluster: Cluster) -> None:
    group = GroupBuilder("n", NS).trainers(1).engines(1).build()
    await cluster.create_group(group)
    api = KubeApi(lambda: kopf.ConnectionInfo(server=str(cluster.k.url)))
    try:
        await Reconciler(api).reconcile(group)
        built = cluster.objects(NETPOLS)["n-ingress"]
        assert built["metadata"]["ownerReferences"][0]["uid"] == group["metadata"]["uid"]
        # Someone opens it to everyone: the next reconcile puts the rules back.
        await cluster.call("PATCH", f"{NETPOL_PATH}/n-ingress", {"spec": {"ingress": [{}]}},
                           "application/merge-patch+json")  # fmt: skip
        await Reconciler(api).reconcile(cluster.group("n"))  # type: ignore[arg-type]
        assert cluster.objects(NETPOLS)["n-ingress"]["spec"] == built["spec"]
        # The group opts out: its policy goes.
        await cluster.patch_group("n", {"spec": {"networkPolicy": {"enabled": False}}})
        await Reconciler(api).reconcile(cluster.group("n"))  # type: ignore[arg-type]
        assert "n-ingress" not in cluster.objects(NETPOLS)
        # A policy of that name the group does not control (the users' own) is never deleted.
        theirs = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "n-ingress", "namespace": NS},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
        }
        await cluster.call("POST", NETPOL_PATH, theirs)
        await Reconciler(api).reconcile(cluster.group("n"))  # type: ignore[arg-type]
        assert cluster.objects(NETPOLS)["n-ingress"]["spec"] == theirs["spec"]
    finally:
        await api.close()


# --- Scale: the pod index, bounded concurrent creates, early status --------------------------------


class GaugedApi(KubeApi):
    """The real client, with pod creates slowed down and their concurrency recorded."""

    def __init__(self, server: str, delay: float) -> None:
        super().__init__(lambda: kopf.ConnectionInfo(server=server))
        self.delay = delay
        self.inflight = 0
        self.peak = 0

    async def create(self, obj: Any) -> dict[str, Any]:
        if obj.get("kind") != "Pod":
            return await super().create(obj)
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        try:
            await asyncio.sleep(self.delay)
            return await super().create(obj)
        finally:
            self.inflight -= 1


def requests(cluster: Cluster, action: str, resource: str, subresource: str | None = None) -> list[Any]:
    return [
        r
        for r in cluster.k
        if r.action is not None
        and r.action.value == action.upper()
        and r.resource is not None
        and r.resource.plural == resource
        and r.subresource == subresource
    ]


async def test_pods_are_created_concurrently_within_the_bound_and_status_comes_first(cluster: Cluster) -> None:
    group = GroupBuilder("s", NS).trainers(6).engines(6).build()
    await cluster.create_group(group)
    api = GaugedApi(str(cluster.k.url), delay=0.15)
    reconciler = Reconciler(api, pods=PodIndex(), create_concurrency=3, status_interval=0.1)
    try:
        result = await reconciler.reconcile(group)
    finally:
        await api.close()
    assert result.problem is None and len(cluster.pods()) == 12
    assert api.peak == 3  # 12 slow creates, never more than 3 at once
    status_writes = requests(cluster, "update", "weightsyncgroups", "status")  # kmock: a PATCH is an UPDATE
    first_create = min(r.id for r in requests(cluster, "create", "pods"))
    early = [r for r in status_writes if r.id < first_create]
    # The desired counts are in the status before any pod is created ...
    assert len(early) == 1
    assert early[0].data["status"]["trainers"] == {"desired": 6, "ready": 0}
    assert early[0].data["status"]["engines"] == {"desired": 6, "ready": 0}
    # ... and progress is written while creates run (4 waves of 0.15 s, written at most every 0.1 s).
    during = [r for r in status_writes if first_create < r.id]
    assert len(during) >= 2


async def test_a_warm_index_means_no_list_and_an_idle_group_no_writes(cluster: Cluster) -> None:
    group = GroupBuilder("w", NS).trainers(2).engines(2).build()
    await cluster.create_group(group)
    api = KubeApi(lambda: kopf.ConnectionInfo(server=str(cluster.k.url)))
    index = PodIndex()
    reconciler = Reconciler(api, pods=index)
    try:
        await reconciler.reconcile(group)
        assert len(requests(cluster, "list", "pods")) == 1  # the one LIST that warms the index
        writes = [r for r in cluster.k if r.method != "GET"]
        for _ in range(3):  # resyncs of an idle group
            await reconciler.reconcile(cluster.group("w"))  # type: ignore[arg-type]
    finally:
        await api.close()
    assert len(requests(cluster, "list", "pods")) == 1
    assert [r for r in cluster.k if r.method != "GET"] == writes


async def test_creating_a_pod_the_index_had_not_seen_yet_is_not_an_error(cluster: Cluster) -> None:
    """Right after a start, the index may lag the cluster: 409 AlreadyExists for a pod of this very group means
    "exists", while a same-named pod of someone else's is still refused."""
    group = GroupBuilder("x", NS).trainers(2).engines(1).build()
    await cluster.create_group(group)
    api = KubeApi(lambda: kopf.ConnectionInfo(server=str(cluster.k.url)))
    try:
        await Reconciler(api).reconcile(group)
        before = {name: pod["metadata"]["uid"] for name, pod in cluster.pods().items() if "uid" in pod["metadata"]}
        lagging = PodIndex()
        lagging.seed(("ml", "x"), [], None, now=time.monotonic())  # warm, but it has seen none of the pods
        result = await Reconciler(api, pods=lagging).reconcile(cluster.group("x"))  # type: ignore[arg-type]
        assert result.problem is None, result.problem
        assert len(requests(cluster, "create", "pods")) == 6  # 3 made, 3 answered 409
        assert sorted(p["metadata"]["name"] for p in lagging.pods(("ml", "x"), time.monotonic()) or []) == sorted(
            cluster.pods()
        )
        assert {n: p["metadata"]["uid"] for n, p in cluster.pods().items() if "uid" in p["metadata"]} == before
    finally:
        await api.close()


async def test_the_startup_waits_while_the_api_server_fills_a_new_resource_cache(cluster: Cluster) -> None:
    """``429 storage is (re)initializing`` (a CRD just created) is waited out quietly; any other answer is not a
    cache filling up and ends the wait."""
    path = f"/apis/weightsync.io/v1alpha1/namespaces/{NS}/weightsyncgroups"
    filling = kmock.KubernetesError(429, "TooManyRequests", "storage is (re)initializing")
    api = KubeApi(lambda: kopf.ConnectionInfo(server=str(cluster.k.url)))
    try:
        cluster.k["list", kmock.resource(GROUPS)] << filling
        started = time.monotonic()
        assert not await wait_until_served(api, [(path, None)], timeout=1.5)  # still filling: gave up
        assert 1.0 <= time.monotonic() - started < 4
        tries = len(requests(cluster, "list", "weightsyncgroups"))
        assert 2 <= tries <= 4  # about once a second
    finally:
        await api.close()
    api = KubeApi(lambda: kopf.ConnectionInfo(server=str(cluster.k.url)))
    try:
        assert await wait_until_served(api, [(POD_PATH, names.LABEL_GROUP)], timeout=1.5)  # served: at once
    finally:
        await api.close()


async def test_an_api_server_that_does_not_answer_is_an_api_error_and_is_waited_for_at_startup() -> None:
    """A refused connection (the API server restarting) is an ``ApiError`` a reconcile reports and retries, not a
    bug with a traceback; the startup wait waits for it like for a filling cache."""
    nobody = f"https://127.0.0.1:{free_port()}"
    api = KubeApi(lambda: kopf.ConnectionInfo(server=nobody), timeout=2.0)
    try:
        with pytest.raises(ApiError) as caught:
            await api.get("/api/v1/namespaces/ns/configmaps/x")
        assert caught.value.status == UNAVAILABLE and "no answer from the API server" in str(caught.value)
        started = time.monotonic()
        assert not await wait_until_served(api, [(POD_PATH, names.LABEL_GROUP)], timeout=1.5)
        assert 1.0 <= time.monotonic() - started < 5
    finally:
        await api.close()
