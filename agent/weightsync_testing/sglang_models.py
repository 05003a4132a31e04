"""Tiny local Hugging Face models for the stock-engine test tiers (SGLang, vLLM), and an HF reference forward.

Two sides in one file:

* **project side** (this venv, stdlib only): :func:`ensure_tiny_model` returns a cached model directory,
  making it once by running this file with an engine venv's python (SGLang's or vLLM's); :func:`hf_greedy`
  runs the HF reference forward the same way. The project venv has no ``transformers``; each engine venv has
  the exact version its engine pins.
* **engine-venv side** (``python sglang_models.py make|greedy|logprobs ...``): builds the model with
  ``transformers`` from a config, seeded random weights, and a byte-level BPE tokenizer trained locally with
  ``tokenizers`` on a built-in corpus (no download; the CI machine cannot reach Hugging Face).

A model directory is deterministic for (architecture, head_dim, seed, dtype, :data:`MAKER_VERSION`, the engine
venv's torch/transformers/tokenizers versions); its name carries the first five, and a ``weightsync-tiny.json``
written last marks it complete. ``head_dim`` is 16 by default; vLLM's CPU attention needs 32 or more
(stock-engines note §7b: 16 kills its server at the first request), so the vLLM tier asks for 32.

Architectures: ``llama`` and ``qwen3`` (no biases), ``qwen2`` (q/k/v biases, as Qwen2 always has), ``qwen3_moe``
(every layer a 4-expert MoE, :data:`MOE_SHAPE`). Qwen2 has no ``head_dim`` setting (HF and vLLM both use
hidden / heads), so its head count follows ``head_dim``: 8 heads / 4 KV heads at 16, 4 / 2 at 32.
``gemma2`` (Gemma-2, :data:`GEMMA2_SHAPE`: tied embeddings, its derived norm buffers in SGLang).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MAKER_VERSION = 1
ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "gemma2")
DTYPES = ("float32", "bfloat16")
VOCAB = 512
STAMP = "weightsync-tiny.json"
HEAD_DIMS = (16, 32)

# vocab 512, hidden 128, 2 layers, 8 heads / 4 KV heads, head_dim 16, MLP 256 (stock-engines note §4, §5b).
SHAPE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2 (the config's pad/bos/eos)
# qwen3_moe: every layer sparse, 4 experts of MLP 64, 2 per token (the SGLang trace test's MoE shape).
MOE_SHAPE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
#: What a DeepSeek config needs to build on CPU beside its shape: YaRN rope scaling (SGLang's CPU rope for MLA asserts
#: it), and what DeepSeek's own config class (remote code) carries, transformers' port lacks, and SGLang reads. The
#: coverage survey's tiny configs use it too (sglang_coverage.FAMILY).
DEEPSEEK_CONFIG: dict[str, Any] = {
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "moe_layer_freq": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "ep_size": 1,
}
# deepseek_v3: Kimi-K2's architecture shrunk: MLA with q-LoRA (q_lora_rank 64, kv_lora_rank 32, rope 16 + nope 16,
# v 16), layer 0 dense, layer 1 a MoE of 4 routed experts (MLP 64, 2 per token, aux-loss-free sigmoid routing with
# its e_score_correction_bias) and 1 shared expert; YaRN rope scaling (SGLang's CPU MLA rope asserts it).
DEEPSEEK_V3_SHAPE: dict[str, Any] = {
    "num_key_value_heads": 8,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    **DEEPSEEK_CONFIG,
}
# gemma2: Gemma-2's own settings (alternating sliding-window and global attention, GeGLU, four norms per layer, each
# scaling by 1 + weight, which SGLang keeps as the derived gemma_weight buffer; final logit soft-capping), with word
# embeddings tied as Gemma-2 always ships them (SGLang's Gemma2ForCausalLM has no lm_head). Soft-capping off, both
# kinds: SGLang's CPU attention (torch_native) ignores the attention logits' cap, so its forward would differ from HF's;
# and on a CPU its final-logit cap runs a Triton kernel (``kernels/ops/activation/softcap.py``), which fails the
# server's first forward with "RuntimeError: 0 active drivers ([]). There should only be one." Neither is a weight.
GEMMA2_SHAPE: dict[str, Any] = {
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_act": "gelu_pytorch_tanh",  # what SGLang reads (Gemma-2's released configs carry both)
    "query_pre_attn_scalar": 16,
    "sliding_window": 64,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
}
# Random weights drawn with this std (HF's default 0.02 gives near-uniform logits, so greedy argmax would
# hinge on rounding noise; 0.25 keeps the top logit well separated while staying far from overflow).
INIT_STD = 0.25


def default_cache() -> Path:
    return Path(os.environ.get("WEIGHTSYNC_CACHE") or Path.home() / ".cache" / "weightsync")


# ---------------------------------------------------------------- project side


def made_once(out: Path, make: Callable[[Path], None]) -> None:
    """Make directory ``out`` (``make`` fills a fresh directory beside it, which then takes its name) unless it
    holds its :data:`STAMP`; under a lock beside it, so test workers asking at once make it once and none of them
    replaces it under another that reads it."""
    with open(out.with_name(f".{out.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / STAMP).is_file():
            return
        work = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
        try:
            make(work)
            shutil.rmtree(out, ignore_errors=True)
            work.rename(out)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def ensure_tiny_model(
    python: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    dtype: str = "float32",
    head_dim: int = 16,
    cache: Path | None = None,
    timeout: float = 300.0,
    shape: dict[str, Any] | None = None,
) -> Path:
    """The directory of a tiny ``arch`` model (config, safetensors, tokenizer), made once with ``python``
    (an engine venv's interpreter) and cached under ``<cache>/models/``. ``head_dim`` other than 16 widens
    the attention (8 heads / 4 KV heads of ``head_dim`` each; the hidden size stays 128). ``shape``: config keys
    to override (a bigger model for a benchmark; its hash names the directory)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny model architecture {arch!r} (known: {', '.join(ARCHS)})")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"unsupported head_dim {head_dim} (known: {', '.join(map(str, HEAD_DIMS))})")
    root = (cache or default_cache()) / "models"
    # The default keeps its historical name, so the SGLang tier's cached models stay valid.
    variant = "" if head_dim == 16 else f"-hd{head_dim}"
    if shape:
        variant += "-" + hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:8]
    out = root / f"tiny-{arch}{variant}-s{seed}-{dtype}-v{MAKER_VERSION}"
    root.mkdir(parents=True, exist_ok=True)

    def make(work: Path) -> None:
        args = ["make", "--arch", arch, "--seed", str(seed), "--dtype", dtype, "--out", str(work)]
        args += ["--head-dim", str(head_dim)]
        if shape:
            args += ["--shape", json.dumps(shape)]
        _run_engine_side(python, args, timeout)

    made_once(out, make)
    return out


