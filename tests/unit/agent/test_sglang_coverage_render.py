"""The coverage page's rendering (weightsync_testing.sglang_coverage.render), from rows as the survey streams them:
which path each synced row takes, EP, and the counts."""

from __future__ import annotations

import re

from weightsync_testing.sglang_coverage import render

ROWS = [
    {"arch": "LlamaForCausalLM", "status": "synced", "reason": "", "parameters": 15, "path": "trace"},
    {"arch": "Qwen3MoeForCausalLM", "status": "synced", "reason": "", "parameters": 21, "path": "trace", "ep": [2, 8]},
    {
        "arch": "DeepseekV3ForCausalLM",
        "status": "synced",
        "reason": "TP 1 rank 0: model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight: no HF tensor writes it",
        "parameters": 40,
        "path": "engine replica",
        "ep": [2, 8],
    },
    {
        "arch": "MixtralForCausalLM",
        "status": "synced",
        "reason": "",
        "parameters": 17,
        "path": "trace",
        "ep_not_built": "TP 2 rank 1 EP 2: AssertionError: x",
    },
    {"arch": "PhiForCausalLM", "status": "mismatch", "reason": "engine replica: TP 2 rank 1: buffer x: bytes differ"},
    {"arch": "FooForCausalLM", "status": "not built", "reason": "transformers has no causal-LM class of this name"},
]


def row_of(page: str, arch: str) -> str:
    found = re.search(rf"^\| `{arch}` \| ([a-z ]+) \| (.*) \|$", page, flags=re.MULTILINE)
    assert found, arch
    return f"{found.group(1)}: {found.group(2)}"


def test_each_synced_row_names_its_path_and_ep() -> None:
    page = render(ROWS)
    assert row_of(page, "LlamaForCausalLM") == "synced: trace: every parameter bit-exact (15 on TP 8 rank 7)"
    assert row_of(page, "Qwen3MoeForCausalLM").endswith("; with EP 2 and 8: engine replica, bit-exact")
    deepseek = row_of(page, "DeepseekV3ForCausalLM")
    assert deepseek.startswith("synced: engine replica: every parameter, buffer and tensor attribute bit-exact")
    assert "the trace refuses TP 1 rank 0: model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight" in deepseek
    assert row_of(page, "MixtralForCausalLM").endswith("; EP not built here: TP 2 rank 1 EP 2: AssertionError: x")
    assert row_of(page, "PhiForCausalLM") == "mismatch: engine replica: TP 2 rank 1: buffer x: bytes differ"


def test_counts_and_the_unmapped_line() -> None:
    page = render(ROWS)
    assert "| synced | 4 |" in page and "| mismatch | 1 |" in page and "| not built | 1 |" in page
    assert "`FooForCausalLM` |" not in page  # listed in the line below the table instead
    assert re.search(r"^Also not built: 1 architectures .*`FooForCausalLM`\.$", page, flags=re.MULTILINE)
