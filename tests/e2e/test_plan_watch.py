"""The agents' plan watch against the real API server, under the agents' own Role (docs/agent.md, "The plan").

The Role the operator builds (``builders/rbac.py``) names the plan ConfigMap by resourceNames; the API server then
allows a list or watch only with the field selector ``metadata.name=<cm>``, which is what
:class:`ConfigMapPlanWatch` sends. The watch delivers a new plan within a second, refuses one over its size bound
(keeping the old), refuses one not sealed with the group's token (a self-consistent plan that whoever may edit the
ConfigMap wrote, e.g. with ``transfer.verify: false``), and costs one request per watch period while idle.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from conftest import Kube, wait_for

from weightsync.api import names
from weightsync.api.v1alpha1 import WeightSyncGroup
from weightsync.plan import Plan, plan_for, replan
from weightsync.plan.seal import seal
from weightsync_agent.http.credential import Credential
from weightsync_agent.plan_loader import ConfigMapPlanWatch
from weightsync_operator.builders.rbac import build_role, build_role_binding, build_service_account
from weightsync_tools.localcluster.cluster import ClusterState
from weightsync_tools.localcluster.standin_agents import api_client

NS = "e2e-plan-watch"
GROUP = "watched"
CM = names.plan_config_map(GROUP)
#: The group's token: what the operator seals the plan with and the agents check it by.
TOKEN = "group-token-for-the-plan-watch-test"


def group_object(engines: int) -> WeightSyncGroup:
    sleeper = {"spec": {"containers": [{"name": "main", "image": "busybox"}]}}
    return WeightSyncGroup.model_validate(
        {
            "apiVersion": "weightsync.io/v1alpha1",
            "kind": "WeightSyncGroup",
            "metadata": {"name": GROUP, "namespace": NS, "uid": "00000000-0000-0000-0000-000000000001"},
            "spec": {
                "trainer": {"replicas": 2, "ranksPerPod": 1, "template": sleeper},
                "inference": {
                    "engines": engines,
                    "ranksPerEngine": 2,
                    "ranksPerPod": 2,
                    "adapter": "reference",
                    "template": sleeper,
                },
            },
        }
    )


def apply(admin: Kube, obj: dict[str, Any]) -> None:
    obj = {**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k != "ownerReferences"}}
    admin.kubectl("-n", NS, "apply", "-f", "-", input=json.dumps(obj))


def put_plan(admin: Kube, plan: Plan, padding: int = 0, sealed_with: str | None = TOKEN) -> None:
    """Store ``plan`` (``padding`` spaces after it: the same plan, a bigger document), sealed as the operator does
    (``sealed_with`` None: not sealed, as anyone else who may edit the ConfigMap would write it)."""
    text = plan.to_json() + " " * padding
    data = {names.PLAN_KEY: text, **({names.PLAN_SEAL_KEY: seal(sealed_with, text)} if sealed_with else {})}
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": CM, "namespace": NS}, "data": data}
    admin.kubectl("-n", NS, "apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(body))


@pytest.fixture(scope="module")
def agent_api(cluster: tuple[ClusterState, Kube]) -> tuple[Any, Plan]:
    """A CoreV1Api as the group's agents (the operator's own RBAC builders), and the plan first stored."""
    state, admin = cluster
    admin.kubectl("create", "namespace", NS)
    group = group_object(2)
    for obj in (build_service_account(group), build_role(group, [f"{GROUP}-trainer-0"]), build_role_binding(group)):
        apply(admin, obj)
    plan = plan_for(group.spec, group=GROUP, namespace=NS)
    put_plan(admin, plan)
    token = admin.kubectl("-n", NS, "create", "token", names.agent_service_account(GROUP), "--duration=1h").stdout
    return api_client(state, token.strip()), plan


def test_the_watch_follows_the_plan_and_refuses_one_too_big(cluster: Any, agent_api: tuple[Any, Plan]) -> None:
    _, admin = cluster
    api, first = agent_api
    bigger = replan(first, group_object(3).spec)
    watch = ConfigMapPlanWatch(api, NS, CM, max_plan_bytes=len(bigger.to_json()) + 64, keys=Credential.fixed(TOKEN))
    try:
        assert watch.wait(10), "no plan read"
        assert watch().hash == first.hash
        put_plan(admin, bigger)
        wait_for("the new plan through the watch", lambda: watch().hash == bigger.hash, timeout=10, interval=0.05)
        too_big = replan(bigger, group_object(4).spec)
        put_plan(admin, too_big, padding=watch.max_plan_bytes)
        wait_for("the refusal", lambda: watch.refused == 1, timeout=10, interval=0.05)
        assert watch().hash == bigger.hash, "a refused plan replaced the good one"
        # Self-consistent (its own hash holds) but written by someone without the group's token: refused.
        unverified = bigger.sealed(transfer=bigger.transfer.model_copy(update={"verify": False}),
                                   revision=bigger.revision + 1)  # fmt: skip
        put_plan(admin, unverified, sealed_with=None)
        wait_for("the unsealed plan's refusal", lambda: watch.refused == 2, timeout=10, interval=0.05)
        put_plan(admin, unverified, sealed_with="another-token")
        wait_for("the wrongly sealed plan's refusal", lambda: watch.refused == 3, timeout=10, interval=0.05)
        assert watch().hash == bigger.hash and watch().transfer.verify
        # One read at the start and one watch connection: nothing per plan change, nothing per tick.
        assert watch.requests == 2, watch.requests
        # Closing wakes the thread out of its read at once (not when the watch next sends or ends: minutes).
        started = time.monotonic()
        watch.close()
        assert time.monotonic() - started < 2 and not watch._thread.is_alive()
    finally:
        watch.close()


def test_the_agents_role_allows_no_watch_of_other_config_maps(agent_api: tuple[Any, Plan]) -> None:
    from kubernetes.client.exceptions import ApiException

    api, _ = agent_api
    with pytest.raises(ApiException) as refused:
        api.list_namespaced_config_map(NS, watch=False)
    assert refused.value.status == 403
    with pytest.raises(ApiException) as refused:
        api.list_namespaced_config_map(NS, field_selector="metadata.name=kube-root-ca.crt")
    assert refused.value.status == 403
