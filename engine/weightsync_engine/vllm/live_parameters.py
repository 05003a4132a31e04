"""Where a round's bytes land when vLLM's weights are plain tensors: the live parameters themselves.

On CUDA with an unquantized model every parameter vLLM serves from is an ordinary contiguous tensor laid out as
the shard map says (fused ``qkv_proj``/``gate_up_proj``, this TP rank's slice). Sources then write each rank's
shard straight into it, once, with no copy and no ``load_weights`` pass (the SGLang/Miles P2P design), and vLLM's
``/weight_checker`` hashes exactly what serves. Where that is not so the placement is refused with the parameters
and the reason, and the receive buffer (:mod:`weightsync_engine.vllm.receive_buffer`, staged rounds) is the way in:

* a quantized model: its parameters are not the checkpoint's values;
* a parameter that is empty after loading: vLLM's CPU build repacks every linear weight into a oneDNN handle and
  leaves ``layer.weight`` empty;
* a parameter that is not contiguous, or a tensor subclass keeping its bytes in inner tensors: one address and a
  length would not describe it;
* a parameter on the meta device: vLLM's layerwise reload (the receive buffer's way in) has taken the weights
  apart until it finishes (or a failed reload left them so: vLLM 0.32 drops an update whose receive failed).

Published per parameter as stock SGLang publishes its weights: ``{name: [data_ptr, numel, element_size]}``; the
engine pod's agent joins that with the shard-map trace and cross-checks every size. Standalone: ``torch`` only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

#: How many refused parameters a message names (the rest are counted).
NAMED_IN_REFUSAL = 5


class PlacementRefusedError(ValueError):
    """The live parameters cannot take one-sided writes (the message says which and why)."""


@dataclass(frozen=True)
class Span:
    """A run of memory covering one or more adjacent parameters: what is registered with the transport."""

    address: int
    nbytes: int


@dataclass(frozen=True)
class LiveParameters:
    """The parameters of one worker's model, by vLLM's name, ready to be written in place."""

    tensors: dict[str, torch.Tensor]
    device: str

    def weights_info(self) -> dict[str, list[int]]:
        """``{name: [data_ptr, numel, element_size]}``: stock SGLang's format, what the agent's assembly takes."""
        return {name: [t.data_ptr(), t.numel(), t.element_size()] for name, t in self.tensors.items()}

    def moved(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """The parameters of ``named`` (the model's now) that are not the published tensors any more: another name
        set, or another storage (a reload or an offload replaced them), so the published addresses are stale."""
        now = {name: parameter.data for name, parameter in named}
        if set(now) != set(self.tensors):
            return sorted(set(now) ^ set(self.tensors))
        return [name for name, tensor in self.tensors.items()
                if now[name].data_ptr() != tensor.data_ptr() or now[name].shape != tensor.shape]  # fmt: skip

    def spans(self) -> list[Span]:
        """The parameters' memory as few runs as possible: adjacent or overlapping ranges merged (a caching
        allocator carves many parameters out of one block), so the transport registers tens of regions, not
        hundreds."""
        ranges = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in self.tensors.values())
        merged: list[list[int]] = []
        for start, end in ranges:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return [Span(start, end - start) for start, end in merged]


def live_parameters(named: Iterable[tuple[str, torch.Tensor]], *, quantization: str | None) -> LiveParameters:
    """The writable view of a model's ``named_parameters()``; :class:`PlacementRefusedError` naming every
    parameter that cannot take writes in place, and why."""
    if quantization:
        raise PlacementRefusedError(
            f"the model is quantized ({quantization}): its parameters hold a layout the checkpoint does not; "
            "sync it through the receive buffer (targetStaging: staged)"
        )
    tensors: dict[str, torch.Tensor] = {}
    refused: list[str] = []
    for name, parameter in named:
        tensor = parameter.data
        if tensor.is_meta:
            refused.append(
                f"{name} is on the meta device (vLLM's layerwise reload took the weights apart: a reload is "
                "open, or a failed one left them so)"
            )
        elif is_traceable_wrapper_subclass(tensor):
            refused.append(f"{name} is a {type(tensor).__name__} (its bytes are in inner tensors)")
        elif tensor.numel() == 0:
            refused.append(f"{name} is empty (repacked after loading: vLLM's CPU build packs linear weights)")
        elif not tensor.is_contiguous():
            refused.append(f"{name} is not contiguous (stride {list(tensor.stride())})")
        else:
            tensors[name] = tensor
    if refused:
        more = f" (and {len(refused) - NAMED_IN_REFUSAL} more)" if len(refused) > NAMED_IN_REFUSAL else ""
        raise PlacementRefusedError(
            f"{len(refused)} parameter(s) cannot be written in place: {'; '.join(refused[:NAMED_IN_REFUSAL])}"
            f"{more}; sync this engine through the receive buffer (targetStaging: staged)"
        )
    if not tensors:
        raise PlacementRefusedError("the model has no parameters to write")
    devices = {str(t.device.type) for t in tensors.values()}
    if len(devices) != 1:
        raise PlacementRefusedError(f"the parameters live on several devices ({sorted(devices)})")
    return LiveParameters(tensors, devices.pop())
