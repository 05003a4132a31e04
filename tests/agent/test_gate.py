"""The semantic gate: the canary's bounds and judgement, the driver's gated commit against fake engines, and gated
rounds through real agents into reference engines (against stock SGLang: tests/engines/sglang/
test_sglang_engine_replica.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from sync_helpers import TOKENS, group_spec, training_step
from test_rounds import FakeEngine, Log, make_plan, setup

from weightsync_agent.client.trainer import RoundOutcome
from weightsync_agent.rounds.canary import MAX_CANARY_TOKENS, Canary, judge
from weightsync_agent.rounds.driver import RoundDriver
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.reference_engine.model import forward_full, full_state
from weightsync_testing.trainer_ranks import publish_all


def canary(logprobs: Sequence[float] = (-1.0, -2.0, -0.5), tolerance: float = 0.01) -> Canary:
    return Canary.model_validate(
        {"inputIds": list(range(3, 4 + len(logprobs))), "logprobs": list(logprobs), "tolerance": tolerance}
    )


@given(
    st.lists(st.floats(min_value=-50, max_value=0), min_size=1, max_size=40),
    st.floats(min_value=1e-4, max_value=1.0),
    st.data(),
)
def test_scores_within_the_tolerance_pass_and_one_beyond_it_fails_naming_the_token(
    logprobs: list[float], tolerance: float, data: st.DataObject
) -> None:
    gate = canary(logprobs, tolerance)
    # 0.99: a difference of exactly the tolerance can round either way in float64
    near = [p + data.draw(st.floats(min_value=-0.99 * tolerance, max_value=0.99 * tolerance)) for p in logprobs]
    assert judge(gate, near) is None
    off = data.draw(st.integers(0, len(logprobs) - 1))
    near[off] = logprobs[off] - 2 * tolerance - 1e-3
    why = judge(gate, near)
    assert why is not None and f"token {off + 1} of the canary (id {gate.input_ids[off + 1]})" in why


def test_a_missing_or_non_finite_score_or_a_wrong_count_fails() -> None:
    gate = canary()
    assert "logprob none" in (judge(gate, [-1.0, None, -0.5]) or "")
    assert "off by inf" in (judge(gate, [-1.0, -2.0, math.nan]) or "")
    assert judge(gate, [-1.0, -2.0]) == "scored 2 tokens; the canary has 3 after the first"


LONG = {"inputIds": list(range(MAX_CANARY_TOKENS + 1)), "logprobs": [-1.0] * MAX_CANARY_TOKENS, "tolerance": 1}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"inputIds": [1], "logprobs": [], "tolerance": 0.1}, "inputIds"),
        ({"inputIds": [1, 2, 3], "logprobs": [-1.0], "tolerance": 0.1}, "one per token after the first"),
        ({"inputIds": [1, 2], "logprobs": [0.5], "tolerance": 0.1}, "logprobs.0"),
        ({"inputIds": [1, 2], "logprobs": [-1.0], "tolerance": 0}, "tolerance"),
        ({"inputIds": [1, -2], "logprobs": [-1.0], "tolerance": 0.1}, "inputIds.1"),
        (LONG, "inputIds"),
        ({"inputIds": [1, 2], "logprobs": [-1.0], "tolerance": 0.1, "extra": 1}, "extra"),
    ],
)
def test_a_malformed_canary_is_refused_naming_the_field(body: dict[str, object], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        Canary.model_validate(body)


@dataclass
class GatedEngine(FakeEngine):
    """A fake engine with the gate's two calls; ``reads`` is what its scoring returns."""

    gate_stagings: ClassVar[frozenset[str]] = frozenset({"live"})
    reads: list[float | None] = field(default_factory=lambda: [-1.0, -2.0, -0.5])
    applied: int = 0

    def apply(self, version: int, timeout: float, *, round_id: str) -> None:
        self.log.add("apply", self.name)
        self.applied = version

    def score(self, input_ids: Sequence[int], timeout: float, *, round_id: str) -> list[float | None]:
        self.log.add("score", self.name)
        return list(self.reads)


