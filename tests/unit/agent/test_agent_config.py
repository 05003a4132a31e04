"""The agent refuses a bad environment or a plan that doesn't know it, before doing anything."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from weightsync.api import names
from weightsync.api.load import parse_group
from weightsync.plan import Plan, PlanError, plan_for
from weightsync_agent.config import AgentConfig, AgentConfigError
from weightsync_agent.plan_loader import load_plan
from weightsync_agent.sidecar.duties import SourceDuty, TargetDuty, duties

GROUP = parse_group(yaml.safe_load(Path("examples/tcp-group.yaml").read_text()))
PLAN = plan_for(GROUP.spec, group="demo", namespace="default")


def env(**overrides: str) -> dict[str, str]:
    base = {
        names.ENV_GROUP: "demo",
        names.ENV_ROLE: "engine",
        names.ENV_POD_INDEX: "0",
        names.ENV_ENGINE_INDEX: "1",
        names.ENV_RANKS: "0,1",
        names.ENV_PLAN_CONFIG_MAP: "demo-plan",
    }
    base.update(overrides)
    return base


def test_engine_agent_knows_its_sources() -> None:
    config = AgentConfig.from_env(env())
    work = duties(config, PLAN)
    assert work == [TargetDuty((1, 0), PLAN.source_of[(1, 0)]), TargetDuty((1, 1), PLAN.source_of[(1, 1)])]


def test_trainer_agent_knows_its_targets() -> None:
    config = AgentConfig.from_env(env(**{names.ENV_ROLE: "trainer", names.ENV_RANKS: "1"}))
    (duty,) = duties(config, PLAN)
    assert isinstance(duty, SourceDuty)
    assert duty.targets == PLAN.sources[1].targets and duty.shapes == PLAN.sources[1].shapes


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({names.ENV_ROLE: "critic"}, "role"),
        ({names.ENV_RANKS: "zero"}, "comma-separated integers"),
        ({names.ENV_RANKS: ""}, "ranks"),
        ({names.ENV_GROUP: ""}, "group"),
        ({names.ENV_POD_INDEX: "-1"}, "pod_index"),
    ],
)
def test_bad_environment_is_a_clear_error(overrides: dict[str, str], message: str) -> None:
    with pytest.raises(AgentConfigError, match=message):
        AgentConfig.from_env(env(**overrides))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({names.ENV_ENGINE_INDEX: "7"}, "plan has 2 engines"),
        ({names.ENV_RANKS: "0,5"}, "2 ranks per engine"),
        ({names.ENV_ROLE: "trainer", names.ENV_RANKS: "9"}, "plan has 2 trainer ranks"),
    ],
)
def test_plan_naming_unknown_ranks_is_refused(overrides: dict[str, str], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        duties(AgentConfig.from_env(env(**overrides)), PLAN)


def test_plan_file_round_trip_and_tampering(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "plan.json"
    path.write_text(PLAN.to_json())
    config = AgentConfig.from_env(env())
    assert load_plan(config, path, None) == PLAN
    path.write_text(PLAN.to_json().replace('"bucketSizeMiB":64', '"bucketSizeMiB":65'))
    with pytest.raises(PlanError, match="hash does not match"):
        load_plan(config, path, None)
    path.write_text(PLAN.to_json()[:-20])
    with pytest.raises(PlanError, match="not valid JSON"):
        load_plan(config, path, None)
    assert isinstance(Plan.from_json(PLAN.to_json()), Plan)


def test_only_an_explicit_setting_lets_peers_advertise_loopback() -> None:
    assert not AgentConfig.from_env(env()).loopback_peers  # as the operator builds every agent
    assert not AgentConfig.from_env(env(**{names.ENV_LOOPBACK_PEERS: "true"})).loopback_peers
    assert AgentConfig.from_env(env(**{names.ENV_LOOPBACK_PEERS: "1"})).loopback_peers  # the local cluster
