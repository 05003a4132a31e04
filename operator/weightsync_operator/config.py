"""The operator's own settings, read once from its environment (the Helm chart sets them)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from weightsync.api import names
from weightsync_operator.builders import BuildOptions

DEFAULT_RESYNC_SECONDS = 30.0


@dataclass(frozen=True)
class OperatorConfig:
    #: Default agent image for groups without ``spec.agent.image``.
    agent_image: str | None = None
    #: Every group is reconciled at least this often, whatever events say.
    resync_seconds: float = DEFAULT_RESYNC_SECONDS

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if env is None else env
        raw = env.get(names.OPERATOR_ENV_RESYNC_SECONDS, "").strip()
        try:
            resync = float(raw) if raw else DEFAULT_RESYNC_SECONDS
        except ValueError as exc:
            raise ValueError(f"{names.OPERATOR_ENV_RESYNC_SECONDS} must be a number of seconds, not {raw!r}") from exc
        if resync <= 0:
            raise ValueError(f"{names.OPERATOR_ENV_RESYNC_SECONDS} must be positive, not {raw!r}")
        return cls(agent_image=env.get(names.OPERATOR_ENV_AGENT_IMAGE, "").strip() or None, resync_seconds=resync)

    @property
    def build_options(self) -> BuildOptions:
        return BuildOptions(agent_image=self.agent_image)