@dataclass
class StagedGatedEngine(GatedEngine):
    """As vLLM's staged adapter: the gate in staged rounds only."""

    gate_stagings: ClassVar[frozenset[str]] = frozenset({"staged"})


def gated_setup(engine: type[GatedEngine] = GatedEngine) -> tuple[Log, dict[int, GatedEngine], dict[int, object]]:
    plan = make_plan()
    log, _, sources = setup(plan)
    return log, {e: engine(e, log) for e in range(plan.layout.engines)}, dict(sources)


def test_a_gated_round_applies_resumes_scores_then_labels() -> None:
    log, engines, sources = gated_setup()
    driver = RoundDriver(make_plan(), engines, sources)  # type: ignore[arg-type]
    result = driver.run(5, canary=canary())
    assert result.result == "Succeeded" and result.committed and not result.engines_paused
    kinds = [e[0] for e in log.events if e[0] in ("verify", "apply", "resume", "score", "commit")]
    last = {k: max(i for i, x in enumerate(kinds) if x == k) for k in set(kinds)}
    first = {k: min(i for i, x in enumerate(kinds) if x == k) for k in set(kinds)}
    assert last["verify"] < first["apply"] and last["apply"] < first["resume"]
    assert last["resume"] < first["score"] and last["score"] < first["commit"]
    assert len(log.kinds("resume")) == 2  # once per engine: the run does not resume again after the label
    assert all(e.version == 5 for e in engines.values()) and set(result.phases) >= {"gate", "commit", "resume"}
    assert driver.gate_gaps == {0: 0.0, 1: 0.0}
    assert result.gate_gap == 0.0 and result.as_status()["gateGap"] == 0.0  # in the group's status.lastSync


def test_a_failed_gate_pauses_again_never_labels_and_names_the_engine_and_token() -> None:
    log, engines, sources = gated_setup()
    engines[1].reads = [-1.0, -2.5, -0.5]  # token 2 reads another model
    result = RoundDriver(make_plan(), engines, sources, retries=3).run(6, canary=canary())  # type: ignore[arg-type]
    assert result.result == "Failed" and not result.committed and result.engines_paused
    assert result.attempts == 1  # not retried: the same bytes read the same way
    assert "engine 1: token 2 of the canary (id 5): logprob -2.5000, the trainer's -2.0000" in (result.reason or "")
    assert log.kinds("commit") == [] and all(e.version == 0 for e in engines.values())
    assert len(log.kinds("pause")) == 4  # the round's pause, and again after the gate failed
    assert result.gate_gap is None and "gateGap" not in result.as_status()  # no gate passed
    assert [e.aborts for e in engines.values()] == [[True], [True]]  # closed as written: the weights are no version's


def test_a_canary_needs_engines_that_gate_the_rounds_staging() -> None:
    plan = make_plan()
    log, engines, sources = setup(plan)
    result = RoundDriver(plan, engines, sources).run(2, canary=canary())
    assert result.result == "Failed" and not result.started
    assert "engines [0, 1] cannot score a canary" in (result.reason or "") and log.events == []
    log, gated, sources = gated_setup()
    staged = RoundDriver(plan, gated, sources, staging="staged").run(2, canary=canary())  # type: ignore[arg-type]
    assert "engines [0, 1] cannot take the semantic gate (a canary) with targetStaging: staged" in (staged.reason or "")
    assert not staged.started and log.events == []
    log, gated, sources = gated_setup()
    gated[1] = StagedGatedEngine(1, log)  # one of each: the live one refuses a staged round
    mixed = RoundDriver(plan, gated, sources, staging="staged").run(2, canary=canary())  # type: ignore[arg-type]
    assert "engines [0] cannot take the semantic gate" in (mixed.reason or "") and log.events == []


