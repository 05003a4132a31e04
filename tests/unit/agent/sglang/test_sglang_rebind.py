"""Buffers SGLang re-derives itself (Gemma-2's ``gemma_weight``) through weightsync's custom weight loader
(weightsync_agent/targets/sglang/manifest.py and adapter.py; docs/engines/sglang.md).

The trace marks a refused buffer ``rederived_by`` SGLang's own ``_rebind_parameter_aliases`` when that function brings
it back bit for bit. The manifest accepts such buffers only from a server started with ``--custom-weight-loader``
naming the loader, and lists them; without the flag the refusal stands and says which flag syncs it; any other
refusal stands either way. A round into such a model asks SGLang for the rebind after the writes, before the session's
end; a failed rebind fails the commit before the session ends or the version moves.
"""

from __future__ import annotations

import base64
import pickle
from typing import Any

import pytest

from weightsync_agent.http.client import HttpCallError
from weightsync_agent.layout.manifest import Manifest
from weightsync_agent.targets.adapter import AdapterSettings
from weightsync_agent.targets.sglang.adapter import EMPTY_TENSORS, SglangAdapter
from weightsync_agent.targets.sglang.manifest import REBIND_LOADER, REDERIVED_BY, TraceRefusedError, assemble, rebinds

PART = {"source": "model.norm.weight", "full_shape": [8], "dim": 0, "start": 0, "length": 8}
TENSOR = {"name": "model.norm.weight", "dtype": "float32", "shape": [8], "parts": [PART]}
STALE = "buffer changed by load_weights(model.norm.weight): a one-sided write of the parameters would leave it stale"
REBOUND = {"name": "model.norm.gemma_weight", "reason": STALE, "rederived_by": REDERIVED_BY}
OTHER = {"name": "model.act.beta", "reason": STALE}
PUBLISHED = {"model.norm.weight": [4096, 8, 4]}


def manifest(refused: list[dict[str, Any]], *, rebind: bool) -> Manifest:
    trace = {"tensors": [TENSOR], "refused": refused}
    return assemble(0, 0, trace, "127.0.0.1:1", PUBLISHED, device="cpu", rebind=rebind)


def test_a_rebound_buffer_is_accepted_and_listed_only_from_a_server_that_runs_the_rebind() -> None:
    accepted = manifest([REBOUND], rebind=True)
    assert accepted.rederived == ("model.norm.gemma_weight",)
    assert [t.name for t in accepted.tensors] == ["model.norm.weight"]  # the buffer is never written
    assert manifest([], rebind=True).rederived == ()
    with pytest.raises(
        TraceRefusedError, match=rf"gemma_weight: buffer changed .*--custom-weight-loader {REBIND_LOADER}"
    ):
        manifest([REBOUND], rebind=False)


def test_every_other_refusal_stands_with_or_without_the_rebind() -> None:
    for rebind in (True, False):
        with pytest.raises(TraceRefusedError, match=r"model\.act\.beta: buffer changed"):
            manifest([REBOUND, OTHER], rebind=rebind)
    with pytest.raises(TraceRefusedError, match=r"model\.act\.beta"):
        manifest([{**OTHER, "rederived_by": "something else"}], rebind=True)


@pytest.mark.parametrize(
    ("info", "runs"),
    [
        ({"custom_weight_loader": [REBIND_LOADER]}, True),
        ({"custom_weight_loader": ["other.loader", REBIND_LOADER]}, True),
        ({"custom_weight_loader": []}, False),
        ({"custom_weight_loader": None}, False),
        ({"custom_weight_loader": REBIND_LOADER}, False),  # a string is not SGLang's list
        ({}, False),
    ],
)
def test_the_server_info_says_whether_the_rebind_runs(info: dict[str, Any], runs: bool) -> None:
    assert rebinds(info) is runs


def test_the_empty_payload_is_an_empty_tensor_list_as_sglang_reads_it() -> None:
    raw = base64.b64decode(EMPTY_TENSORS, validate=True)
    assert raw[0] == 0x80 and raw[1] <= pickle.HIGHEST_PROTOCOL  # SGLang's "looks like a pickle" test
    assert pickle.loads(raw) == []


class FakeClient:
    """Records the adapter's calls; the rebind route fails when ``fail``."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail = fail
        self.base_url = "http://sglang"

    def request(self, method: str, route: str, body: Any = None, timeout: float | None = None) -> tuple[int, Any]:
        self.calls.append((route, body))
        if self.fail and route == "/update_weights_from_tensor":
            raise HttpCallError(route, 400, "custom loader raised")
        return 200, {"success": True}

    def weight_version(self, timeout: float | None = None) -> str:
        return "0"

    def update_weight_version(self, version: str, *, abort_all_requests: bool, timeout: float) -> None:
        self.calls.append(("/update_weight_version", {"version": version}))


def adapter(rederived: bool, mode: str = "p2p", fail: bool = False) -> tuple[SglangAdapter, FakeClient]:
    sg = SglangAdapter(AdapterSettings(engine=0, url="http://sglang", ranks=2, bucket_bytes=1 << 20, mode=mode))  # type: ignore[arg-type]
    client = FakeClient(fail)
    sg.client = client  # type: ignore[assignment]
    for rank in range(2):
        sg._manifests[rank] = manifest([REBOUND] if rederived else [], rebind=True)
    return sg, client


def test_a_commit_into_such_a_model_has_sglang_rebind_after_the_writes_before_the_end_and_the_label() -> None:
    sg, client = adapter(rederived=True)
    sg.commit(1, 5.0, round_id="r")
    routes = [route for route, _ in client.calls]
    assert routes == ["/update_weights_from_tensor", "/end_weight_update", "/update_weight_version"]
    body = client.calls[0][1]
    assert body == {"serialized_named_tensors": [EMPTY_TENSORS] * 2, "load_format": REBIND_LOADER,
                    "flush_cache": False, "abort_all_requests": False}  # fmt: skip


@pytest.mark.parametrize(("rederived", "mode"), [(False, "p2p"), (True, "broadcast")])
def test_no_rebind_where_nothing_is_rederived_or_sglang_loaded_the_tensors_itself(rederived: bool, mode: str) -> None:
    sg, client = adapter(rederived=rederived, mode=mode)
    sg.commit(1, 5.0, round_id="r")
    assert [route for route, _ in client.calls] == ["/end_weight_update", "/update_weight_version"]


def test_a_failed_rebind_fails_the_commit_before_the_session_ends_or_the_version_moves() -> None:
    sg, client = adapter(rederived=True, fail=True)
    with pytest.raises(HttpCallError, match="custom loader raised"):
        sg.commit(1, 5.0, round_id="r")
    assert [route for route, _ in client.calls] == ["/update_weights_from_tensor"]
