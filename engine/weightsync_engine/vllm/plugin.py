"""The ``vllm.general_plugins`` entry point: registers the ``weightsync`` backend (vLLM calls it in every
process: the API server, the engine core and each worker) and installs the gated fixes of stock vLLM's CPU weight
updates (:mod:`weightsync_engine.vllm.cpu_moe_reload`, :mod:`weightsync_engine.vllm.cpu_int8_reload`)."""

from __future__ import annotations

#: The name vLLM's ``--weight-transfer-config '{"backend": ...}'`` selects the engine by.
BACKEND = "weightsync"


def register() -> None:
    # Imported here, not at module level: vLLM imports every general plugin's module early, and the engine
    # module imports vLLM's model-loader internals.
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "weightsync_engine.vllm.engine", "WeightsyncEngine")
    from weightsync_engine.vllm import cpu_int8_reload, cpu_moe_reload

    cpu_moe_reload.install_if_wanted()
    cpu_int8_reload.install_if_wanted()
