"""Stock SGLang as a weightsync target: the adapter, the manifest assembly, and the model trace that runs with
the engine's own SGLang code (docs/engines/sglang.md)."""
