"""Engine kinds (``inference.adapter``) and what each one's adapter can do: the contract the operator checks
a spec against and the agents' adapters declare. Pure.

A capability a spec requests but its adapter lacks is refused with a message that names both, on the
group's status (by the operator) and in the round's result (by the coordinator): never pods that wait
for a sync that cannot happen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, get_args

Adapter = Literal["sglang", "vllm", "reference"]
SyncModeName = Literal["p2p", "broadcast"]
Staging = Literal["live", "staged"]
#: How targets check what landed: per-bucket xxh3-64 over the engine's own memory (weightsync's
#: verify routes), the engine's own per-parameter hash (SGLang's ``/weights_checker``), or nothing.
VerifyKind = Literal["bucket-xxh3", "tensor-hash", "none"]

ADAPTERS: Final[tuple[Adapter, ...]] = get_args(Adapter)
SYNC_MODES: Final[tuple[SyncModeName, ...]] = get_args(SyncModeName)
STAGINGS: Final[tuple[Staging, ...]] = get_args(Staging)


@dataclass(frozen=True)
class Capabilities:
    modes: frozenset[SyncModeName]
    staging: frozenset[Staging]
    verify: VerifyKind
    #: Whether a joining or restarted engine can be brought to the committed version from the replicas.
    catch_up: bool
    #: Whether the engine's weight memory accepts transport (Mooncake) writes only inside an open round, i.e.
    #: is registered at begin and unregistered at commit/abort (docs/security.md, "The data plane").
    writable_only_in_round: bool = False
    #: Where a mode allows fewer stagings than ``staging`` (each mode's own way into the engine), that mode's.
    staging_by_mode: tuple[tuple[SyncModeName, frozenset[Staging]], ...] = ()

    def stagings(self, mode: SyncModeName) -> frozenset[Staging]:
        """The stagings ``mode`` can do."""
        return dict(self.staging_by_mode).get(mode, self.staging)


@dataclass(frozen=True)
class EngineKind:
    adapter: Adapter
    #: None: this version has no adapter for the kind yet (``unavailable`` says why).
    capabilities: Capabilities | None
    unavailable: str = ""


ENGINE_KINDS: Final[dict[Adapter, EngineKind]] = {
    "reference": EngineKind(
        "reference",
        Capabilities(
            modes=frozenset({"p2p", "broadcast"}),
            staging=frozenset({"live", "staged"}),
            verify="bucket-xxh3",
            catch_up=True,
            writable_only_in_round=True,
        ),
    ),
    "sglang": EngineKind(
        "sglang",
        # Stock SGLang publishes its live weights only (no staging area); broadcast goes through its own
        # /init_weights_update_group and /update_weights_from_distributed routes (docs/engines/sglang.md).
        Capabilities(
            modes=frozenset({"p2p", "broadcast"}),
            staging=frozenset({"live"}),
            verify="tensor-hash",
            catch_up=True,
            # Stock SGLang registers its weights with its own Mooncake engine once, at start
            # (register_memory_region_v2), and has no route to unregister them: writable for its whole life.
            writable_only_in_round=False,
        ),
    ),
    "vllm": EngineKind(
        "vllm",
        # Stock vLLM (docs/engines/vllm.md). p2p, with weightsync's backend plugin, either way: staged, sources
        # write the checkpoint's tensors into the plugin's receive buffer while vLLM serves and the commit applies
        # them through vLLM's own layerwise reload inside a pause (any build, any model), verified per bucket over
        # the buffer by the engine pod's agent; live, sources write each rank's shard into vLLM's own parameters
        # inside a pause (plain unquantized weights: CUDA), verified by vLLM's /weight_checker (sha256 per
        # parameter). A restarted or joining vLLM publishes a new session and is caught up from the replicas.
        # broadcast, with vLLM's own nccl backend: every rank receives full tensors into its live weights inside
        # a pause, so live only; verified by /weight_checker.
        Capabilities(
            modes=frozenset({"p2p", "broadcast"}),
            staging=frozenset({"staged", "live"}),
            verify="bucket-xxh3",
            catch_up=True,
            writable_only_in_round=False,
            staging_by_mode=(("broadcast", frozenset({"live"})),),
        ),
    ),
}


def unavailable_message(kind: EngineKind) -> str:
    return f"inference.adapter {kind.adapter!r} has no weightsync adapter yet: {kind.unavailable}"


@dataclass(frozen=True)
class Request:
    """What a group asks of its engines' adapter (from ``spec.transfer``)."""

    mode: SyncModeName
    staging: Staging
    verify: bool


@dataclass(frozen=True)
class Refusal:
    """Why an adapter cannot serve a request: ``reason`` is CamelCase, ``message`` names adapter and capability."""

    reason: str
    message: str


def refusal(adapter: str, request: Request) -> Refusal | None:
    """None when ``adapter`` can do everything ``request`` asks; else the first thing it cannot."""
    kind = ENGINE_KINDS.get(adapter)  # type: ignore[call-overload]
    if kind is None:
        return Refusal("UnknownAdapter", f"inference.adapter {adapter!r} is not one of {', '.join(ADAPTERS)}")
    caps = kind.capabilities
    if caps is None:
        return Refusal("AdapterUnavailable", unavailable_message(kind))
    if request.mode not in caps.modes:
        return Refusal(
            "AdapterLacksCapability",
            f"inference.adapter {adapter!r} cannot sync in transfer.mode {request.mode!r} "
            f"(it supports {', '.join(sorted(caps.modes))})",
        )
    stagings = caps.stagings(request.mode)
    if request.staging not in stagings:
        return Refusal(
            "AdapterLacksCapability",
            f"inference.adapter {adapter!r} cannot do transfer.targetStaging {request.staging!r} in transfer.mode "
            f"{request.mode!r} (it supports {', '.join(sorted(stagings))})",
        )
    if request.verify and caps.verify == "none":
        return Refusal(
            "AdapterLacksCapability",
            f"inference.adapter {adapter!r} cannot verify what landed (transfer.verify: true); set transfer.verify: "
            "false to sync without verification",
        )
    return None
