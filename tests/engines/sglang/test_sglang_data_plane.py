"""Stock SGLang's own Mooncake engine listens inside the group's range when its environment says so.

SGLang creates its Mooncake engine in the scheduler process (``TransferEngine.initialize(ip, "P2PHANDSHAKE", ...)``,
docs/engines/sglang.md); Mooncake reads ``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT`` there, which the operator sets in the
engine container from ``transfer.mooncakePorts``. Checked from /proc over every process of the server's process
group: the session's RPC port and the TCP data port are inside the range, and nothing listens in Mooncake's
default 15000-17000, where an unpinned engine would be. The writes of a round through this range are covered by
test_sglang_rounds.py, whose harness gives every server the spec's range the same way.
"""

from __future__ import annotations

from pathlib import Path

from sglang_helpers import ADMIN_KEY

from weightsync.api import names
from weightsync_agent.targets.engine_client import EngineClient
from weightsync_testing.listening import free_block, listening_ports
from weightsync_testing.server_process import retire
from weightsync_testing.sglang_server import launch_sglang


def process_group(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid:  # after "pid (comm)": state, ppid, pgrp
            pids.append(int(entry.name))
    return pids


def test_stock_sglangs_mooncake_listens_inside_the_range_from_its_environment(
    sglang_py: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    low, high = free_block(32)
    server = launch_sglang(
        tiny_llama,
        tp=1,
        python=sglang_py,
        dtype="float32",
        admin_api_key=ADMIN_KEY,
        log_dir=tmp_path,
        extra_env={names.ENV_MOONCAKE_MIN_PORT: str(low), names.ENV_MOONCAKE_MAX_PORT: str(high)},
    )
    try:
        info = EngineClient(server.url, timeout=30, api_key=ADMIN_KEY).transfer_engine_info(0)
        rpc_port = int(info.session_id.rsplit(":", 1)[1])
        assert low <= rpc_port <= high, f"SGLang's Mooncake session {info.session_id} is outside {low}-{high}"
        ports: set[int] = set()
        for pid in process_group(server.pid):
            ports |= listening_ports(pid)
        inside = sorted(p for p in ports if low <= p <= high)
        assert rpc_port in inside and len(inside) == 2, f"want the RPC and the TCP data port in range, got {inside}"
        assert not [p for p in ports if 15000 <= p <= 17000], f"a Mooncake port left the range: {sorted(ports)}"
    finally:
        retire(server.stop)
