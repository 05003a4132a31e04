"""The shared assembly of a stock engine's manifest refuses malformed published entries with a ManifestError naming
the parameter (weightsync_agent/layout/traced_manifest.py): SGLang's and the vLLM plugin's ``{name: [address, numel,
element_size]}`` come over the network and from files, and readiness must say what is wrong, not crash."""

from __future__ import annotations

from typing import Any

import pytest

from weightsync_agent.layout.manifest import ManifestError
from weightsync_agent.layout.traced_manifest import assemble

PART = {"source": "model.norm.weight", "full_shape": [8], "dim": 0, "start": 0, "length": 8}
TRACE = {"tensors": [{"name": "model.norm.weight", "dtype": "float32", "shape": [8], "parts": [PART]}]}


def test_a_well_formed_entry_assembles() -> None:
    manifest = assemble(0, 0, TRACE, "127.0.0.1:1", {"model.norm.weight": [4096, 8, 4]}, checksum="tensor-sha256")
    assert [(t.name, t.address, t.nbytes) for t in manifest.tensors] == [("model.norm.weight", 4096, 32)]


@pytest.mark.parametrize(
    "entry",
    [[4096, 8], [4096, 8, 4, 0], ["4096", 8, 4], [4096, -8, 4], [True, 8, 4], [4096.0, 8, 4], "4096,8,4", None, 4096],
)
def test_a_malformed_entry_is_refused_naming_the_parameter(entry: Any) -> None:
    with pytest.raises(
        ManifestError, match=r"model\.norm\.weight's published entry .* is not \[address, numel, size\]"
    ):
        assemble(0, 0, TRACE, "127.0.0.1:1", {"model.norm.weight": entry}, checksum="tensor-sha256")
