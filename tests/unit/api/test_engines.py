"""The engine-kind contract: ``refusal`` says why an adapter cannot serve a request, naming both."""

from __future__ import annotations

import pytest

from weightsync.api import engines
from weightsync.api.engines import ADAPTERS, ENGINE_KINDS, Capabilities, EngineKind, Request, refusal

#: A made-up kind with one of everything, so each refusal branch is reachable on its own.
NARROW = Capabilities(modes=frozenset({"p2p"}), staging=frozenset({"live"}), verify="none", catch_up=False)


@pytest.fixture
def narrow(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(engines.ENGINE_KINDS, "narrow", EngineKind("narrow", NARROW))  # type: ignore[misc, arg-type]
    return "narrow"


def test_every_adapter_has_a_kind() -> None:
    assert set(ENGINE_KINDS) == set(ADAPTERS)
    for adapter, kind in ENGINE_KINDS.items():
        assert kind.adapter == adapter
        assert kind.capabilities is not None or kind.unavailable


def test_unknown_adapter() -> None:
    refused = refusal("trtllm", Request("p2p", "live", verify=True))
    assert refused is not None and refused.reason == "UnknownAdapter"
    assert "'trtllm'" in refused.message and "sglang" in refused.message and "reference" in refused.message


def test_unavailable_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    planned = EngineKind("planned", None, unavailable="planned for a later version")  # type: ignore[arg-type]
    monkeypatch.setitem(engines.ENGINE_KINDS, "planned", planned)  # type: ignore[misc, arg-type]
    refused = refusal("planned", Request("p2p", "live", verify=True))
    assert refused is not None and refused.reason == "AdapterUnavailable"
    assert "'planned' has no weightsync adapter yet: planned for a later version" in refused.message


def test_stock_sglang_syncs_live_in_p2p_and_broadcast_never_staged() -> None:
    for mode in ("p2p", "broadcast"):
        assert refusal("sglang", Request(mode, "live", verify=True)) is None  # type: ignore[arg-type]
        refused = refusal("sglang", Request(mode, "staged", verify=True))  # type: ignore[arg-type]
        assert refused is not None and refused.reason == "AdapterLacksCapability" and "'sglang'" in refused.message
        assert "transfer.targetStaging 'staged'" in refused.message and "supports live" in refused.message


def test_stock_vllm_syncs_both_ways_in_p2p_and_live_in_broadcast() -> None:
    assert refusal("vllm", Request("p2p", "staged", verify=True)) is None  # the plugin's receive buffer
    assert refusal("vllm", Request("p2p", "live", verify=True)) is None  # the plugin's live parameters
    assert refusal("vllm", Request("broadcast", "live", verify=True)) is None
    staged = refusal("vllm", Request("broadcast", "staged", verify=True))
    assert staged is not None and staged.reason == "AdapterLacksCapability"
    assert "'staged' in transfer.mode 'broadcast'" in staged.message and "supports live)" in staged.message


def test_lacking_mode(narrow: str) -> None:
    refused = refusal(narrow, Request("broadcast", "live", verify=False))
    assert refused is not None and refused.reason == "AdapterLacksCapability"
    assert "'narrow'" in refused.message and "transfer.mode 'broadcast'" in refused.message
    assert "supports p2p" in refused.message


def test_lacking_staging(narrow: str) -> None:
    refused = refusal(narrow, Request("p2p", "staged", verify=False))
    assert refused is not None and refused.reason == "AdapterLacksCapability"
    assert "'narrow'" in refused.message and "transfer.targetStaging 'staged'" in refused.message
    assert "supports live" in refused.message


def test_lacking_verification(narrow: str) -> None:
    refused = refusal(narrow, Request("p2p", "live", verify=True))
    assert refused is not None and refused.reason == "AdapterLacksCapability"
    assert "'narrow'" in refused.message and "transfer.verify" in refused.message


def test_what_the_adapter_can_do_is_not_refused(narrow: str) -> None:
    assert refusal(narrow, Request("p2p", "live", verify=False)) is None
    for mode in engines.SYNC_MODES:
        for staging in engines.STAGINGS:
            assert refusal("reference", Request(mode, staging, verify=True)) is None


def test_the_first_missing_capability_wins(narrow: str) -> None:
    refused = refusal(narrow, Request("broadcast", "staged", verify=True))
    assert refused is not None and "transfer.mode" in refused.message
