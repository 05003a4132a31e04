"""The group's NetworkPolicy: who may open a connection to the group's pods, and on which ports.

Ingress only (``policyTypes: [Ingress]``), to every pod labelled ``weightsync.io/group=<group>``:

* from the group's own pods: the agent port, the engine's HTTP port and the pinned Mooncake range
  (``transfer.mooncakePorts``), which is all p2p rounds use. A broadcast group gets *every* port from its own
  pods instead: torch.distributed's gloo/NCCL sockets listen on ephemeral ports nobody can pin.
* from ``networkPolicy.agentPeers``: the agent port (a Prometheus scraping ``/metrics``).
* from ``networkPolicy.enginePeers``: the engine's HTTP port (clients calling ``/generate``).

Nothing else reaches the group's pods through the pod network (kubelet probes come from the node, which
common CNIs admit whatever the policy says). The builder is pure; docs/security.md says why each rule exists.

A p2p group whose trainer spans pods (``trainer.replicas`` > 1), or whose engines do (``ranksPerEngine`` >
``ranksPerPod``), also gets a **mesh** policy per such role (:func:`build_mesh_policies`): its pods admit each other
on every port, as torchrun's rendezvous and the jobs' own gloo/NCCL sockets need (ephemeral ports nobody pins).
Its subject is that role's pods only, so a trainer pod still reaches an engine pod only on the ports above.
Engine pods of different engines of one group reach each other too: one policy cannot tell engines apart without a
policy per engine, and they run the same image under the same group's credential.
"""

from __future__ import annotations

from weightsync.api import names
from weightsync.api.v1alpha1 import NetworkPeer, WeightSyncGroup
from weightsync_operator.builders.common import JsonDict, object_meta


def _tcp(port: int, end: int | None = None) -> JsonDict:
    out: JsonDict = {"protocol": "TCP", "port": port}
    if end is not None and end != port:
        out["endPort"] = end
    return out


def _peer(peer: NetworkPeer) -> JsonDict:
    # Empty lists and maps left out, as the API server stores them: the reconciler compares what it built
    # with what it reads back, and a difference would be patched again on every pass.
    return peer.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)


def group_pods(group: WeightSyncGroup) -> JsonDict:
    """The selector of the group's pods: the policy's subject and its first peer."""
    return {"matchLabels": {names.LABEL_GROUP: group.metadata.name}}


def build_network_policy(group: WeightSyncGroup) -> JsonDict | None:
    """The policy, or None when ``networkPolicy.enabled`` is false (the users manage their own)."""
    spec = group.spec
    policy = spec.network_policy
    if not policy.enabled:
        return None
    own = {"podSelector": group_pods(group)}
    agent, engine, mooncake = spec.agent.port, spec.inference.port, spec.transfer.mooncake_ports
    ingress: list[JsonDict] = []
    if spec.transfer.mode == "broadcast":
        ingress.append({"from": [own]})  # no "ports": every port, for the collective's ephemeral sockets
    else:
        ports = [_tcp(agent)]
        if engine != agent:
            ports.append(_tcp(engine))
        ports.append(_tcp(mooncake.start, mooncake.end))
        ingress.append({"from": [own], "ports": ports})
    if policy.agent_peers:
        ingress.append({"from": [_peer(p) for p in policy.agent_peers], "ports": [_tcp(agent)]})
    if policy.engine_peers:
        ingress.append({"from": [_peer(p) for p in policy.engine_peers], "ports": [_tcp(engine)]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(group, names.network_policy(group.metadata.name)),
        "spec": {"podSelector": group_pods(group), "policyTypes": ["Ingress"], "ingress": ingress},
    }


#: The roles whose pods may form one multi-pod job.
MESH_ROLES: tuple[names.Role, ...] = ("trainer", "engine")


def spans_pods(group: WeightSyncGroup, role: names.Role) -> bool:
    """Whether ``role``'s job (the trainer, or each engine) runs over more than one pod."""
    spec = group.spec
    return spec.trainer.replicas > 1 if role == "trainer" else spec.inference.pods_per_engine > 1


def build_mesh_policies(group: WeightSyncGroup) -> dict[names.Role, JsonDict]:
    """The mesh policy of each role whose job spans pods, in a p2p group with the fence on (a broadcast group's
    fence admits every port between its pods already). Roles left out have none (the reconciler deletes ours)."""
    spec = group.spec
    if not spec.network_policy.enabled or spec.transfer.mode == "broadcast":
        return {}
    out: dict[names.Role, JsonDict] = {}
    for role in MESH_ROLES:
        if not spans_pods(group, role):
            continue
        members = {"matchLabels": {names.LABEL_GROUP: group.metadata.name, names.LABEL_ROLE: role}}
        out[role] = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": object_meta(group, names.mesh_policy(group.metadata.name, role)),
            # No "ports": every port, from the role's own pods only.
            "spec": {
                "podSelector": members,
                "policyTypes": ["Ingress"],
                "ingress": [{"from": [{"podSelector": members}]}],
            },
        }
    return out
