"""The reference model as a trainable ``torch.nn.Module``: what a trainer wraps with FSDP2 in the trainer tests and
examples (examples/trainers/). Its parameters carry exactly the trainer-side names of
:func:`~weightsync_testing.reference_engine.model.full_shapes` (``model.layers.0.self_attn.q_proj.weight``, ...),
held by nested plain modules, and its forward is :func:`~weightsync_testing.reference_engine.model.forward_full`
over them, so a trained module's state is directly what the reference engines serve."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from weightsync_testing.reference_engine.model import DEFAULT_CONFIG, ModelConfig, forward_full


class ReferenceLM(torch.nn.Module):
    def __init__(self, state: Mapping[str, torch.Tensor], config: ModelConfig = DEFAULT_CONFIG) -> None:
        super().__init__()
        self.config = config
        for name, tensor in state.items():
            register_nested(self, name, tensor.detach().clone())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[T, vocab]`` of one sequence (``forward_full`` over this module's parameters)."""
        return forward_full(dict(self.named_parameters()), tokens, self.config)


def register_nested(owner: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """``tensor`` as the parameter with the dotted ``name`` of ``owner``, making the plain modules on its path (a
    parameter's own name cannot hold a dot)."""
    *path, leaf = name.split(".")
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, torch.nn.Module())
        owner = getattr(owner, part)
    owner.register_parameter(leaf, torch.nn.Parameter(tensor))


def training_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of one sequence: what one training step lowers."""
    logits = model(tokens[:-1])
    return torch.nn.functional.cross_entropy(logits, tokens[1:])
