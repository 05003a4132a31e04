"""An SGLang engine that does not publish its weights keeps its pod unready, naming the missing flag.

The stock server started WITHOUT ``--remote-instance-weight-loader-start-seed-via-transfer-engine`` (the
mistake users make, or the one SGLang makes for them when the mooncake package is missing from the image):
the engine pod's adapter reports ``EngineNotPublishing`` with a message that names the flag and the package,
instead of a pod that never turns ready for no visible reason. The same adapter on a publishing server is
ready and serves manifests for every rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from weightsync_agent.targets.adapter import AdapterSettings
from weightsync_agent.targets.engine_trace import ENV_ENGINE_PYTHON
from weightsync_agent.targets.sglang.adapter import SglangAdapter
from weightsync_testing.sglang_server import SglangProcess, launch_sglang


def _adapter(server: SglangProcess, api_key: str | None = None) -> SglangAdapter:
    settings = AdapterSettings(
        engine=0, url=server.url, ranks=1, bucket_bytes=1 << 20, engine_side=True, api_key=api_key
    )
    return SglangAdapter(settings)


def test_a_server_without_the_seed_flag_is_not_ready_and_says_which_flag(
    sglang_py: Path, tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_ENGINE_PYTHON, str(sglang_py))
    with launch_sglang(
        tiny_llama, python=sglang_py, transfer_engine=False, dtype="float32", log_dir=tmp_path
    ) as server:
        readiness = _adapter(server).readiness()
    assert not readiness.ready and readiness.reason == "EngineNotPublishing", readiness
    assert "--remote-instance-weight-loader-start-seed-via-transfer-engine" in readiness.message
    assert "mooncake" in readiness.message


def test_a_publishing_server_is_ready_with_a_manifest_per_rank(
    server: SglangProcess, sglang_py: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_ENGINE_PYTHON, str(sglang_py))
    assert server.admin_api_key, "the session server runs with --admin-api-key"
    refused = _adapter(server, api_key="not-the-key").readiness()
    assert not refused.ready and refused.reason == "EngineUnauthorized", refused
    adapter = _adapter(server, api_key=server.admin_api_key)
    readiness = adapter.readiness()
    assert readiness.ready and readiness.reason == "EngineServing", readiness
    manifest = adapter.manifest(0)
    assert manifest.checksum == "tensor-sha256-8" and manifest.session_id
    assert {t.name for t in manifest.tensors} >= {"model.embed_tokens.weight", "model.norm.weight"}
