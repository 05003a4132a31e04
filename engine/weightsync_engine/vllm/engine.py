"""The ``weightsync`` WeightTransferEngine: a round's bytes arrive over Mooncake, one-sided, from the sources.

vLLM drives it through its RL routes (``VLLM_SERVER_DEV_MODE=1``), in each worker that holds the model. Where the
bytes land is the ``placement`` the caller asks for (docs/engines/vllm.md):

``buffer`` (staged rounds, any vLLM build and model)
  * ``/init_weight_transfer_engine {"init_info": {"directory": D, "host": H}}``: lay this rank's checkpoint
    tensors out in a receive buffer under ``D`` (:mod:`~weightsync_engine.vllm.receive_buffer`), start a Mooncake engine
    on ``H`` (peer-to-peer handshake: no metadata server), register the buffer with it, and publish the layout
    with the Mooncake session id (``D/<tag>.json``). Sources write into the buffer while vLLM serves.
  * ``/start_weight_update``: vLLM's layerwise reload begins (it keeps what the CPU build repacks, and restores
    it from ``load_weights``).
  * ``/update_weights {"update_info": {"names": [...], "sessions": {tag: session}}}`` (empty names: every
    tensor): ``model.load_weights`` from the buffer's views; refused when ``sessions`` names another session for
    this rank than its buffer's (the verified bytes were in a predecessor's buffer: vLLM restarted after the
    verification). Send complete fused groups (q, k and v together): a layer given only part of a fused weight
    keeps neither the old nor the new values.
  * ``/finish_weight_update {"weight_version": v}``: the reload finishes (the CPU build repacks); vLLM reports
    ``v`` from then on.

  The engine pod's agent checks the buffer's bytes against the sources' checksums between the writes and
  ``/update_weights``: the version is never set on bytes that were not verified (the round's invariant).

``parameters`` (live rounds: plain, unquantized weights, i.e. CUDA)
  * ``/init_weight_transfer_engine {"init_info": {"directory": D, "host": H, "placement": "parameters"}}``:
    take the model's own parameters as the target (:mod:`~weightsync_engine.vllm.live_parameters`; refused, with the
    parameters and why, where they are not plain tensors), start a Mooncake engine on ``H`` and publish
    ``{name: [data_ptr, numel, element_size]}`` with its session id in ``D/<tag>.json``. Sources write each
    rank's shard, cut by the engine's traced shard map, straight into them while vLLM is paused; nothing is
    copied or re-loaded.
  * ``/start_weight_update`` registers the parameters (they take writes only from then on; refused when they are
    not the published tensors any more, e.g. replaced by a reload) and
    ``/finish_weight_update`` unregisters them: outside a round Mooncake refuses any write, so what
    ``/weight_checker`` verified after the finish is what serves until the next round. ``/update_weights`` is
    refused (the writes are the update); ``/update_weight_version`` labels.

Either way ``/init_weight_transfer_engine`` is idempotent: asked again with the same settings it keeps what it
registered and only republishes, so the engine pod's agent asks on every manifest request and learns from the
session whether vLLM restarted (a new process registers anew, under a new session). A refusal is published too
(``{"refused": reason}``), echoing ``init_info.request``, since vLLM answers a failed init with a bare 500.
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

from weightsync_engine.vllm.live_parameters import LiveParameters, PlacementRefusedError, Span, live_parameters
from weightsync_engine.vllm.receive_buffer import (
    BufferError,
    ReceiveBuffer,
    buffer_dtypes,
    checkpoint_tensors,
    publish_json,
)
from weightsync_engine.vllm.reload_defects import reload_defect

logger = logging.getLogger("weightsync_engine.vllm")

#: The vLLM release this engine was written and checked against (its weight-transfer API is young).
VALIDATED_VLLM = "0.32.0"
#: Where the bytes land: a receive buffer applied by vLLM's loader (staged), or the live parameters (live).
PLACEMENTS = ("buffer", "parameters")
#: Bounds on what a caller names (the init route is the group's, behind the token guard, but still bounded).
MAX_REQUEST_CHARS = 128


@dataclass
class WeightsyncInitInfo(WeightTransferInitInfo):
    #: Where the layout (and the receive buffer) go (shared with the engine pod's agent).
    directory: str = ""
    #: The address Mooncake listens on (the pod's IP; loopback in tests).
    host: str = "127.0.0.1"
    #: The dtype sources write in (default: the dtype vLLM serves the model in). ``buffer`` placement only.
    dtype: str = ""
    #: ``buffer`` or ``parameters`` (the module docstring).
    placement: str = "buffer"
    #: Echoed in the published layout: the caller knows the file answers its request (a refusal included).
    request: str = ""


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
        self.live: LiveParameters | None = None
        self.mooncake: Any = None
        self.session_id = ""
        self._registered: list[int] = []  # addresses registered with self.mooncake
        self._made_with: tuple[str, str, str, str] | None = None  # (directory, host, dtype, placement)

    # --- vLLM's calls ----------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        if not init_info.directory:
            raise ValueError("init_info.directory is required: where the layout (and the receive buffer) go")
        if init_info.placement not in PLACEMENTS:
            raise ValueError(f"init_info.placement {init_info.placement!r} is not one of {list(PLACEMENTS)}")
        if len(init_info.request) > MAX_REQUEST_CHARS:
            raise ValueError(f"init_info.request is longer than {MAX_REQUEST_CHARS} characters")
        directory = Path(init_info.directory)
        wanted = (init_info.directory, init_info.host, init_info.dtype, init_info.placement)
        if self._made_with == wanted and _layout_path(directory).exists():
            self._publish(directory, init_info.request)
            return
        self.shutdown()  # other settings replace what was registered
        if init_info.placement == "parameters":
            self._register_parameters(init_info)
        else:
            self._register_buffer(init_info)
        self._made_with = wanted
        self._publish(directory, init_info.request)

    def start_weight_update(self) -> None:
        if self.live is not None:
            moved = self.live.moved(self.model.named_parameters())
            if moved:
                raise BufferError(f"parameters {moved[:5]} are not where they were published (replaced since): ask "
                                  "/init_weight_transfer_engine again; nothing was made writable")  # fmt: skip
            self._register(self.live.spans())  # writable from here until finish: the sources' writes are the update
            return
        self._buffer()
        # Imported here: vLLM's model loader pulls its serving stack, which only the buffer placement needs.
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        if self.live is not None:
            raise BufferError("the live parameters take the sources' writes directly: there is nothing to apply")
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
        if self.live is not None:
            self._unregister()  # nothing writes the parameters between rounds; the checksums then hold
            return
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self._unregister()
        self.mooncake = None
        self._made_with = None
        self.live = None
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None

    # --- The placements --------------------------------------------------------------------------

    def _register_buffer(self, init_info: WeightsyncInitInfo) -> None:
        import vllm

        defect = reload_defect(vllm.__version__, list(self.model_config.architectures or []))
        if defect is not None:
            refusal = {"placement": "buffer", "refused": defect, "request": init_info.request, "pid": os.getpid()}
            publish_json(_layout_path(Path(init_info.directory)), refusal)
            raise PlacementRefusedError(defect)
        dtype = _dtype(init_info.dtype) if init_info.dtype else self.model_config.dtype
        model_dir = Path(self.model_config.model)
        tensors = buffer_dtypes(checkpoint_tensors(model_dir), dtype)
        self.buffer = ReceiveBuffer(Path(init_info.directory), rank_tag(), tensors)
        self._start_mooncake(init_info.host, [Span(self.buffer.address, self.buffer.nbytes)])
        logger.info("weightsync: receive buffer of %d tensors, %d bytes, Mooncake session %s",
                    len(self.buffer.slots), self.buffer.nbytes, self.session_id)  # fmt: skip

    def _register_parameters(self, init_info: WeightsyncInitInfo) -> None:
        directory = Path(init_info.directory)
        try:
            if not directory.is_dir():
                raise PlacementRefusedError(f"the layout directory {directory} does not exist")
            if init_info.dtype and _dtype(init_info.dtype) != self.model_config.dtype:
                raise PlacementRefusedError(
                    f"the live parameters are {self.model_config.dtype}, not {init_info.dtype}: sources write the "
                    "served dtype in this placement"
                )
            live = live_parameters(self.model.named_parameters(), quantization=self.model_config.quantization)
        except PlacementRefusedError as exc:
            publish_json(_layout_path(directory), {"placement": "parameters", "refused": str(exc),
                                                   "request": init_info.request, "pid": os.getpid()})  # fmt: skip
            raise
        # Registered only inside a round (start .. finish): published now, writable then.
        self._start_mooncake(init_info.host, [])
        self.live = live
        logger.info("weightsync: %d live parameters (%s) in %d spans, Mooncake session %s",
                    len(live.tensors), live.device, len(live.spans()), self.session_id)  # fmt: skip

    def _start_mooncake(self, host: str, spans: list[Span]) -> None:
        self.mooncake = _mooncake(host)
        self.session_id = f"{host}:{self.mooncake.get_rpc_port()}"
        self._register(spans)

    def _register(self, spans: list[Span]) -> None:
        if self._registered:
            return
        for span in spans:
            rc = self.mooncake.register_memory(span.address, span.nbytes)
            if rc != 0:
                self._unregister()
                raise RuntimeError(f"Mooncake register_memory({span.address:#x}, {span.nbytes}) returned {rc}")
            self._registered.append(span.address)

    def _unregister(self) -> None:
        if self.mooncake is not None:
            for address in self._registered:
                self.mooncake.unregister_memory(address)
        self._registered = []

    def _publish(self, directory: Path, request: str) -> None:
        common = {"session_id": self.session_id, "model": str(self.model_config.model), "pid": os.getpid(),
                  "request": request}  # fmt: skip
        if self.live is not None:
            publish_json(_layout_path(directory), {"placement": "parameters", "device": self.live.device,
                                                   "weights_info": self.live.weights_info(), **common})  # fmt: skip
        else:
            # The checkpoint's own quantization config: the agent decides from it which tensors sources quantize.
            quantization = getattr(self.model_config.hf_config, "quantization_config", None)
            self._buffer().publish(quantization=quantization, **common)

    def _buffer(self) -> ReceiveBuffer:
        if self.buffer is None:
            raise RuntimeError("no receive buffer: /init_weight_transfer_engine was not called with placement buffer")
        return self.buffer


def _layout_path(directory: Path) -> Path:
    return directory / f"{rank_tag()}.json"


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
