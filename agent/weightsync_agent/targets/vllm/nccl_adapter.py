"""Stock vLLM in broadcast mode: vLLM's own ``nccl`` weight-transfer backend, no weightsync code in the engine.

The server runs as it ships with ``VLLM_SERVER_DEV_MODE=1 --weight-transfer-config '{"backend": "nccl"}'``. The
trainer side is weightsync's broadcast sender over a raw NCCL group (``transport/nccl_uid_group.py``): vLLM's
``nccl_unique_id_b64`` rendezvous needs no vLLM on the trainer. A live round (docs/engines/vllm.md):

| step | vLLM route / what |
|---|---|
| join | ``/init_weight_transfer_engine {"init_info": {nccl_unique_id_b64, rank_offset, world_size, packed: false}}`` |
| pause | ``/pause?mode=wait`` |
| begin | the version must be newer than ``/weight_info``'s |
| write | ``/start_weight_update`` (vLLM's layerwise reload) with the first chunk, then per chunk ``/update_weights |
|       | {"update_info": {names, dtype_names, shapes}}`` while the sender broadcasts each tensor; every TP rank |
|       | receives the full tensors and its own ``load_weights`` cuts them |
| verify | ``/finish_weight_update`` without a version (the reload completes), then ``/weight_checker`` ``checksum``: |
|        | vLLM's sha256 of each parameter against the sender's, cut by the engine root's vLLM trace |
| commit | ``/update_weight_version``: the label moves only after every rank verified |
| resume | ``/resume`` |
| abort | an update left open is finished (no label); the engine stays paused, reporting the version it held |
|       | (a vLLM whose chunk failed inside its reload cannot serve again: its engine core dies on the next request) |

Manifests: the engine's pod traces the model with vLLM's own code (model, TP size and dtype from
``/server_info``); a manifest's addresses are offsets in a virtual layout (bytes arrive by NCCL, never by address).
Everyone else fetches them from that pod's agent, as in p2p mode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

from weightsync_agent.http.client import HttpCallError
from weightsync_agent.layout.manifest import ITEMSIZE, Manifest
from weightsync_agent.layout.traced_manifest import assemble
from weightsync_agent.targets.adapter import AdapterSettings, BroadcastReception, FullTensor, rank_offset
from weightsync_agent.targets.vllm.traced import VllmTracedAdapter
from weightsync_agent.transport.nccl_uid_group import unique_id_of

BACKEND = "nccl"
#: Manifests in broadcast mode name no transport session: the bytes come over the group.
SESSION = "vllm-nccl-broadcast"
#: The virtual layout's base address and alignment (never dereferenced: see the module docstring).
VIRTUAL_BASE, VIRTUAL_ALIGN = 1 << 20, 256
NOT_SERVING_NCCL = (
    "vLLM does not serve its RL routes: start it with VLLM_SERVER_DEV_MODE=1 and "
    f'--weight-transfer-config \'{{"backend": "{BACKEND}"}}\''
)


class VllmNcclAdapter(VllmTracedAdapter):
    """One stock vLLM engine taking broadcast rounds through its own ``nccl`` backend."""

    #: Every TP rank is a group member (rank_offset + its rank, vLLM's rule) and receives the full tensors.
    broadcast: ClassVar[BroadcastReception] = BroadcastReception("rank", "announced-tensors", "nccl-unique-id")
    not_serving: ClassVar[str] = NOT_SERVING_NCCL

    def __init__(self, settings: AdapterSettings) -> None:
        super().__init__(settings)
        self.name = f"engine {settings.engine} (vLLM at {self.client.base_url}, nccl backend)"

    def __repr__(self) -> str:
        return f"VllmNcclAdapter({self.name})"

    # --- The round (live: inside a pause) ----------------------------------------------------------

    # begin, verify, commit and abort are the traced base's. vLLM's update opens with the first chunk
    # (receive_broadcast): its layerwise reload takes the weights apart until finish, so a round that fails before
    # sending anything leaves the engine as it was.

    # --- Broadcast reception: vLLM's own nccl backend ------------------------------------------------

    def join_broadcast(self, init_method: str, world_size: int, members: list[dict[str, Any]], backend: str,
                       timeout: float, group_name: str = "weightsync") -> None:  # fmt: skip
        route = "/init_weight_transfer_engine"
        try:
            init_info = init_info_payload(init_method, world_size, members, self.settings.ranks)
        except ValueError as exc:
            raise HttpCallError(route, None, str(exc)) from exc
        self._post(route, {"init_info": init_info}, timeout + self.settings.call_timeout)

    def arm_broadcast(self, version: int, timeout: float, *, round_id: str | None = None) -> None:
        raise HttpCallError("/update_weights", None, "vLLM is told each chunk's tensors (receive_broadcast), not armed")

    def receive_broadcast(self, version: int, tensors: Sequence[FullTensor], group_name: str, timeout: float) -> None:
        update_info = update_info_payload(tensors)
        self._open_once(timeout)  # vLLM's layerwise reload begins with the first chunk
        self._post("/update_weights", {"update_info": update_info}, timeout)

    def leave_broadcast(self, group_name: str, timeout: float) -> None:
        # vLLM has no route to drop its group: the sender's abort fails any receive still in it, and the next
        # join replaces it.
        return

    # --- Pieces ------------------------------------------------------------------------------------

    def _settle(self, timeout: float) -> None:
        self._close_update(timeout)  # vLLM's reload completes in finish: only then do its checksums say what serves

    def _assemble(self, rank: int) -> Manifest:
        trace = self._trace(rank)
        offset, weights_info = VIRTUAL_BASE, {}
        for entry in trace.get("tensors") or []:
            numel, itemsize = math.prod(int(d) for d in entry["shape"]), ITEMSIZE.get(str(entry["dtype"]), 0)
            weights_info[str(entry["name"])] = [offset, numel, itemsize]
            offset += -(-max(numel * itemsize, 1) // VIRTUAL_ALIGN) * VIRTUAL_ALIGN
        return assemble(self.settings.engine, rank, trace, SESSION, weights_info, checksum="tensor-sha256")


def init_info_payload(
    init_method: str, world_size: int, members: Sequence[dict[str, Any]], ranks: int
) -> dict[str, Any]:
    """``/init_weight_transfer_engine``'s ``init_info`` for an engine of ``ranks`` TP ranks joining as ``members``
    (vLLM's ``NCCLWeightTransferInitInfo``); ValueError when ``init_method`` is not a unique id or the members are
    not one group rank per TP rank, consecutive from an offset (vLLM's rule: rank_offset + its rank)."""
    try:
        unique_id_of(init_method)
    except ValueError as exc:
        raise ValueError(f"vLLM's nccl backend joins by an NCCL unique id: {exc}") from exc
    try:
        offset = rank_offset(members, ranks)
    except ValueError as exc:
        raise ValueError(f"vLLM joins {exc}") from exc
    return {
        "nccl_unique_id_b64": init_method.split(":", 1)[1],
        "rank_offset": offset,
        "world_size": world_size,
        "packed": False,  # one broadcast per announced tensor, in order: what the sender does
    }


def update_info_payload(tensors: Sequence[FullTensor]) -> dict[str, Any]:
    """``/update_weights``' ``update_info`` announcing ``tensors``, in the order they are broadcast."""
    return {
        "names": [t.name for t in tensors],
        "dtype_names": [t.dtype for t in tensors],
        "shapes": [list(t.shape) for t in tensors],
    }
