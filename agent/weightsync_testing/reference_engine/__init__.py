"""The reference engine: a small tensor-parallel transformer behind SGLang-shaped HTTP (docs/reference-engine.md)."""
