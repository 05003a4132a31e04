"""The groups' pods, kept in memory from the operator's pod watch: what a reconcile reads instead of a LIST.

Why: a LIST of a 1,024-pod group is ~8 MB of JSON and ~0.4 CPU-s to decode, and a reconcile used to make two;
idle cost grew with pods times resyncs. kopf already watches every pod labelled ``weightsync.io/group`` (the
``pod_event`` handler); each event lands here, so a reconcile reads the group's pods for free.

Warmness: kopf delivers the existing pods as events when its watch starts, but nothing tells when that initial
listing is complete for a given group. So a group is *cold* until the reconciler has LISTed its pods once
(:meth:`PodIndex.seed`), after every operator start, and again after ``relist_seconds`` (a safety net: a watch
that reconnects after its resource version expired re-lists without telling which objects vanished meanwhile,
so a pod deleted during the gap would otherwise stay in the index). Between those LISTs the index is the truth.

Ordering: the LIST and the watch are two streams; an event may arrive after a LIST that already contains a
newer state of the pod. Every stored pod and every deletion (a tombstone) keeps its ``resourceVersion``, and an
update older than what is stored is dropped. Resource versions are compared as integers, as etcd issues them;
one that is not an integer is taken as newest (an API server that is not etcd-backed gives up the ordering, not
correctness: the next LIST repairs it). Pure (no I/O, the clock is an argument); the handlers feed it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from weightsync.api import names

Key = tuple[str, str]  # (namespace, group)

#: At most this many tombstones per group (oldest dropped): they only matter between a LIST and the watch.
MAX_TOMBSTONES = 4096


def resource_version(obj: Mapping[str, Any]) -> int | None:
    raw = (obj.get("metadata") or {}).get("resourceVersion")
    try:
        return int(str(raw))
    except (TypeError, ValueError):
        return None


def _older(incoming: int | None, stored: int | None) -> bool:
    """Whether ``incoming`` is strictly older than ``stored`` (unknown versions are never older)."""
    return incoming is not None and stored is not None and incoming < stored


def key_of(pod: Mapping[str, Any]) -> Key | None:
    meta = pod.get("metadata") or {}
    group = (meta.get("labels") or {}).get(names.LABEL_GROUP)
    if not group or not meta.get("name"):
        return None
    return str(meta.get("namespace") or ""), str(group)


def slim(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The pod without ``managedFields`` (about a third of a pod's bytes, never read by the operator)."""
    out = dict(pod)
    meta = dict(out.get("metadata") or {})
    meta.pop("managedFields", None)
    out["metadata"] = meta
    return out


@dataclass
class _Group:
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: name -> resourceVersion of its deletion (None when unknown).
    gone: dict[str, int | None] = field(default_factory=dict)
    #: When the group was last seeded from a LIST (None: cold).
    seeded_at: float | None = None


class PodIndex:
    def __init__(self, *, relist_seconds: float = 600.0) -> None:
        self.relist_seconds = relist_seconds
        self._groups: dict[Key, _Group] = {}

    def observe(self, event_type: str | None, pod: Mapping[str, Any]) -> Key | None:
        """One watch event (``ADDED``/``MODIFIED``/``DELETED``, or None for kopf's initial listing).
        Returns the pod's group, or None for a pod without one."""
        key = key_of(pod)
        if key is None:
            return None
        name = str(pod["metadata"]["name"])
        entry = self._groups.setdefault(key, _Group())
        version = resource_version(pod)
        stored = entry.pods.get(name)
        if stored is not None and _older(version, resource_version(stored)):
            return key
        if name in entry.gone and _older(version, entry.gone[name]):
            return key
        if event_type == "DELETED":
            entry.pods.pop(name, None)
            entry.gone[name] = version
            if len(entry.gone) > MAX_TOMBSTONES:
                del entry.gone[next(iter(entry.gone))]
        else:
            entry.pods[name] = slim(pod)
            entry.gone.pop(name, None)
        return key

    def seed(self, key: Key, pods: Iterable[Mapping[str, Any]], list_version: int | None, now: float) -> None:
        """The group's pods as a LIST returned them, at collection resource version ``list_version``.

        The LIST is the truth at ``list_version``; what the watch delivered that is newer is kept (a pod created
        or changed after the LIST, a deletion the LIST still showed)."""
        entry = self._groups.setdefault(key, _Group())
        fresh: dict[str, dict[str, Any]] = {}
        for pod in pods:
            if key_of(pod) != key:
                continue
            name = str(pod["metadata"]["name"])
            version = resource_version(pod)
            stored = entry.pods.get(name)
            if stored is not None and _older(version, resource_version(stored)):
                fresh[name] = stored
            elif name in entry.gone and _older(version, entry.gone[name]):
                continue  # deleted after the LIST was served
            else:
                fresh[name] = slim(pod)
        for name, stored in entry.pods.items():
            if name not in fresh and _older(list_version, resource_version(stored)):
                fresh[name] = stored  # created after the LIST was served
        entry.pods = fresh
        entry.gone = {n: v for n, v in entry.gone.items() if _older(list_version, v)}
        entry.seeded_at = now

    def pods(self, key: Key, now: float) -> list[dict[str, Any]] | None:
        """The group's pods, or None while the group is cold (never LISTed since start, or not for a while)."""
        entry = self._groups.get(key)
        if entry is None or entry.seeded_at is None or now - entry.seeded_at >= self.relist_seconds:
            return None
        return list(entry.pods.values())

    def forget(self, key: Key) -> None:
        self._groups.pop(key, None)

    def __len__(self) -> int:
        return sum(len(g.pods) for g in self._groups.values())


__all__ = ["Key", "PodIndex", "key_of", "resource_version", "slim"]
