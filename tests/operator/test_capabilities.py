"""The operator's capability check: a spec its adapter cannot serve is a fatal problem naming both."""

from __future__ import annotations

import pytest
from builders import GroupBuilder

from weightsync.api import engines
from weightsync.api.engines import Capabilities, EngineKind, Request
from weightsync_operator.capabilities import capability_problem


def test_the_reference_adapter_serves_every_transfer() -> None:
    for mode in engines.SYNC_MODES:
        for staging in engines.STAGINGS:
            group = GroupBuilder().set("transfer.mode", mode).set("transfer.targetStaging", staging).model()
            assert capability_problem(group.spec) is None, (mode, staging)


def test_sglang_asked_to_stage_is_a_fatal_problem_that_names_it() -> None:
    # Stock SGLang has no staging area: its adapter syncs live weights only.
    problem = capability_problem(GroupBuilder().adapter("sglang").set("transfer.targetStaging", "staged").model().spec)
    assert problem is not None and problem.fatal
    assert problem.reason == "AdapterLacksCapability"
    assert "'sglang'" in problem.message and "transfer.targetStaging 'staged'" in problem.message
    assert capability_problem(GroupBuilder().adapter("sglang").model().spec) is None


def test_the_request_is_read_from_spec_transfer() -> None:
    group = (
        GroupBuilder()
        .set("transfer.mode", "broadcast")
        .set("transfer.targetStaging", "staged")
        .set("transfer.verify", False)
        .model()
    )
    assert group.spec.transfer.request == Request(mode="broadcast", staging="staged", verify=False)
    assert GroupBuilder().model().spec.transfer.request == Request(mode="p2p", staging="live", verify=True)


def test_a_missing_capability_names_adapter_and_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    caps = Capabilities(modes=frozenset({"p2p"}), staging=frozenset({"live"}), verify="bucket-xxh3", catch_up=True)
    monkeypatch.setitem(engines.ENGINE_KINDS, "reference", EngineKind("reference", caps))
    problem = capability_problem(GroupBuilder().set("transfer.mode", "broadcast").model().spec)
    assert problem is not None and problem.fatal and problem.reason == "AdapterLacksCapability"
    assert "'reference'" in problem.message and "transfer.mode 'broadcast'" in problem.message
    assert capability_problem(GroupBuilder().model().spec) is None