#: What a DeepSeek-V3 FP8 checkpoint block-quantizes: every decoder layer's attention and MLP projection (experts
#: and the shared expert too), never the router, the embeddings, the norms or the head.
FP8_QUANTIZED = r"^model\.layers\.\d+\.(self_attn|mlp)\..*\.weight$"
FP8_NOT_QUANTIZED = "mlp.gate.weight"  # the router


def ensure_fp8_model(model_dir: Path, block: tuple[int, int] = (16, 16)) -> Path:
    """``model_dir`` as a DeepSeek-V3-style FP8 block checkpoint (the format Kimi-K2 and DeepSeek-V3 ship):
    :func:`fp8_checkpoint`, made once beside ``model_dir`` (this process: torch and safetensors). ``block``: the tiny
    models' sizes are multiples of 16, not of the published 128 (SGLang checks that a block divides each quantized
    weight)."""
    out = model_dir.with_name(f"{model_dir.name}-fp8b{block[0]}x{block[1]}")
    made_once(out, lambda work: fp8_checkpoint(model_dir, work, block))
    return out


def fp8_checkpoint(model_dir: Path, out: Path, block: tuple[int, int]) -> None:
    """Write ``model_dir`` into directory ``out`` as an FP8 block checkpoint: its tensors as :func:`fp8_state` makes
    them, ``quantization_config`` in ``config.json``. Runs in either venv (torch and safetensors)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors", STAMP))
    save_file(fp8_state(load_file(str(next(model_dir.glob("*.safetensors")))), block), str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block)}  # fmt: skip
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / STAMP).write_text(json.dumps({"fp8_of": model_dir.name, "block": list(block)}) + "\n")


def fp8_state(values: dict[str, Any], block: tuple[int, int]) -> dict[str, Any]:
    """HF-named tensors as an FP8 block checkpoint stores them: each projection (:data:`FP8_QUANTIZED`) as e4m3 with
    its float32 ``<name>_scale_inv`` in ``block`` blocks, by weightsync's own quantizer (``layout/quantize.py``, as a
    source quantizes a BF16 trainer's tensors); everything else bfloat16."""
    import re

    torch: Any = importlib.import_module("torch")
    quantizer = _quantizer()
    quantized = re.compile(FP8_QUANTIZED)
    state: dict[str, Any] = {}
    for name, tensor in values.items():
        bf16 = tensor.to(torch.bfloat16)
        if tensor.dim() == 2 and quantized.match(name) and not name.endswith(FP8_NOT_QUANTIZED):
            state[name], state[f"{name}_scale_inv"] = quantizer.fp8_block(bf16, block)
        else:
            state[name] = bf16
    return state


