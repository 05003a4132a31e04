"""What the vLLM live-weight adapters read from ``/server_info`` (targets/vllm/traced.py ``served_model``): the
model, TP size and dtype the trace needs, and a refusal by name where the TP-only trace does not describe the live
parameters (expert parallelism, several data-parallel replicas in one server)."""

from __future__ import annotations

from typing import Any

import pytest

from weightsync_agent.layout.manifest import ManifestError
from weightsync_agent.targets.vllm.traced import served_model


def config(**parallel: Any) -> dict[str, Any]:
    return {"model_config": {"model": "/models/m", "dtype": "torch.bfloat16"}, "parallel_config": parallel}


def test_a_tp_server_gives_the_traces_inputs() -> None:
    got = served_model(config(tensor_parallel_size=2, data_parallel_size=1, enable_expert_parallel=False), "e")
    assert got == {"model": "/models/m", "tp": "2", "dtype": "bfloat16"}
    assert served_model(config(), "e")["tp"] == "1"


@pytest.mark.parametrize(
    ("parallel", "says"),
    [
        ({"tensor_parallel_size": 2, "enable_expert_parallel": True}, "expert parallelism .*targetStaging: staged"),
        ({"tensor_parallel_size": 2, "data_parallel_size": 2}, "2 data-parallel replicas in one server"),
    ],
)
def test_parallelism_the_trace_does_not_describe_is_refused_with_the_way_that_syncs_it(
    parallel: dict[str, Any], says: str
) -> None:
    with pytest.raises(ManifestError, match=f"^engine 1: vLLM runs {says}"):
        served_model(config(**parallel), "engine 1")


def test_a_server_info_without_a_config_or_a_model_is_named() -> None:
    with pytest.raises(ManifestError, match="has no vllm_config"):
        served_model(None, "e")
    with pytest.raises(ManifestError, match="names no model"):
        served_model({"model_config": {}}, "e")
