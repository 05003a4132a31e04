"""The operator's own settings, read once from its environment (the Helm chart sets them)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from weightsync.api import names
from weightsync_operator.builders import BuildOptions

DEFAULT_RESYNC_SECONDS = 30.0
DEFAULT_CREATE_CONCURRENCY = 32
DEFAULT_STATUS_INTERVAL = 1.0
DEFAULT_POD_RELIST_SECONDS = 600.0

#: Pod creates in flight at once per group reconcile.
ENV_CREATE_CONCURRENCY = "WEIGHTSYNC_CREATE_CONCURRENCY"
#: Least seconds between two reconciles of one group that pod events or the resync ask for (so also between two
#: status writes while pods progress); a change of the group itself is reconciled at once.
ENV_STATUS_INTERVAL = "WEIGHTSYNC_STATUS_INTERVAL_SECONDS"
#: A group's pods are LISTed again (the index re-seeded) after this many seconds: a safety net for watch gaps.
ENV_POD_RELIST_SECONDS = "WEIGHTSYNC_POD_RELIST_SECONDS"


@dataclass(frozen=True)
class OperatorConfig:
    #: Default agent image for groups without ``spec.agent.image``.
    agent_image: str | None = None
    #: Every group is reconciled at least this often, whatever events say.
    resync_seconds: float = DEFAULT_RESYNC_SECONDS
    create_concurrency: int = DEFAULT_CREATE_CONCURRENCY
    status_interval: float = DEFAULT_STATUS_INTERVAL
    pod_relist_seconds: float = DEFAULT_POD_RELIST_SECONDS

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if env is None else env
        return cls(
            agent_image=env.get(names.OPERATOR_ENV_AGENT_IMAGE, "").strip() or None,
            resync_seconds=_number(env, names.OPERATOR_ENV_RESYNC_SECONDS, DEFAULT_RESYNC_SECONDS, "seconds"),
            create_concurrency=int(_number(env, ENV_CREATE_CONCURRENCY, DEFAULT_CREATE_CONCURRENCY, "creates", True)),
            status_interval=_number(env, ENV_STATUS_INTERVAL, DEFAULT_STATUS_INTERVAL, "seconds"),
            pod_relist_seconds=_number(env, ENV_POD_RELIST_SECONDS, DEFAULT_POD_RELIST_SECONDS, "seconds"),
        )

    @property
    def build_options(self) -> BuildOptions:
        return BuildOptions(agent_image=self.agent_image)


def _number(env: Mapping[str, str], key: str, default: float, unit: str, integer: bool = False) -> float:
    raw = env.get(key, "").strip()
    what = f"a whole number of {unit}" if integer else f"a number of {unit}"
    try:
        value = (int(raw) if integer else float(raw)) if raw else default
    except ValueError as exc:
        raise ValueError(f"{key} must be {what}, not {raw!r}") from exc
    if value <= 0:
        raise ValueError(f"{key} must be positive, not {raw!r}")
    return value
