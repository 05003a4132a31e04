"""The watch-fed pod index: whatever the order in which one LIST and the watch's events arrive, once every event
has arrived the index holds exactly the pods that exist, at their latest versions."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.api import names
from weightsync_operator.podindex import MAX_TOMBSTONES, PodIndex, key_of

NS, GROUP = "ml", "g"
KEY = (NS, GROUP)


def pod(name: str, version: int | None, *, group: str = GROUP, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": NS, "labels": {names.LABEL_GROUP: group}}
    if version is not None:
        meta["resourceVersion"] = str(version)
    return {"metadata": {**meta, **extra}}


def state(index: PodIndex) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["resourceVersion"] for p in index.pods(KEY, 0.0) or []}


# A history: each step creates/changes ("put") or deletes one of a few pod names, at resource version step+1.
steps = st.lists(st.tuples(st.sampled_from(["put", "delete"]), st.sampled_from(["a", "b", "c"])), max_size=25)


def replay(history: list[tuple[str, str]]) -> tuple[list[tuple[str, dict[str, Any]]], list[dict[str, str]]]:
    """The watch events of ``history`` and the true state after each prefix (what a LIST served then shows)."""
    events: list[tuple[str, dict[str, Any]]] = []
    truth: dict[str, str] = {}
    states = [dict(truth)]
    for version, (wanted, name) in enumerate(history, start=1):
        if wanted == "put" or name not in truth:  # deleting what is not there: a create instead
            events.append(("MODIFIED" if name in truth else "ADDED", pod(name, version)))
            truth[name] = str(version)
        else:
            events.append(("DELETED", pod(name, version)))
            del truth[name]
        states.append(dict(truth))
    return events, states


@settings(max_examples=300, deadline=None)
@given(history=steps, data=st.data())
def test_any_interleaving_of_the_list_and_the_watch_converges(history: list[tuple[str, str]], data: Any) -> None:
    events, states = replay(history)
    served_at = data.draw(st.integers(0, len(events)), label="events the LIST had seen")
    seeded_after = data.draw(st.integers(0, len(events)), label="events delivered before the LIST's answer")
    listed = [pod(name, int(version)) for name, version in states[served_at].items()]
    index = PodIndex()
    assert index.pods(KEY, 0.0) is None  # cold until the first LIST
    for event_type, body in events[:seeded_after]:
        index.observe(event_type, body)
    index.seed(KEY, listed, served_at, now=0.0)
    for event_type, body in events[seeded_after:]:
        index.observe(event_type, body)
    assert state(index) == states[-1]


@given(history=steps)
def test_a_redelivered_old_event_never_undoes_a_newer_one(history: list[tuple[str, str]]) -> None:
    events, states = replay(history)
    index = PodIndex()
    index.seed(KEY, [], 0, now=0.0)
    for event_type, body in events:
        index.observe(event_type, body)
    for event_type, body in events:  # e.g. a watch restarted from an older resource version
        index.observe(event_type, body)
    assert state(index) == states[-1]


def test_cold_until_listed_and_again_after_the_relist_period() -> None:
    index = PodIndex(relist_seconds=600)
    index.observe(None, pod("a", 5))  # kopf's initial listing: not known to be complete
    assert index.pods(KEY, 0.0) is None
    index.seed(KEY, [pod("a", 5), pod("b", 6)], 6, now=100.0)
    assert sorted(p["metadata"]["name"] for p in index.pods(KEY, 699.0) or []) == ["a", "b"]
    assert index.pods(KEY, 700.0) is None  # time to LIST again (watch gaps can hide deletions)
    index.forget(KEY)
    assert index.pods(KEY, 100.0) is None


def test_groups_and_namespaces_are_apart_and_unlabelled_pods_ignored() -> None:
    index = PodIndex()
    index.seed(KEY, [pod("a", 1), pod("x", 2, group="other")], 2, now=0.0)  # the other group's pod is not ours
    assert index.observe("ADDED", pod("y", 3, group="other")) == (NS, "other")
    assert index.observe("ADDED", {"metadata": {"name": "z", "namespace": NS}}) is None
    assert state(index) == {"a": "1"}
    assert key_of(pod("a", 1)) == KEY


def test_pods_are_stored_without_managed_fields() -> None:
    index = PodIndex()
    index.seed(KEY, [], 0, now=0.0)
    index.observe("ADDED", pod("a", 1, managedFields=[{"manager": "kubectl"}]))
    (stored,) = index.pods(KEY, 0.0) or []
    assert "managedFields" not in stored["metadata"]


def test_versions_that_are_not_numbers_are_taken_as_newest() -> None:
    index = PodIndex()
    index.seed(KEY, [pod("a", 7)], 7, now=0.0)
    index.observe("MODIFIED", {"metadata": {**pod("a", None)["metadata"], "resourceVersion": "opaque"}})
    assert state(index) == {"a": "opaque"}


def test_tombstones_are_bounded() -> None:
    index = PodIndex()
    index.seed(KEY, [], 0, now=0.0)
    for i in range(MAX_TOMBSTONES + 10):
        index.observe("DELETED", pod(f"p{i}", i + 1))
    index.observe("ADDED", pod("p0", 0))  # its tombstone was dropped: an old event can no longer be refused
    assert state(index) == {"p0": "0"}
