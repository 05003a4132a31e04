"""A Megatron-style tensor-parallel module and the converter that gives weightsync the engines' HF tensors
(docs/train.md, "Megatron-style trainers").

Megatron-style trainers hold each TP rank's shard of fused, renamed tensors: ``linear_qkv`` (per rank, its key/
value head groups, each as ``[q heads of the group; k; v]``), ``linear_fc1`` (``[gate_r; up_r]``), row-parallel
``linear_proj``/``linear_fc2`` (split along the input), vocab-parallel embedding and output layer, and the norms
folded into the linears (``layer_norm_weight``). The engines want Hugging Face names and layouts. The converter
below is the Megatron → HF conversion Miles and slime do before their broadcast: it gathers each parameter over
the TP group (one parameter at a time) and splits and renames it; ``stage_module`` then copies what this rank's
targets need into its replica::

    report = stage_module(client, model, convert=MegatronToHF(tp_group, config))
    client.publish(step)

Run as ``torchrun --nproc-per-node=2 examples/trainers/megatron_style_tp.py --check``: each rank builds its
shards from the reference model's HF state, converts them back and compares (``tests/agent/test_trainers.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from weightsync_agent.client.modules import stage_module
from weightsync_testing.reference_engine.model import DEFAULT_CONFIG, ModelConfig, full_state
from weightsync_testing.reference_engine.torch_module import register_nested

# --- The trainer side: Megatron-style shards of a Llama-shaped model -----------------------------------------


def _rows(tensor: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    return tensor.chunk(tp, dim=0)[rank].contiguous()


def _cols(tensor: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    return tensor.chunk(tp, dim=1)[rank].contiguous()


def megatron_shards(hf: Mapping[str, torch.Tensor], tp: int, rank: int, config: ModelConfig) -> dict[str, torch.Tensor]:
    """TP rank ``rank``'s Megatron-style parameters, cut from the HF state ``hf``."""
    c, shards = config, {}
    per_group = c.num_heads // c.num_kv_heads
    groups = c.num_kv_heads // tp  # key/value head groups on each rank
    shards["embedding.word_embeddings.weight"] = _rows(hf["model.embed_tokens.weight"], tp, rank)
    for i in range(c.num_layers):
        hf_p, mg_p = f"model.layers.{i}", f"decoder.layers.{i}"
        q, k, v = (hf[f"{hf_p}.self_attn.{n}_proj.weight"] for n in ("q", "k", "v"))
        blocks = []
        for g in range(rank * groups, (rank + 1) * groups):
            blocks += [q[g * per_group * c.head_dim : (g + 1) * per_group * c.head_dim],
                       k[g * c.head_dim : (g + 1) * c.head_dim], v[g * c.head_dim : (g + 1) * c.head_dim]]  # fmt: skip
        shards[f"{mg_p}.self_attention.linear_qkv.weight"] = torch.cat(blocks)
        shards[f"{mg_p}.self_attention.linear_qkv.layer_norm_weight"] = hf[f"{hf_p}.input_layernorm.weight"].clone()
        shards[f"{mg_p}.self_attention.linear_proj.weight"] = _cols(hf[f"{hf_p}.self_attn.o_proj.weight"], tp, rank)
        gate, up = hf[f"{hf_p}.mlp.gate_proj.weight"], hf[f"{hf_p}.mlp.up_proj.weight"]
        shards[f"{mg_p}.mlp.linear_fc1.weight"] = torch.cat([_rows(gate, tp, rank), _rows(up, tp, rank)])
        shards[f"{mg_p}.mlp.linear_fc1.layer_norm_weight"] = hf[f"{hf_p}.post_attention_layernorm.weight"].clone()
        shards[f"{mg_p}.mlp.linear_fc2.weight"] = _cols(hf[f"{hf_p}.mlp.down_proj.weight"], tp, rank)
    shards["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
    shards["output_layer.weight"] = _rows(hf["lm_head.weight"], tp, rank)
    return shards


class MegatronStyleModel(torch.nn.Module):
    """Holds one TP rank's shards under their Megatron names (the forward is the trainer's own business)."""

    def __init__(self, shards: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in shards.items():
            register_nested(self, name, tensor)


# --- The converter: Megatron-style shards -> HF tensors ------------------------------------------------------


class MegatronToHF:
    """``convert(name, local_shard) -> [(hf_name, hf_tensor), ...]`` for :func:`stage_module`: gathers the
    parameter over the TP group (one at a time) and splits and renames it as HF does."""

    def __init__(self, group: dist.ProcessGroup | None, config: ModelConfig = DEFAULT_CONFIG) -> None:
        self.group, self.config = group, config
        self.tp = dist.get_world_size(group)

    def _gather(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Every TP rank's shard of this parameter, in rank order."""
        parts = [torch.empty_like(shard) for _ in range(self.tp)]
        dist.all_gather(parts, shard.contiguous(), group=self.group)
        return parts

    def __call__(self, name: str, shard: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        c = self.config
        if name == "embedding.word_embeddings.weight":
            return [("model.embed_tokens.weight", torch.cat(self._gather(shard)))]
        if name == "output_layer.weight":
            return [("lm_head.weight", torch.cat(self._gather(shard)))]
        if name == "decoder.final_layernorm.weight":
            return [("model.norm.weight", shard)]
        _, _, i, module, *rest = name.split(".")
        hf_p, tail = f"model.layers.{i}", ".".join(rest)
        if module == "self_attention" and tail == "linear_qkv.layer_norm_weight":
            return [(f"{hf_p}.input_layernorm.weight", shard)]
        if module == "mlp" and tail == "linear_fc1.layer_norm_weight":
            return [(f"{hf_p}.post_attention_layernorm.weight", shard)]
        if tail == "linear_proj.weight":
            return [(f"{hf_p}.self_attn.o_proj.weight", torch.cat(self._gather(shard), dim=1))]
        if tail == "linear_fc2.weight":
            return [(f"{hf_p}.mlp.down_proj.weight", torch.cat(self._gather(shard), dim=1))]
        if tail == "linear_fc1.weight":
            halves = [part.chunk(2) for part in self._gather(shard)]
            return [(f"{hf_p}.mlp.gate_proj.weight", torch.cat([h[0] for h in halves])),
                    (f"{hf_p}.mlp.up_proj.weight", torch.cat([h[1] for h in halves]))]  # fmt: skip
        if tail == "linear_qkv.weight":
            per_group = c.num_heads // c.num_kv_heads
            sizes = [per_group * c.head_dim, c.head_dim, c.head_dim]
            q, k, v = [], [], []
            for part in self._gather(shard):
                for block in part.split(sum(sizes)):
                    pq, pk, pv = block.split(sizes)
                    q.append(pq)
                    k.append(pk)
                    v.append(pv)
            attn = f"{hf_p}.self_attn"
            return [(f"{attn}.q_proj.weight", torch.cat(q)), (f"{attn}.k_proj.weight", torch.cat(k)),
                    (f"{attn}.v_proj.weight", torch.cat(v))]  # fmt: skip
        raise KeyError(f"no HF name for the Megatron-style parameter {name!r}")


class Collect:
    """A stager that keeps what it is given (the check below; a trainer stages into its WeightSyncClient)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def stage(self, name: str, tensor: torch.Tensor, *, strict: bool = True) -> int:
        self.tensors[name] = tensor.clone()
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="convert and compare with the HF state")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    hf = full_state(args.seed)
    model = MegatronStyleModel(megatron_shards(hf, tp, rank, DEFAULT_CONFIG))
    collected = Collect()
    report = stage_module(collected, model, convert=MegatronToHF(None), expected=set(hf))
    if args.check:
        equal = sum(torch.equal(collected.tensors.get(name, torch.empty(0)), tensor) for name, tensor in hf.items())
        model_bytes = sum(t.numel() * t.element_size() for t in hf.values())
        print(json.dumps({"rank": rank, "equal": equal, "expected": len(hf), "peak_bytes": report.peak_bytes,
                          "largest_parameter_bytes": report.largest_parameter_bytes,
                          "model_bytes": model_bytes}), flush=True)  # fmt: skip
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
