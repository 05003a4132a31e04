"""Replica -> GPU weights through MooncakeTransport, bit-exact: runs only with CUDA and Mooncake's CUDA build.

Drives ``bench/gpu_bench.py --dry-run`` (a tiny TP2 model, every party its own process): two sources
stage their pinned CPU replicas and write them into two engine ranks' GPU buffers with ``Source.publish``
and with raw bucketed writes, over Mooncake's TCP transport and over its intra-node NVLink transport,
plus GPU -> GPU writes where there is a GPU to write from; each engine compares its buffer with an
independently built copy after every write.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parents[3] / "bench" / "gpu_bench.py"


def _mooncake_has_cuda() -> bool:
    try:
        import mooncake.engine as engine
    except ImportError:
        return False
    return bool(getattr(engine, "SUPPORT_CUDA", False))


pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not _mooncake_has_cuda(), reason="needs CUDA and Mooncake's CUDA build"
)


@pytest.mark.parametrize("mode", ["tcp", "nvlink"])
def test_replica_to_gpu_is_bit_exact(mode: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--dry-run", "--reps", "1", "--modes", mode, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["errors"] == [], doc["errors"]
    writes = [row for row in doc["rows"] if row["name"].startswith("Mooncake")]
    names = {row["name"] for row in writes}
    assert {"Mooncake raw: replica -> GPU", "Mooncake Source.publish: replica -> GPU"} <= names
    for row in writes:
        assert row["verified"] is True, row
        assert len(row["seconds"]) == 1, row
