"""Trainer rank 0 in broadcast mode, as a process on trainer node 0 (the testbed starts it there).

    python -m weightsync_tools.testbed.broadcast_worker CONFIG.json

``CONFIG`` names the plan file (``transfer.mode: broadcast``), the engines' URLs, the model shape and seed
of the full tensors, and where this side hosts the group's store. The worker builds the project's
:class:`~weightsync_agent.modes.broadcast.sender.BroadcastSource`, stages the full tensors once, forms the gloo
group (``connect``) and prints ``{"event": "ready"}``. Then every stdin line ``{"version": v}`` runs one
round through the same :class:`~weightsync_agent.rounds.driver.RoundDriver` the coordinator uses, over
``broadcast_round_plan(plan)``, and prints the ``RoundResult`` as one JSON line; an empty line or EOF ends it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from weightsync.plan import Plan
from weightsync_agent.modes.broadcast.layout import broadcast_round_plan
from weightsync_agent.modes.broadcast.sender import BroadcastSource
from weightsync_agent.rounds.driver import RoundDriver
from weightsync_agent.source.control import SourceControl
from weightsync_agent.targets.engine_client import EngineClient
from weightsync_agent.targets.reference.adapter import reference_adapter
from weightsync_testing.reference_engine.model import ModelConfig, full_state


def _emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    config = json.loads(Path(args[0]).read_text())
    torch.set_num_threads(1)
    plan = Plan.from_json(Path(config["plan_file"]).read_text())
    timeout = float(plan.transfer.timeout_seconds)
    token = config.get("token")
    clients = {int(e): EngineClient(url, timeout=timeout, api_key=token) for e, url in config["engines"].items()}
    manifests = {t: clients[t[0]].manifest(t[1]) for t in plan.layout.all_targets()}
    full = full_state(int(config["seed"]), ModelConfig(**config["model"]))
    bucket_bytes = plan.transfer.bucket_bytes
    controls = {e: reference_adapter(e, c.base_url, bucket_bytes=bucket_bytes, token=token) for e, c in clients.items()}
    source = BroadcastSource(plan, manifests, controls, receivers=config.get("receivers", "engine"), call_timeout=60)
    driver: RoundDriver | None = None
    try:
        source.stage_many(full)
        source.connect(f"tcp://{config['host']}:{config['port']}", backend="gloo")
        sources: dict[int, SourceControl] = {0: source}
        driver = RoundDriver(
            broadcast_round_plan(plan),
            controls,
            sources,
            staging=plan.transfer.target_staging,
            verify=plan.transfer.verify,
            timeout_seconds=timeout,
            call_timeout=timeout,
        )
        _emit({"event": "ready", "receivers": source.layout.receivers})
        for line in sys.stdin:
            if not line.strip():
                break
            version = int(json.loads(line)["version"])
            result = driver.run(version)
            _emit({"event": "round", **result.as_status(), "attempts": result.attempts})
    finally:
        if driver is not None:
            driver.close()
        source.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
