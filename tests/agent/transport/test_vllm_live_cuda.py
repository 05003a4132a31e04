"""weightsync's vLLM plugin on live CUDA parameters: one-sided Mooncake writes land in them, only inside a round.

GPU only (skipped elsewhere, with the reason): vLLM's CPU build repacks its linear weights, so the plugin's
``parameters`` placement runs end to end on CPU only with a test-only plugin (tests/engines/vllm/
test_vllm_live_rounds.py); this runs it where production does, on CUDA, with Mooncake's CUDA build. The peer
(``vllm_live_member.py``) is the plugin's engine made by vLLM's own factory on bf16 CUDA parameters; this process is
a source: it reads the published ``{name: [ptr, numel, size]}`` and writes each parameter's new bytes from a
pinned CPU buffer with Mooncake's own call, whose return code says whether the plugin's process took them. Checked:
outside a round every write is refused and the parameters keep their bytes; between ``start`` and ``finish`` every
write lands; vLLM's own digest of every parameter (the ``/weight_checker`` code) then equals sha256 of the bytes
sent, and so does the plugin's worker extension's (``parallel_digests``); after ``finish`` writes are refused again.

On the device machine (docs/engines/vllm.md, "What ran where"): vLLM's Python and Mooncake's CUDA build carried
(``hack/device/vllm-nccl-carry.sh``), ``PYTHONPATH=/tmp/site:$PWD:$PWD/agent``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

MEMBER = Path(__file__).with_name("vllm_live_member.py")

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (the device machine)"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM's Python (carried there)"),
    pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="needs Mooncake's CUDA build"),
]


class Member:
    def __init__(self, directory: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(MEMBER), "--device", "0", "--directory", str(directory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert "ready" in self.read(), "the plugin's engine did not start"

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        while line := self.process.stdout.readline():
            if line.startswith("{"):
                answer: dict[str, Any] = json.loads(line)
                return answer
        raise AssertionError(f"the member exited ({self.process.wait(10)})")

    def ask(self, command: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.write("quit\n")
            self.process.stdin.close()
            self.process.wait(30)


def test_the_plugin_takes_writes_into_live_cuda_parameters_only_inside_a_round(tmp_path: Path) -> None:
    from mooncake.engine import TransferEngine

    member = Member(tmp_path)
    try:
        layout = json.loads((tmp_path / "dp0-pp0-tp0.json").read_text())
        assert layout["placement"] == "parameters" and layout["device"] == "cuda", layout
        info: dict[str, list[int]] = layout["weights_info"]
        generator = torch.Generator().manual_seed(1)
        new = {name: torch.randn(numel, generator=generator).to(torch.bfloat16) for name, (_, numel, _) in info.items()}
        assert all(size == 2 for _, _, size in info.values())
        flat = torch.cat([t.view(torch.uint8) for t in new.values()]).pin_memory()
        offsets, at = {}, 0
        for name, tensor in new.items():
            offsets[name], at = at, at + tensor.numel() * 2
        source = TransferEngine()
        assert source.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert source.register_memory(flat.data_ptr(), flat.numel()) == 0
        session = str(layout["session_id"])

        def write_all() -> list[int]:
            codes = []
            for name, (address, numel, size) in info.items():
                local = flat.data_ptr() + offsets[name]
                codes.append(int(source.transfer_sync_write(session, local, address, numel * size)))
            return codes

        before = member.ask("sums")["sums"]
        assert all(rc < 0 for rc in write_all())  # outside a round: refused, nothing changes
        assert member.ask("sums")["sums"] == before

        member.ask("start")
        began = time.perf_counter()
        assert write_all() == [0] * len(info)
        took = time.perf_counter() - began
        member.ask("finish")
        sums = member.ask("sums")["sums"]
        expected = {name: hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest() for name, t in new.items()}
        assert sums == expected
        assert member.ask("fastsums")["sums"] == expected  # the plugin's worker extension: the same digests
        print(f"\n{flat.numel()} B into {len(info)} live CUDA parameters in {took * 1e3:.1f} ms (sync writes)")

        assert all(rc < 0 for rc in write_all())  # closed again after finish
        assert member.ask("sums")["sums"] == expected
    finally:
        member.close()
