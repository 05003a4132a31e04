"""vLLM's own code outside a vLLM server, for the GPU tests and benches that run it where only vLLM's Python can be
brought (the CPU build's; docs/engines/vllm.md, "What ran where"). Needs ``torch`` and ``vllm``; imports neither at
module level."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def vllm_tensor_digests() -> Callable[[torch.nn.Module], dict[str, str]]:
    """vLLM's ``compute_tensor_digests`` (the code behind ``/weight_checker``), its file loaded by path: importing it
    as ``vllm.model_executor.model_loader.weight_checksum`` runs the loader package's ``__init__``, which pulls vLLM's
    whole serving stack; the file itself needs only ``torch`` and vLLM's parameter classes."""
    import vllm

    path = Path(vllm.__file__).parent / "model_executor" / "model_loader" / "weight_checksum.py"
    spec = importlib.util.spec_from_file_location("vllm_weight_checksum", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    digests: Callable[[torch.nn.Module], dict[str, str]] = module.compute_tensor_digests
    return digests


def module_with(parameters: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A module tree whose ``named_parameters()`` are ``parameters`` under their dotted names (vLLM's, e.g.
    ``model.layers.0.self_attn.qkv_proj.weight``), each registered as it is (no copy, no gradient)."""
    import torch

    root = torch.nn.Module()
    for name, tensor in parameters.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return root
