"""What a kubelet makes of a container spec (weightsync_testing.container_spec): Kubernetes' $(VAR) rules, the
downward API and Secret references, and refusals of what a local runner cannot do."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync_testing.container_spec import (
    ContainerSpecError,
    PodFacts,
    container_argv,
    container_env,
    expand,
)

POD = PodFacts(name="g-engine-0-1", namespace="ns", ip="10.0.0.9", node="kwok-node-1")


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("$(A)", "1"),
        ("x$(A)y$(B)z", "x1y22z"),
        ("$$(A)", "$(A)"),  # escaped
        ("$(MISSING)", "$(MISSING)"),  # undefined: as written
        ("$(A", "$(A"),  # unclosed: literal
        ("a$b$", "a$b$"),
        ("$$$(A)", "$1"),
    ],
)
def test_expansion_follows_kubernetes(text: str, want: str) -> None:
    assert expand(text, {"A": "1", "B": "22"}) == want


@given(st.text(alphabet="ab()X{} ", max_size=30), st.dictionaries(st.sampled_from("abX"), st.text(max_size=5)))
def test_text_without_a_dollar_is_never_changed(text: str, variables: dict[str, str]) -> None:
    assert expand(text, variables) == text


@given(st.lists(st.sampled_from(["A", "B", "x", "-"]), max_size=8))
def test_every_reference_to_a_known_name_is_replaced(names: list[str]) -> None:
    variables = {"A": "1", "B": "$(A)"}  # a value is not expanded again
    text = "".join(f"$({n})" if n in variables else n for n in names)
    assert expand(text, variables) == "".join(variables.get(n, n) for n in names)


def test_env_expands_from_earlier_variables_only_and_resolves_the_downward_api_and_secrets() -> None:
    container = {
        "name": "sglang",
        "env": [
            {"name": "WEIGHTSYNC_GROUP_TOKEN", "valueFrom": {"secretKeyRef": {"name": "g-cred", "key": "token"}}},
            {"name": "LATER_FIRST", "value": "$(RANK)"},  # RANK is defined after it: stays as written
            {"name": "RANK", "value": "1"},
            {"name": "BIND", "value": "cpu$(RANK)"},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "command": ["python", "-m", "x", "--rank", "$(RANK)", "--key", "$(WEIGHTSYNC_GROUP_TOKEN)"],
        "args": ["--at", "$(POD_IP)", "$(LATER_FIRST)"],
    }
    read = []

    def secrets(namespace: str, name: str, key: str) -> str:
        read.append((namespace, name, key))
        return "s3cret"

    env = container_env(container, POD, secrets)
    assert env == {"WEIGHTSYNC_GROUP_TOKEN": "s3cret", "LATER_FIRST": "$(RANK)", "RANK": "1", "BIND": "cpu1",
                   "POD_IP": "10.0.0.9", "NAME": "g-engine-0-1"}  # fmt: skip
    assert read == [("ns", "g-cred", "token")]
    assert container_argv(container, env) == [
        "python", "-m", "x", "--rank", "1", "--key", "s3cret", "--at", "10.0.0.9", "$(RANK)"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("container", "says"),
    [
        ({"name": "c", "envFrom": [{"configMapRef": {"name": "m"}}]}, "envFrom is not supported"),
        ({"name": "c", "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "m", "key": "k"}}}]},
         "from ['configMapKeyRef'] is not supported"),
        ({"name": "c", "env": [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}]},
         "fieldRef status.hostIP"),
        ({"name": "c", "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]},
         "X needs a secret reader"),
    ],
)  # fmt: skip
def test_what_a_local_runner_cannot_resolve_is_refused_by_name(container: dict[str, object], says: str) -> None:
    with pytest.raises(ContainerSpecError, match=says.replace("[", r"\[").replace("]", r"\]")):
        container_env(container, POD, None)


def test_a_container_without_a_command_is_refused() -> None:
    with pytest.raises(ContainerSpecError, match="no command"):
        container_argv({"name": "c", "args": ["x"]}, {})
