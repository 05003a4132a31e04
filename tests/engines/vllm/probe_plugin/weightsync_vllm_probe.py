"""A test-only vLLM general plugin: registers the ``weightsync-probe`` WeightTransferEngine (runs inside vLLM).

Not the weightsync backend (issue 13's p2p plugin, not built yet): it reads the new weights from a safetensors
file named in ``update_info`` instead of receiving them over Mooncake. It proves, against the stock server, what
that plugin will rely on: a third-party backend is found through a ``vllm.general_plugins`` entry point (this
directory on the server's ``PYTHONPATH`` holds the dist-info that declares it), vLLM drives it through
``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, and
weights loaded with ``model.load_weights`` inside vLLM's layerwise reload land, linear layers included (on CPU
vLLM repacks those into oneDNN handles; the reload repacks them again).

Every call appends a JSON line to ``$WEIGHTSYNC_VLLM_PROBE_LOG`` (with the process id) when that is set.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load_file
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.model_loader.reload.layerwise import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

BACKEND = "weightsync-probe"


def _record(event: str, **fields: Any) -> None:
    path = os.environ.get("WEIGHTSYNC_VLLM_PROBE_LOG")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"event": event, "pid": os.getpid(), **fields}) + "\n")


@dataclass
class ProbeInitInfo(WeightTransferInitInfo):
    tag: str = ""


@dataclass
class ProbeUpdateInfo(WeightTransferUpdateInfo):
    path: str = ""  # a safetensors file with HF-named tensors
    names: list[str] = field(default_factory=list)  # a subset of its tensors; empty: all


class ProbeEngine(WeightTransferEngine[ProbeInitInfo, ProbeUpdateInfo]):
    init_info_cls = ProbeInitInfo
    update_info_cls = ProbeUpdateInfo

    def init_transfer_engine(self, init_info: ProbeInitInfo) -> None:
        _record("init", tag=init_info.tag, device=str(self.device))

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)
        _record("start")

    def receive_weights(self, update_info: ProbeUpdateInfo) -> None:
        tensors = load_file(update_info.path)
        names = update_info.names or sorted(tensors)
        with torch.no_grad():
            loaded = self.model.load_weights((name, tensors[name]) for name in names)
        _record("receive", names=len(names), loaded=len(loaded) if loaded is not None else None)

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)
        _record("finish")

    def shutdown(self) -> None:
        _record("shutdown")


def register() -> None:
    """The entry point; vLLM calls it in every process (API server, engine core, workers)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, ProbeEngine)
    _record("register")
