"""Placeholder for ``vllm._custom_ops``, served only while SGLang constructs a ``RotaryEmbedding`` on CPU.

See ``sitecustomize.rotary_vllm_placeholder``: SGLang 0.5.23 imports ``rotary_embedding`` from here as a
fallback kernel that it never calls on the CPU path. Any other name is missing (``from ... import x`` raises
``ImportError``, as without vLLM), and calling ``rotary_embedding`` raises instead of computing anything.
"""

from __future__ import annotations

from typing import Any


def rotary_embedding(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError(
        "weightsync placeholder vllm._custom_ops.rotary_embedding was called: this SGLang runs the rotary fallback "
        "kernel on CPU, so the rotary_vllm_placeholder workaround (weightsync_testing/sglang_cpu) no longer holds"
    )
