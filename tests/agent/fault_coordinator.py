"""A coordinator (round driver + both sources) in its own process, frozen mid-round so a test can SIGKILL it.

    python fault_coordinator.py --engines URL0,URL1 --version V --staging live|staged --hold-after K

Runs round ``V`` against the engines. On the ``K``-th write to engine 1 it prints
``{"event": "holding", ...}`` and blocks that source for good: the engines have begun the round, engine 0
and part of engine 1 have received bytes, nothing is verified or committed. The test then kills it.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading

from fault_rig import TriggeredTransport, build_sources, group_plan, make_driver, version_state

from weightsync_agent.targets.engine_client import EngineClient
from weightsync_agent.transport.mooncake import MooncakeTransport


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", required=True)
    parser.add_argument("--version", type=int, required=True)
    parser.add_argument("--staging", choices=("live", "staged"), required=True)
    parser.add_argument("--hold-after", type=int, default=3)
    args = parser.parse_args()
    plan = group_plan(args.staging)
    clients = [EngineClient(url, timeout=10) for url in args.engines.split(",")]
    watched = {session for session in clients[1].status()["sessions"]}
    counter: dict[str, int] = {}
    never = threading.Event()

    def hold() -> None:
        print(json.dumps({"event": "holding", "writes": counter["writes"]}), flush=True)
        never.wait()  # until SIGKILL

    def wrap(transport: MooncakeTransport) -> TriggeredTransport:
        return TriggeredTransport(transport, watched, counter, args.hold_after, hold)

    sources = build_sources(plan, clients, wrap)
    for source in sources:
        source.replicas.stage_many(version_state(args.version))
    driver = make_driver(plan, clients, sources, timeout=60, call_timeout=10, retries=0)
    result = driver.run(args.version)
    print(json.dumps({"event": "finished", "result": result.result, "reason": result.reason}), flush=True)
    return 1  # it was meant to be killed before finishing


if __name__ == "__main__":
    sys.exit(main())
