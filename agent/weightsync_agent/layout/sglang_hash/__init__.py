"""SGLang's two per-parameter content hashes (``/weights_checker``), bit for bit as the engine computes them:
``gpu_tensor_hash`` for CUDA engines, ``sha256[:8]`` for CPU engines, so sources can hash what they write
without importing SGLang (docs/engines/sglang-hash.md)."""