def ensure_int8_model(model_dir: Path) -> Path:
    """``model_dir`` as a compressed-tensors W8A8 INT8 checkpoint (symmetric per output channel, dynamic per-token
    activations: what vLLM's CPU build computes with, docs/engines/vllm.md), made once beside it by weightsync's own
    quantizer (:func:`w8a8_state`), in the model's own dtype."""
    out = model_dir.with_name(f"{model_dir.name}-w8a8")
    made_once(out, lambda work: w8a8_checkpoint(model_dir, work))
    return out


def ensure_fp8_channel_model(model_dir: Path) -> Path:
    """``model_dir`` as a compressed-tensors W8A8 FP8 checkpoint (e4m3, symmetric per output channel, dynamic
    per-token activations: vLLM's CPU build computes with it), made once beside it as :func:`ensure_int8_model`."""
    out = model_dir.with_name(f"{model_dir.name}-w8a8fp8")
    made_once(out, lambda work: w8a8_checkpoint(model_dir, work, kind="float"))
    return out


def w8a8_checkpoint(model_dir: Path, out: Path, kind: str = "int") -> None:
    """A compressed-tensors W8A8 channel checkpoint of ``model_dir``: INT8 (``kind`` ``int``) or FP8 (``float``)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors", STAMP))
    values = load_file(str(next(model_dir.glob("*.safetensors"))))
    save_file(w8a8_state(values, fp8=kind == "float"), str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    scheme = {"num_bits": 8, "type": kind, "symmetric": True}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": f"{kind}-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {**scheme, "strategy": "channel", "dynamic": False},
                                      "input_activations": {**scheme, "strategy": "token", "dynamic": True}}},
        "ignore": ["lm_head"],
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / STAMP).write_text(json.dumps({"w8a8_of": model_dir.name, "type": kind}) + "\n")


def w8a8_state(values: dict[str, Any], *, fp8: bool = False) -> dict[str, Any]:
    """HF-named tensors as a W8A8 INT8 (``fp8``: FP8 e4m3) checkpoint stores them: each projection
    (:data:`FP8_QUANTIZED`'s names) quantized with its ``weight_scale`` per output channel in the tensor's dtype, by
    weightsync's quantizer (as a source quantizes a trainer's tensors); everything else as it is."""
    import re

    quantizer = _quantizer()
    quantized = re.compile(FP8_QUANTIZED)
    state: dict[str, Any] = {}
    for name, tensor in values.items():
        if tensor.dim() == 2 and quantized.match(name) and not name.endswith(FP8_NOT_QUANTIZED):
            channel = quantizer.fp8_channel if fp8 else quantizer.int8_channel
            state[name], state[name.removesuffix("weight") + "weight_scale"] = channel(tensor, tensor.dtype)
        else:
            state[name] = tensor
    return state


def _quantizer() -> Any:
    """``weightsync_agent.layout.quantize``: imported where weightsync is installed, else (an engine venv running
    this file) loaded from its path in this checkout (it imports only torch)."""
    try:
        return importlib.import_module("weightsync_agent.layout.quantize")
    except ImportError:
        path = Path(__file__).resolve().parents[1] / "weightsync_agent" / "layout" / "quantize.py"
        spec = importlib.util.spec_from_file_location("_weightsync_quantize", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"weightsync's quantizer is not at {path}") from None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


def hf_greedy(
    python: str | Path, model_dir: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> list[dict[str, Any]]:
    """Greedy decoding of each prompt (token ids) with HF ``transformers`` (eager attention, the checkpoint's
    dtype) in the engine venv, one process for all prompts: per prompt ``{"output_ids": [...], "margins":
    [...]}``, where a margin is the gap between the chosen token's logit and the runner-up's (a small margin
    is a near-tie that rounding could flip)."""
    args = ["greedy", "--model", str(model_dir), "--max-new-tokens", str(max_new_tokens)]
    args += ["--input-ids", ";".join(",".join(str(i) for i in ids) for ids in prompts)]
    answer: list[dict[str, Any]] = json.loads(_run_engine_side(python, args, 300.0).strip().splitlines()[-1])
    return answer


def hf_prompt_logprobs(python: str | Path, model_dir: Path, input_ids: Sequence[int]) -> list[float]:
    """HF ``transformers``' logprob of each of ``input_ids`` after the first (teacher forcing, eager attention, the
    checkpoint's dtype), in the engine venv: what a trainer's forward gives its canary (the semantic gate)."""
    args = ["logprobs", "--model", str(model_dir), "--input-ids", ",".join(str(i) for i in input_ids)]
    answer: list[float] = json.loads(_run_engine_side(python, args, 300.0).strip().splitlines()[-1])
    return answer


def trained_state(model_dir: Path, step: int) -> dict[str, Any]:
    """A trainer's weights after ``step`` steps, as the engine tests publish them: the checkpoint's tensors (torch, in
    this process), each moved by a perturbation seeded with ``step``, in name order."""
    import torch
    from safetensors.torch import load_file

    state = load_file(str(next(model_dir.glob("*.safetensors"))))
    generator = torch.Generator().manual_seed(step)
    return {
        name: (t + 0.05 * torch.randn(t.shape, generator=generator, dtype=t.dtype)).contiguous()
        for name, t in sorted(state.items())
    }


def with_weights(model_dir: Path, state: dict[str, Any], out: Path) -> Path:
    """``model_dir`` copied to ``out`` with ``state`` as its weights (for the HF reference forward)."""
    from safetensors.torch import save_file

    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(state, str(out / "model.safetensors"))
    return out


def _run_engine_side(python: str | Path, args: list[str], timeout: float) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        [str(python), "-I", __file__, *args], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"sglang_models.py {args[0]} failed (exit {done.returncode}):\n{tail}")
    return done.stdout


# ---------------------------------------------------------------- engine-venv side


def _corpus(seed: int) -> list[str]:
    """A deterministic pseudo-text corpus: enough distinct byte pairs to learn ~250 merges."""
    words = [
        "weight", "sync", "engine", "trainer", "rank", "tensor", "shard", "bucket", "verify", "commit",
        "pause", "resume", "version", "layer", "token", "model", "write", "read", "graph", "round",
        "the", "a", "of", "to", "and", "in", "is", "on", "with", "for", "from", "every", "one", "two",
    ]  # fmt: skip
    state = hashlib.sha256(f"weightsync-tiny-corpus-{seed}".encode()).digest()
    lines = []
    for i in range(600):
        state = hashlib.sha256(state).digest()
        picks = [words[b % len(words)] for b in state[:12]]
        lines.append(" ".join(picks) + f" {i} {state.hex()[:6]}.")
    return lines


def _tokenizer(seed: int, out: Path) -> None:
    tk: Any = importlib.import_module("tokenizers")
    tok = tk.Tokenizer(tk.models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    # Fill up to exactly VOCAB so that every id the model can emit decodes.
    missing = VOCAB - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<extra_{i}>" for i in range(missing)])
    if tok.get_vocab_size() != VOCAB:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB}")
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "model_max_length": SHAPE["max_position_embeddings"],
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def _make(
    arch: str, seed: int, dtype: str, out: Path, head_dim: int = 16, overrides: dict[str, Any] | None = None
) -> None:
    torch: Any = importlib.import_module("torch")
    transformers: Any = importlib.import_module("transformers")
    config_class = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "deepseek_v3": getattr(transformers, "DeepseekV3Config", None),
        "gemma2": transformers.Gemma2Config,
    }[arch]
    extra: dict[str, Any] = {} if arch == "qwen2" else {"attention_bias": False}
    if arch not in ("llama", "gemma2"):
        extra["sliding_window"] = None
    if arch == "qwen3_moe":
        extra.update(MOE_SHAPE)
    shape = {**SHAPE, "head_dim": head_dim}
    if arch == "deepseek_v3":  # MLA sets its own head sizes
        del shape["head_dim"]
        shape.update(DEEPSEEK_V3_SHAPE)
        extra = {}
    if arch == "gemma2":
        shape.update(GEMMA2_SHAPE)
    if arch == "qwen2":  # no head_dim setting: hidden / heads is the head size
        heads = shape["hidden_size"] // head_dim
        shape.update(num_attention_heads=heads, num_key_value_heads=heads // 2)
        del shape["head_dim"]
    shape.update(overrides or {})
    config = config_class(**shape, **extra, initializer_range=INIT_STD, torch_dtype=dtype)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):  # a scale near 1 (Gemma's norms scale by 1 + weight)
                center = 0.0 if arch == "gemma2" else 1.0
                param.copy_(center + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(INIT_STD * torch.randn(param.shape, generator=generator))
    model = model.to(getattr(torch, dtype))
    model.config.torch_dtype = dtype
    model.save_pretrained(str(out), safe_serialization=True)
    _tokenizer(seed, out)
    versions = {m: importlib.import_module(m).__version__ for m in ("torch", "transformers", "tokenizers")}
    stamp = {"arch": arch, "seed": seed, "dtype": dtype, "maker_version": MAKER_VERSION, "versions": versions}
    if head_dim != 16:
        stamp["head_dim"] = head_dim
    if overrides:
        stamp["shape"] = overrides
    (out / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")


def _hf_model(model_dir: Path) -> Any:
    """HF ``transformers``' model of ``model_dir`` (eager attention, the checkpoint's dtype), ready to evaluate."""
    transformers: Any = importlib.import_module("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager")
    model.eval()
    return model


def _greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[dict[str, Any]]:
    torch: Any = importlib.import_module("torch")
    model = _hf_model(model_dir)
    results = []
    for prompt in prompts:
        ids = list(prompt)
        margins = []
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                top = torch.topk(logits, 2)
                ids.append(int(top.indices[0]))
                margins.append(float(top.values[0] - top.values[1]))
        results.append({"output_ids": ids[len(prompt) :], "margins": margins})
    return results


def _prompt_logprobs(model_dir: Path, ids: list[int]) -> list[float]:
    torch: Any = importlib.import_module("torch")
    model = _hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    chosen = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1))
    return [float(x) for x in chosen.squeeze(1)]


def _token_ids(text: str) -> list[int]:
    """``"1,5,9"`` as token ids (the engine-side commands' ``--input-ids``)."""
    return [int(i) for i in text.split(",") if i]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make", help="write a tiny model directory")
    make.add_argument("--arch", choices=ARCHS, default="llama")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--dtype", choices=DTYPES, default="float32")
    make.add_argument("--head-dim", type=int, choices=HEAD_DIMS, default=16)
    make.add_argument("--out", type=Path, required=True)
    make.add_argument("--shape", type=json.loads, default=None, help="config keys to override, as a JSON object")
    greedy = sub.add_parser("greedy", help="HF greedy decoding; prints one JSON line")
    greedy.add_argument("--model", type=Path, required=True)
    greedy.add_argument("--input-ids", required=True, help="prompts separated by ';', token ids by ','")
    greedy.add_argument("--max-new-tokens", type=int, default=8)
    logprobs = sub.add_parser("logprobs", help="HF logprob of each prompt token after the first; one JSON line")
    logprobs.add_argument("--model", type=Path, required=True)
    logprobs.add_argument("--input-ids", required=True, help="token ids separated by ','")
    args = parser.parse_args(argv)
    if args.command == "make":
        args.out.mkdir(parents=True, exist_ok=True)
        _make(args.arch, args.seed, args.dtype, args.out, args.head_dim, args.shape)
        print(args.out)
    elif args.command == "logprobs":
        print(json.dumps(_prompt_logprobs(args.model, _token_ids(args.input_ids))))
    else:
        prompts = [_token_ids(p) for p in args.input_ids.split(";")]
        print(json.dumps(_greedy(args.model, prompts, args.max_new_tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
