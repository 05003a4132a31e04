"""weightsync's vLLM backend plugin: runs inside a stock vLLM server (docs/engines/vllm.md).

A ``vllm.general_plugins`` entry point (:func:`weightsync_engine.vllm.plugin.register`) adds the ``weightsync``
``WeightTransferEngine`` (:mod:`weightsync_engine.vllm.engine`), which receives a round's bytes over Mooncake into a
receive buffer (:mod:`weightsync_engine.vllm.receive_buffer`) and applies them through vLLM's own layerwise reload.
This package imports only the standard library, ``torch``, ``vllm`` and ``mooncake``: it is installed into the
vLLM image, where weightsync itself is not. Also vLLM's side of the shard-map trace (``trace_model.py``, run through
``../trace.py`` with vLLM's Python). Nothing is imported here: vLLM imports this package in every process.
"""
