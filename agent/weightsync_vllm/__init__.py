"""weightsync's vLLM backend plugin: runs inside a stock vLLM server (docs/engines/vllm.md).

A ``vllm.general_plugins`` entry point (:func:`weightsync_vllm.plugin.register`) adds the ``weightsync``
``WeightTransferEngine`` (:mod:`weightsync_vllm.engine`), which receives a round's bytes over Mooncake into a
receive buffer (:mod:`weightsync_vllm.receive_buffer`) and applies them through vLLM's own layerwise reload.
This package imports only the standard library, ``torch``, ``vllm`` and ``mooncake``: it is installed into the
vLLM image, where weightsync itself is not.
"""
