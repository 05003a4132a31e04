"""The reference engine: a tiny tensor-parallel transformer (``model``) behind SGLang-shaped HTTP (``server``)."""
