"""The agent's identity, from the environment the operator gives its sidecar."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from weightsync.api import names


class AgentConfigError(ValueError):
    pass


class AgentConfig(BaseModel):
    model_config = ConfigDict(frozen=True)

    group: str = Field(min_length=1)
    namespace: str = "default"
    role: Literal["trainer", "engine"]
    pod_index: int = Field(ge=0)
    engine_index: int | None = Field(default=None, ge=0)
    ranks: tuple[int, ...] = Field(min_length=1)
    plan_config_map: str | None = None
    plan_file: str | None = None
    agent_port: int = Field(default=9470, ge=1, le=65535)
    pod_name: str | None = None
    pod_ip: str | None = None
    engine_url: str | None = None
    agent_url: str | None = None
    directory_file: str | None = None
    #: The group's credential (``WEIGHTSYNC_GROUP_TOKEN``, from the group's Secret): required on every
    #: route but the probes, sent on every call to another agent or an engine (docs/security.md).
    group_token: str | None = Field(default=None, repr=False)
    #: The group's Secret mounted as files (``token``, ``previous``), re-read when they change; takes precedence
    #: over ``group_token``, which stays for local runs (docs/security.md, "Rotating the token").
    credentials_dir: str | None = None
    #: Peers' advertised URLs may name loopback (the local cluster's agents are local processes); else only the
    #: advertising pod's own IPs are believed (``directory.PodDirectory``).
    loopback_peers: bool = False

    @field_validator("ranks", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            try:
                return tuple(int(part) for part in value.split(",") if part.strip())
            except ValueError as exc:
                raise ValueError(f"{names.ENV_RANKS} must be comma-separated integers, got {value!r}") from exc
        return value

    @property
    def host(self) -> str:
        """Where this agent listens and its transport binds: the pod's IP, else loopback."""
        return self.pod_ip or "127.0.0.1"

    def advertised_agent_url(self) -> str:
        return self.agent_url or f"http://{self.host}:{self.agent_port}"

    def advertised_engine_url(self, port: int) -> str:
        """``WEIGHTSYNC_ENGINE_URL`` (local runs), else this pod's IP and the plan's ``inference.port``."""
        return self.engine_url or f"http://{self.host}:{port}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AgentConfig:
        env = os.environ if env is None else env
        raw = {
            "group": env.get(names.ENV_GROUP, ""),
            "namespace": env.get(names.ENV_NAMESPACE, "default"),
            "role": env.get(names.ENV_ROLE, ""),
            "pod_index": env.get(names.ENV_POD_INDEX, ""),
            "engine_index": env.get(names.ENV_ENGINE_INDEX) or None,
            "ranks": env.get(names.ENV_RANKS, ""),
            "plan_config_map": env.get(names.ENV_PLAN_CONFIG_MAP) or None,
            "plan_file": env.get(names.ENV_PLAN_FILE) or None,
            "agent_port": env.get(names.ENV_AGENT_PORT, "9470"),
            "pod_name": env.get(names.ENV_POD_NAME) or None,
            "pod_ip": env.get(names.ENV_POD_IP) or None,
            "engine_url": env.get(names.ENV_ENGINE_URL) or None,
            "agent_url": env.get(names.ENV_AGENT_URL) or None,
            "directory_file": env.get(names.ENV_DIRECTORY_FILE) or None,
            "group_token": env.get(names.ENV_GROUP_TOKEN) or None,
            "credentials_dir": env.get(names.ENV_CREDENTIALS_DIR) or None,
            "loopback_peers": env.get(names.ENV_LOOPBACK_PEERS) == "1",
        }
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise AgentConfigError(f"agent environment is incomplete or invalid: {problems}") from exc


def trainer_token_file(replica_folder: str | os.PathLike[str]) -> Path:
    """Where a trainer pod's agent leaves the pod-local token trainer code publishes with (docs/security.md)."""
    return Path(replica_folder) / names.TRAINER_TOKEN_FILE


def replica_dir(group: str, source_rank: int, root: str | os.PathLike[str] = names.SHM_PATH) -> Path:
    """Where a trainer rank's replica files live, agreed between the sidecar and the trainer."""
    return Path(root) / "weightsync" / group / f"source-{source_rank}"
