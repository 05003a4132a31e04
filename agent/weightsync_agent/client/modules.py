"""Stage a torch module's parameters under the engines' (Hugging Face) names, straight from a sharded trainer.

::

    client = WeightSyncClient.from_env()
    report = stage_module(client, model)                 # FSDP2 / DTensor parameters: gathered one at a time
    client.publish(step)

    with client.stream(step) as s:                       # or overlap gathering with the transfer
        stage_module(s, model, expected=client.expected())

    stage_module(client, megatron_model, convert=my_megatron_to_hf)   # a user's name/layout conversion

Every rank of the trainer's process group calls it with its own shard of the same module, in the same order
(``module.named_parameters()``): a DTensor parameter (FSDP2's ``fully_shard``, or any DTensor layout) is made
whole with ``DTensor.full_tensor()``, a collective every rank must enter. The whole tensor then goes through the
converter, and each resulting tensor the engines need is copied into this rank's replica (``stage``); then it is
dropped before the next parameter is gathered. So the extra memory is one parameter made whole plus what the
converter makes of it (the converter may hold pieces across parameters, e.g. to fuse q, k, v: that is its own
bound), never the model. :class:`StageReport` says what it was.

A converter is ``convert(name, tensor) -> iterable of (hf_name, hf_tensor)``: ``name`` is the module's
parameter name, ``tensor`` the local value, made whole along the DTensor's mesh. A converter for a
Megatron-style tensor-parallel module gathers along its own TP group inside (examples/trainers/). The default
maps each parameter to itself under its own name, with an optional prefix stripped (``strip``, e.g. FSDP's or
``torch.compile``'s wrappers).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

#: ``(module parameter name, whole tensor) -> [(engine name, tensor), ...]``
Converter = Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]
#: Prefixes wrappers add to parameter names, stripped by the default converter.
WRAPPER_PREFIXES = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "module.")


class Stager(Protocol):
    """What :func:`stage_module` stages into: a :class:`~weightsync_agent.client.trainer.WeightSyncClient`, or the
    stream a ``client.stream(version)`` block gives."""

    def stage(self, name: str, tensor: torch.Tensor, *, strict: bool = True) -> int: ...


@dataclass(frozen=True)
class StageReport:
    parameters: int  # module parameters visited (every rank visits all of them)
    staged: int  # engine tensors copied into this rank's replica
    skipped: tuple[str, ...]  # engine tensors the converter made that no target of this rank needs
    staged_bytes: int
    #: The most bytes of whole tensors alive at once (a parameter made whole and its converted tensors): the
    #: helper's own memory on top of the model's shards, the optimizer's and the replica's.
    peak_bytes: int
    largest_parameter_bytes: int  # the largest parameter, made whole
    seconds: float


def identity(strip: Collection[str] = WRAPPER_PREFIXES) -> Converter:
    """Each parameter under its own name, with wrapper prefixes removed."""

    def convert(name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        for prefix in strip:
            name = name.replace(prefix, "")
        return [(name, tensor)]

    return convert


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` made whole: a DTensor's ``full_tensor()`` (a collective over its mesh), else the tensor itself."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    return tensor


def stage_module(
    into: Stager,
    module: torch.nn.Module,
    *,
    convert: Converter | None = None,
    expected: Collection[str] | None = None,
) -> StageReport:
    """Stage every parameter of ``module`` the engines need, made whole one at a time; see the module docstring.

    ``expected``: the engine tensor names to stage (default: ``into.expected()`` when it has one, else all that
    the converter makes, each staged with ``strict=False`` so a name this rank's replicas do not hold is
    skipped). Every rank must call this for the same module in the same order.
    """
    started = time.monotonic()
    convert = convert or identity()
    wanted = set(expected) if expected is not None else _expected_of(into)
    staged = staged_bytes = peak = largest = parameters = 0
    skipped: list[str] = []
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            parameters += 1
            full = whole(parameter.detach())
            full_bytes = full.numel() * full.element_size()
            largest = max(largest, full_bytes)
            alive = full_bytes
            for engine_name, tensor in convert(name, full):
                if tensor.untyped_storage().data_ptr() != full.untyped_storage().data_ptr():  # not a view of it
                    alive += tensor.numel() * tensor.element_size()
                peak = max(peak, alive)
                if wanted is not None and engine_name not in wanted:
                    skipped.append(engine_name)
                    continue
                into.stage(engine_name, tensor.contiguous(), strict=wanted is not None)
                staged += 1
                staged_bytes += tensor.numel() * tensor.element_size()
            peak = max(peak, alive)
            del full
    return StageReport(parameters, staged, tuple(skipped), staged_bytes, peak, largest, time.monotonic() - started)


def _expected_of(into: object) -> set[str] | None:
    expected = getattr(into, "expected", None)
    return set(expected()) if callable(expected) else None
