"""The ``weightsync`` WeightTransferEngine: a round's bytes arrive over Mooncake, vLLM applies them.

vLLM drives it through its RL routes (``VLLM_SERVER_DEV_MODE=1``), in its worker that holds the model:

* ``/init_weight_transfer_engine {"init_info": {"directory": D, "host": H}}``: lay this rank's checkpoint tensors
  out in a receive buffer under ``D`` (:mod:`~weightsync_vllm.receive_buffer`), start a Mooncake engine on
  ``H`` (peer-to-peer handshake: no metadata server), register the buffer with it, and publish the layout with
  the Mooncake session id (``D/<tag>.json``). Sources then write into the buffer directly; nothing of a round
  passes through vLLM's HTTP server. Idempotent: asked again with the same ``D``, ``H`` and dtype, it keeps the
  buffer and its session and only republishes the layout, so the engine pod's agent can ask on every manifest
  request and learn from the session whether vLLM restarted (a new process makes a new buffer, a new session).
* ``/start_weight_update``: vLLM's layerwise reload begins (it keeps what the CPU build repacks, and restores
  it from ``load_weights``).
* ``/update_weights {"update_info": {"names": [...], "sessions": {tag: session}}}`` (empty names: every tensor):
  ``model.load_weights`` from the buffer's views; refused when ``sessions`` names another session for this rank
  than its buffer's (the verified bytes were in a predecessor's buffer: vLLM restarted after the verification).
  Send complete fused groups (q, k and v together): a layer given only part of a fused weight
  keeps neither the old nor the new values.
* ``/finish_weight_update {"weight_version": v}``: the reload finishes (the CPU build repacks); vLLM reports
  ``v`` from then on.

The engine pod's agent checks the buffer's bytes against the sources' checksums between the writes and
``/update_weights``: the version is never set on bytes that were not verified (the round's invariant).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload.layerwise import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from weightsync_vllm.receive_buffer import DTYPES, BufferError, ReceiveBuffer, checkpoint_tensors

logger = logging.getLogger("weightsync_vllm")

#: The vLLM release this engine was written and checked against (its weight-transfer API is young).
VALIDATED_VLLM = "0.32.0"


@dataclass
class WeightsyncInitInfo(WeightTransferInitInfo):
    #: Where the receive buffer and its layout go (shared with the engine pod's agent).
    directory: str = ""
    #: The address Mooncake listens on (the pod's IP; loopback in tests).
    host: str = "127.0.0.1"
    #: The dtype sources write in (default: the dtype vLLM serves the model in).
    dtype: str = ""


@dataclass
class WeightsyncUpdateInfo(WeightTransferUpdateInfo):
    #: The checkpoint tensors to apply from the buffer; empty: all of them.
    names: list[str] = field(default_factory=list)
    #: The session each rank's verified bytes were written to (``dp0-pp0-tp0`` -> ``host:port``); a rank whose
    #: buffer has another session refuses. Empty: not checked.
    sessions: dict[str, str] = field(default_factory=dict)


class WeightsyncEngine(WeightTransferEngine[WeightsyncInitInfo, WeightsyncUpdateInfo]):
    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.buffer: ReceiveBuffer | None = None
        self.mooncake: Any = None
        self.session_id = ""
        self._made_with: tuple[str, str, str] | None = None  # (directory, host, dtype) of the buffer

    # --- vLLM's calls ----------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        if not init_info.directory:
            raise ValueError("init_info.directory is required: where the receive buffer goes")
        wanted = (init_info.directory, init_info.host, init_info.dtype)
        if self.buffer is not None and self._made_with == wanted and self.buffer.layout_path.exists():
            self.buffer.publish(session_id=self.session_id, model=str(self.model_config.model), pid=os.getpid())
            return
        self.shutdown()  # other settings replace the buffer
        dtype = _dtype(init_info.dtype) if init_info.dtype else self.model_config.dtype
        model_dir = Path(self.model_config.model)
        tensors = [(name, dtype if DTYPES.get(kind, dtype).is_floating_point else DTYPES[kind], shape)
                   for name, kind, shape in checkpoint_tensors(model_dir)]  # fmt: skip
        self.buffer = ReceiveBuffer(Path(init_info.directory), rank_tag(), tensors)
        self.mooncake = _mooncake(init_info.host)
        rc = self.mooncake.register_memory(self.buffer.address, self.buffer.nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory of the receive buffer returned {rc}")
        self.session_id = f"{init_info.host}:{self.mooncake.get_rpc_port()}"
        self.buffer.publish(session_id=self.session_id, model=str(model_dir), pid=os.getpid())
        self._made_with = wanted
        logger.info("weightsync: receive buffer of %d tensors, %d bytes, Mooncake session %s",
                    len(self.buffer.slots), self.buffer.nbytes, self.session_id)  # fmt: skip

    def start_weight_update(self) -> None:
        self._buffer()
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        buffer = self._buffer()
        verified = update_info.sessions.get(rank_tag()) if update_info.sessions else self.session_id
        if verified != self.session_id:
            raise BufferError(
                f"the verified bytes were written to session {verified}, this buffer is session {self.session_id} "
                "(vLLM restarted after the verification): nothing applied"
            )
        names = update_info.names or [slot.name for slot in buffer.slots]
        unknown = sorted(set(names) - set(buffer.by_name))
        if unknown:
            raise BufferError(f"not in the receive buffer: {unknown[:5]}")
        with torch.no_grad():
            self.model.load_weights((name, buffer.tensor(name)) for name in names)

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        if self.mooncake is not None and self.buffer is not None:
            self.mooncake.unregister_memory(self.buffer.address)
        self.mooncake = None
        self._made_with = None
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None

    # --- helpers ---------------------------------------------------------------------------------

    def _buffer(self) -> ReceiveBuffer:
        if self.buffer is None:
            raise RuntimeError("no receive buffer: /init_weight_transfer_engine was not called")
        return self.buffer


def rank_tag() -> str:
    """This worker's place, as vLLM's checksums name it (``dp0-pp0-tp0``)."""
    from vllm.distributed import parallel_state

    tp = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pp_group().rank_in_group
    return f"dp0-pp{pp}-tp{tp}"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"init_info.dtype {name!r} is not a torch dtype")
    return dtype


def _mooncake(host: str) -> Any:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"Mooncake initialize({host!r}, P2PHANDSHAKE, tcp) returned {rc}")
    return engine
