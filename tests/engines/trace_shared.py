"""What the SGLang and vLLM shard-map trace tests share (``sglang/test_trace.py``, ``vllm/test_vllm_trace.py``).

:class:`SharedTraceTests` holds the tests that are the same for both engines; each engine's module subclasses it
with its :class:`TraceEngine` (what differs: version, architectures, hand-written layout, workarounds, consumer)
and its own fixtures (``tiny``, ``engine_side``, ``traces``, ``vocab500``). The tests stay in the engines'
directories, not in one module here: tests/conftest.py groups the xdist workers by directory, and a module here
would be a group of its own, tracing every model again in another worker where the engine-specific tests (vLLM's
CLI check and ``--dtype auto``) read the same session traces.

:class:`TraceEngine` also runs things: the trace CLI, the engine-venv helper script (``ENGINE_SIDE`` plus each
engine's body), and the differential check of a trace against a plain ``narrow``/``cat`` assembly in that venv.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest

import weightsync_engine.trace
from weightsync_agent.layout.manifest import Manifest

TRACE_SCRIPT = Path(weightsync_engine.trace.__file__)
CASES = [(tp, rank) for tp in (1, 2, 4) for rank in range(tp)]
HIDDEN = 128  # both tiers' tiny models (weightsync_testing.sglang_models.SHAPE)
Traces = dict[tuple[str, int, int], dict[str, Any]]


@dataclass(frozen=True)
class TraceEngine:
    """One engine, as the shared tests see it, and the ways of running its trace."""

    name: str  # the trace CLI's engine argument, and the package the import-failure test hides
    python: str  # the tier conftest's fixture of the engine venv's python
    version: str  # the pinned version the trace reports as ``<name>_version``
    archs: tuple[str, ...]  # the tiny models ``traces`` holds at every (tp, rank) of CASES
    expected_layout: Callable[[str, int, int], dict[str, dict[str, Any]]]
    ordered: bool  # the hand-written layout is in the engine's named_parameters() order
    layers: dict[str, Any] | None  # the ``layers`` of a bfloat16 trace, where the engine reduces them
    loaded: dict[str, Any]  # what the engine side's load reports besides the comparison
    workarounds: frozenset[str]
    groups: Callable[[int, int], dict[str, list[int]]]  # (tp, rank) -> the fake groups' [rank, size]
    groups_read: Callable[[str], set[str]]  # arch -> the groups the model must have read
    layered: tuple[str, ...]  # workarounds that must be applied and used on at least one layer
    failure_note: str | None  # what a failed trace's stderr line must also carry
    assemble: Callable[[int, dict[str, Any], dict[str, list[int]]], Manifest]  # (rank, trace, weights_info)
    timings: dict[str, dict[str, float]] = field(default_factory=dict)

    def run_trace(
        self, python: Path, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """The trace script as the adapter runs it: its CLI, in the engine venv."""
        command = [str(python), str(TRACE_SCRIPT), self.name, *args]
        return subprocess.run(command, capture_output=True, text=True, env=env or clean_env(), timeout=300, check=False)

    def write_engine_side(self, tmp_path_factory: pytest.TempPathFactory, body: str) -> Path:
        """The engine-venv helper script: ``ENGINE_SIDE`` (the engine's trace module as ``tm``, ``diff``), then
        ``body``, which defines ``import_engine()`` and ``load(lib, model, weights)`` and runs ``sys.argv[2:]``."""
        path = tmp_path_factory.mktemp(f"{self.name}-trace-helper") / "trace_helper.py"
        path.write_text(f"ENGINE = {self.name!r}\n{ENGINE_SIDE}{body}")
        return path

    def run_helper(self, python: Path, helper: Path, *args: str) -> Any:
        """A command of the engine-venv helper script (``write_engine_side``): its last stdout line, as JSON."""
        done = subprocess.run(
            [str(python), str(helper), str(TRACE_SCRIPT), *args],
            capture_output=True,
            text=True,
            env=clean_env(),
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else None

    def manifest(self, rank: int, result: dict[str, Any]) -> Manifest:
        """The engine's consumer run on a trace, at made-up addresses."""
        return self.assemble(rank, result, fake_weights_info(result))

    def differential(
        self,
        python: Path,
        engine_side: Path,
        model: Path,
        traced: dict[tuple[int, int], dict[str, Any]],
        tmp_path: Path,
    ) -> None:
        """Inside the engine venv: a bf16 model per (tp, rank), built as the engine builds it and loaded by the
        engine's own load path from seeded random HF tensors, equals assembly from the traced parts (narrow, place,
        zero padding), bit for bit, for every parameter."""
        jobs = []
        for (tp, rank), result in traced.items():
            path = tmp_path / f"trace-{model.name}-{tp}-{rank}.json"
            path.write_text(json.dumps(result))
            jobs.append({"tp": tp, "rank": rank, "trace": str(path)})
        (tmp_path / "jobs.json").write_text(json.dumps(jobs))
        started = time.monotonic()
        results = self.run_helper(python, engine_side, "diff", str(model), str(tmp_path / "jobs.json"))
        print(f"\ndifferential {model.name}: {len(jobs)} ranks in {time.monotonic() - started:.1f} s", file=sys.stderr)
        assert len(results) == len(traced)
        for result in results:
            where = f"{model.name} TP{result['tp']} r{result['rank']}"
            assert result["untraced"] == [], where
            assert result["mismatched"] == [], where
            assert result["checked"] == len(traced[result["tp"], result["rank"]]["tensors"]) > 0, where
            for key, want in self.loaded.items():
                assert result[key] == want, where


# ---------------------------------------------------------------- running things


class TraceServer:
    """``trace.py ENGINE --serve`` in the engine venv: the engine imported once, then a forked child per trace (the
    CLI's answers, for the import's 10 s once instead of per trace). :meth:`run` answers as
    :meth:`TraceEngine.run_trace` does; tests that change the trace's environment (a hidden package) use the CLI."""

    def __init__(self, engine: str, python: Path, log: Path) -> None:
        self._log = log.open("w")
        self._process = subprocess.Popen(
            [str(python), str(TRACE_SCRIPT), engine, "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=clean_env(),
        )

    def run(self, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        process = self._process
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps({"argv": list(args)}) + "\n")
        process.stdin.flush()
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            assert selector.select(timeout), f"no answer from the trace server in {timeout:g} s: {args}"
        line = process.stdout.readline()
        assert line, f"the trace server exited ({process.poll()}): see {self._log.name}"
        answer = json.loads(line)
        return subprocess.CompletedProcess(list(args), answer["returncode"], answer["stdout"], answer["stderr"])

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._log.close()


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


# ---------------------------------------------------------------- the hand-written layout


def part(source: str, full: list[int], dim: int, start: int, length: int, at: tuple[int, ...] = ()) -> dict[str, Any]:
    return {"source": source, "full_shape": full, "dim": dim, "start": start, "length": length, "at": list(at)}


def whole(name: str, full: list[int]) -> dict[str, Any]:
    return {"shape": full, "cat_dim": 0, "parts": [part(name, full, 0, 0, full[0])]}


def rows(name: str, full: list[int], n: int, rank: int) -> dict[str, Any]:
    return {"shape": [n, *full[1:]], "cat_dim": 0, "parts": [part(name, full, 0, rank * n, n)]}


def columns(name: str, full: list[int], n: int, tp: int, rank: int) -> dict[str, Any]:
    if tp == 1:  # a whole tensor: the trace names no sliced dim, so dim 0 and cat_dim 0
        return whole(name, full)
    return {"shape": [full[0], n], "cat_dim": 1, "parts": [part(name, full, 1, rank * n, n)]}


def layer_norms(p: str) -> dict[str, dict[str, Any]]:
    """A decoder layer's two norms, whole, in the order both engines hold them."""
    return {p + n: whole(p + n, [HIDDEN]) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}


def fake_weights_info(result: dict[str, Any]) -> dict[str, list[int]]:
    """Addresses for the traced rank as an engine would publish them (``[data_ptr, numel, element_size]``)."""
    weights_info, address = {}, 1 << 20
    for entry in result["tensors"]:
        numel = 1
        for n in entry["shape"]:
            numel *= n
        weights_info[entry["name"]] = [address, numel, 2]
        address += numel * 2 + 64
    return weights_info


# ---------------------------------------------------------------- tests


class SharedTraceTests:
    """The trace tests both engines pass; a subclass names its engine."""

    engine: ClassVar[TraceEngine]

    @pytest.fixture
    def engine_python(self, request: pytest.FixtureRequest) -> Path:
        """The engine venv's python (the tier conftest's fixture: skips or fails as the tier does)."""
        python: Path = request.getfixturevalue(self.engine.python)
        return python

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "arch" in metafunc.fixturenames:
            metafunc.parametrize("arch", self.engine.archs)
        if "rank" in metafunc.fixturenames:
            metafunc.parametrize(("tp", "rank"), CASES, ids=[f"tp{t}-r{r}" for t, r in CASES])

    def test_trace_matches_the_hand_written_layout(self, traces: Traces, arch: str, tp: int, rank: int) -> None:
        result = traces[arch, tp, rank]
        version = result[f"{self.engine.name}_version"]
        assert (version, result["tp_size"], result["tp_rank"]) == (self.engine.version, tp, rank)
        assert result["dtype"] == "bfloat16"
        assert result["refused"] == []
        assert result["unused_sources"] == []
        if self.engine.layers is not None:
            assert result["layers"] == self.engine.layers
        expected = self.engine.expected_layout(arch, tp, rank)
        tensors = result["tensors"]
        got = {t["name"]: {"shape": t["shape"], "cat_dim": t["cat_dim"], "parts": t["parts"]} for t in tensors}
        if self.engine.ordered:  # every parameter, and in named_parameters() order where the layout is written in it
            assert list(got) == list(expected)
        else:
            assert sorted(got) == sorted(expected)
        for name, want in expected.items():
            assert got[name] == want, name
        assert {t["padding"] for t in tensors} == {0}
        assert {t["dtype"] for t in tensors} == {"bfloat16"}

    def test_differential_load_equals_assembly_from_parts(
        self, engine_python: Path, engine_side: Path, tiny: dict[str, Path], traces: Traces, tmp_path: Path, arch: str
    ) -> None:
        traced = {c: traces[(arch, *c)] for c in CASES}
        self.engine.differential(engine_python, engine_side, tiny[arch], traced, tmp_path)

    def test_workarounds_are_reported_and_used(self, traces: Traces) -> None:
        for (arch, tp, rank), result in traces.items():
            entries = {w["name"]: w for w in result["workarounds"]}
            assert set(entries) == self.engine.workarounds, (arch, tp, rank)
            groups = entries["fake_parallel_groups"]
            assert groups["applied"] and groups["used"]
            for group, want in self.engine.groups(tp, rank).items():
                assert groups["groups"][group] == want, group
            assert self.engine.groups_read(arch) <= set(groups["read"]), groups["read"]
            for name in self.engine.layered:
                assert entries[name]["applied"] and entries[name]["used"] and entries[name]["layers"] >= 1, name

    def test_vocab_padding_on_the_last_rank_is_traced(
        self,
        engine_python: Path,
        engine_side: Path,
        vocab500: tuple[Path, dict[str, Any], dict[str, Any]],
        tmp_path: Path,
    ) -> None:
        """Vocab 500 at TP 2: the engine pads to 512 (a multiple of 64), 256 rows a rank; rank 1 holds 244 real rows
        and 12 that load_weights zero-fills. Those are the entry's ``padding``: the model holds zeros there, as the
        engine does."""
        model, first, last = vocab500
        assert first["refused"] == last["refused"] == []
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            head = {t["name"]: t for t in first["tensors"]}[name]
            assert (head["shape"], head["parts"], head["padding"]) == (
                [256, HIDDEN],
                [part(name, [500, HIDDEN], 0, 0, 256)],
                0,
            )
            tail = {t["name"]: t for t in last["tensors"]}[name]
            assert (tail["shape"], tail["parts"], tail["padding"]) == (
                [256, HIDDEN],
                [part(name, [500, HIDDEN], 0, 256, 244)],
                12,
            )
        (tmp_path / "diff").mkdir()
        self.engine.differential(engine_python, engine_side, model, {(2, 0): first, (2, 1): last}, tmp_path / "diff")
        assert self.engine.manifest(1, last).by_name()["lm_head.weight"].padding == 12

    def test_bad_arguments_are_one_stderr_line(self, engine_python: Path, tmp_path: Path) -> None:
        nope = str(tmp_path / "nope")
        done = self.engine.run_trace(engine_python, "--model", nope, "--tp", "1", "--rank", "0", "--dtype", "auto")
        assert done.returncode == 1 and done.stdout == ""
        assert done.stderr.count("\n") == 1 and "does not exist" in done.stderr, done.stderr
        if self.engine.failure_note is not None:
            assert self.engine.failure_note in done.stderr
        done = self.engine.run_trace(engine_python, "--model", str(tmp_path), "--tp", "2", "--rank", "2")
        assert (
            done.returncode == 2 and done.stderr.count("\n") == 1 and "--rank 2 is not a rank of --tp 2" in done.stderr
        )

    def test_import_failure_names_the_package(self, engine_python: Path, tiny: dict[str, Path], tmp_path: Path) -> None:
        name = self.engine.name
        hidden = f"raise ModuleNotFoundError(\"No module named '{name}'\", name='{name}')\n"
        (tmp_path / f"{name}.py").write_text(hidden)
        env = {**clean_env(), "PYTHONPATH": str(tmp_path)}
        done = self.engine.run_trace(engine_python, "--model", str(tiny["llama"]), "--tp", "1", "--rank", "0", env=env)
        assert done.returncode == 1 and done.stdout == ""
        assert done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith(f"trace_model: cannot import {name}"), done.stderr

    def test_timings_are_reported(self, traces: Traces) -> None:
        for key, result in traces.items():
            assert 0 < result["seconds"]["total"] < 120, (key, result["seconds"])
        print("\n" + json.dumps(self.engine.timings, indent=1), file=sys.stderr)


# ---------------------------------------------------------------- the engine-venv side (run with the engine's python)

ENGINE_SIDE = r'''
"""Engine-venv helper of the trace tests (tests/engines/trace_shared.py): argv[1] is weightsync_engine/trace.py (the
engine's trace_model through it, for its build recipe), argv[2] the command."""
import importlib.util, json, sys, time
from pathlib import Path

spec = importlib.util.spec_from_file_location("weightsync_engine_trace", sys.argv[1])
entry = importlib.util.module_from_spec(spec)
spec.loader.exec_module(entry)
tm = entry.engine_module(ENGINE)


def diff(model_dir, jobs_file):
    lib = import_engine()
    torch = lib.torch
    shapes = tm.core.read_checkpoint(Path(model_dir))
    generator = torch.Generator().manual_seed(7)
    sources = {n: torch.randn(s, generator=generator).to(torch.bfloat16) for n, s in shapes.items()}
    results = []
    for job in json.loads(Path(jobs_file).read_text()):
        started = time.monotonic()
        trace = json.loads(Path(job["trace"]).read_text())
        model, _ = tm.build_model(lib, Path(model_dir), job["tp"], job["rank"], "bfloat16", tm.core.Workarounds())
        with torch.no_grad():
            for p in model.parameters():
                p.data.fill_(float("nan"))
        weights = ((n, t.clone()) for n, t in sources.items())  # a loader may change its input in place
        reported = load(lib, model, weights)
        traced = {t["name"]: t for t in trace["tensors"]}
        untraced, mismatched, checked = [], [], 0
        for name, param in model.named_parameters():
            entry = traced.get(name)
            if entry is None:
                untraced.append(name)
                continue
            # Assembled here, independently of weightsync's own code: per destination sub-tensor (``at``),
            # the parts concatenated along cat_dim, then zero padding.
            groups = {}
            for p in entry["parts"]:
                piece = sources[p["source"]].narrow(p["dim"], p["start"], p["length"])
                groups.setdefault(tuple(p["at"]), []).append(piece)
            built = torch.zeros(entry["shape"], dtype=torch.bfloat16)
            for at, pieces in groups.items():
                dim = entry["cat_dim"] - len(at)
                block = torch.cat(pieces, dim=dim)
                (built[at] if at else built).narrow(dim, 0, block.shape[dim]).copy_(block)
            same = (
                list(param.shape) == entry["shape"] == list(built.shape)
                and str(param.dtype).removeprefix("torch.") == entry["dtype"]
                and torch.equal(param.data.view(torch.int16), built.view(torch.int16))
            )
            checked += 1
            if not same:
                mismatched.append(name)
        results.append({
            "tp": job["tp"], "rank": job["rank"], "checked": checked, "untraced": untraced, "mismatched": mismatched,
            **reported, "seconds": round(time.monotonic() - started, 2),
        })
    return results

'''
