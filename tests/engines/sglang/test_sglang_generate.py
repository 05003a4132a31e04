"""Greedy ``/generate`` of the stock SGLang server equals an HF ``transformers`` forward of the same weights
(computed in the SGLang venv: the project venv has no transformers)."""

from __future__ import annotations

from pathlib import Path

from sglang_helpers import generate

from weightsync_testing.sglang_models import hf_greedy
from weightsync_testing.sglang_server import SglangProcess

PROMPTS = [[1, 5, 9, 100, 200], [1, 300, 301, 302], [1, 42]]
NEW_TOKENS = 12


def test_project_venv_has_no_transformers() -> None:
    import importlib.util

    assert importlib.util.find_spec("transformers") is None


def test_greedy_generate_equals_hf(server: SglangProcess, sglang_py: Path, tiny_llama: Path) -> None:
    served = generate(server, PROMPTS, NEW_TOKENS)
    expected = hf_greedy(sglang_py, tiny_llama, PROMPTS, NEW_TOKENS)
    assert [a["output_ids"] for a in served] == [e["output_ids"] for e in expected]
    assert all(a["meta_info"]["finish_reason"]["type"] == "length" for a in served)
    # The comparison means something only if greedy choices are not near-ties.
    assert min(min(e["margins"]) for e in expected) > 1e-3