def test_a_staged_gated_round_applies_resumes_scores_then_labels_and_a_miss_leaves_it_paused() -> None:
    log, engines, sources = gated_setup(StagedGatedEngine)
    engines[1].reads = [-1.0, -2.004, -0.5]  # within the tolerance (0.01): passes, and the status says by how much
    result = RoundDriver(make_plan(), engines, sources, staging="staged").run(3, canary=canary())  # type: ignore[arg-type]
    assert result.result == "Succeeded" and result.committed and not result.engines_paused
    assert result.gate_gap is not None and abs(result.gate_gap - 0.004) < 1e-9
    kinds = [e[0] for e in log.events if e[0] in ("verify", "apply", "resume", "score", "commit", "pause")]
    assert "pause" not in kinds  # staged: the engines serve while the sources write
    assert kinds.index("apply") > max(i for i, k in enumerate(kinds) if k == "verify")
    assert max(i for i, k in enumerate(kinds) if k == "score") < kinds.index("commit")
    log, engines, sources = gated_setup(StagedGatedEngine)
    engines[0].reads = [-1.0, -2.0, -0.9]
    missed = RoundDriver(make_plan(), engines, sources, staging="staged").run(4, canary=canary())  # type: ignore[arg-type]
    assert missed.result == "Failed" and not missed.committed and missed.engines_paused
    assert "engine 0: token 3 of the canary" in (missed.reason or "") and log.kinds("commit") == []
    assert len(log.kinds("pause")) == 2  # paused again after the miss: the applied weights are no version's


def trainer_canary(full: dict[str, torch.Tensor]) -> Canary:
    """What a trainer holding ``full`` publishes: its own forward's logprob of each token after the first."""
    logprobs = torch.log_softmax(forward_full(full, TOKENS), dim=-1)[:-1].gather(1, torch.tensor(TOKENS[1:])[:, None])
    return Canary.model_validate({"inputIds": TOKENS, "logprobs": logprobs[:, 0].tolist(), "tolerance": 1e-4})


def test_gated_rounds_through_agents_label_true_syncs_and_stop_a_skipped_layer() -> None:
    """Real agents and reference engines (2 x TP 2): rank 0's canary travels with its publish to the coordinator; a
    version whose layer 1 the trainer staged from the previous step verifies byte for byte and fails at the gate,
    naming the engine; the engines keep the old label and serve nothing until the next true sync lands."""
    spec = group_spec(protocol="tcp", bucketSizeMiB=1, timeoutSeconds=20, targetStaging="live")
    with LoopbackGroup(spec, group="t-gate").start() as group, group.clients() as clients:
        engines = [engine.client() for engine in group.engines.values()]
        one = training_step(full_state(seed=3), 1)
        [first, _] = publish_all(clients, one, 1, canary=trainer_canary(one))
        assert isinstance(first, RoundOutcome) and first.ok, first.summary()
        assert "gate" in first.round.phases and [e.weight_version() for e in engines] == ["1", "1"]

        two = training_step(one, 2)
        skipped = {n: one[n] if n.startswith("model.layers.1.") else t for n, t in two.items()}
        [failed, other] = publish_all(clients, skipped, 2, canary=trainer_canary(two))
        assert isinstance(failed, RoundOutcome) and not failed.ok and failed.round.engines_paused
        assert "the semantic gate failed for version 2: engine 0: token" in (failed.round.reason or "")
        assert isinstance(other, RoundOutcome) and other.round.round_id == failed.round.round_id  # rank 1 heard it
        assert [e.weight_version() for e in engines] == ["1", "1"]
        held = [e.status() for e in engines]  # paused again, and the applied weights are no version's (dirty)
        assert all(h["paused"] and h["live_dirty"] and h["round"] is None for h in held), held

        three = training_step(two, 3)
        [repaired, _] = publish_all(clients, three, 3, canary=trainer_canary(three))
        assert isinstance(repaired, RoundOutcome) and repaired.ok, repaired.summary()
        assert [e.weight_version() for e in engines] == ["3", "3"]
        assert not any(e.status()["paused"] for e in engines)
