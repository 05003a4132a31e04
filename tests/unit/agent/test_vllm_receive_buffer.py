"""The vLLM plugin's receive buffer (engine/weightsync_engine/vllm/receive_buffer.py), outside vLLM: the layout packs
every tensor aligned and without overlap, the region is a shared file mapping whose bytes another process reads, the
published layout is what the engine pod's agent needs, and a checkpoint's headers give the tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from weightsync_engine.vllm.receive_buffer import (
    ALIGN,
    BufferError,
    ReceiveBuffer,
    buffer_dtypes,
    checkpoint_tensors,
    layout,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8]


@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 9), max_size=3)), max_size=12))
def test_the_layout_packs_every_tensor_aligned_in_order_without_overlap(
    specs: list[tuple[torch.dtype, list[int]]],
) -> None:
    tensors = [(f"t{i}", dtype, tuple(shape)) for i, (dtype, shape) in enumerate(specs)]
    slots, total = layout(tensors)
    assert [s.name for s in slots] == [t[0] for t in tensors]
    end = 0
    for slot, (_, dtype, shape) in zip(slots, tensors, strict=True):
        assert slot.offset % ALIGN == 0 and slot.offset >= end
        assert slot.nbytes == torch.empty(shape, dtype=dtype).nbytes
        end = slot.offset + slot.nbytes
    assert total >= max(end, 1) and total % ALIGN == 0


def test_the_region_is_a_shared_file_and_its_layout_is_published(tmp_path: Path) -> None:
    buffer = ReceiveBuffer(tmp_path, "dp0-pp0-tp0", [("a", torch.float32, (2, 3)), ("b", torch.bfloat16, (5,))])
    try:
        buffer.tensor("a").copy_(torch.arange(6, dtype=torch.float32).view(2, 3))
        buffer.publish(session_id="127.0.0.1:1234")
        described = json.loads((tmp_path / "dp0-pp0-tp0.json").read_text())
        assert described["session_id"] == "127.0.0.1:1234" and described["address"] == buffer.address
        assert [t["name"] for t in described["tensors"]] == ["a", "b"]
        # What a writer puts at the address is what the file holds: another process reads it there.
        on_disk = Path(described["path"]).read_bytes()
        assert len(on_disk) == described["nbytes"]
        assert torch.frombuffer(bytearray(on_disk[:24]), dtype=torch.float32).tolist() == [0, 1, 2, 3, 4, 5]
    finally:
        buffer.close()
    assert not (tmp_path / "dp0-pp0-tp0.json").exists() and not (tmp_path / "dp0-pp0-tp0.buf").exists()


def test_a_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BufferError, match="does not exist"):
        ReceiveBuffer(tmp_path / "nowhere", "x", [("a", torch.float32, (1,))])


def test_the_checkpoint_headers_give_names_dtypes_and_shapes(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(2, 4), "n": torch.zeros(3, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    assert sorted(checkpoint_tensors(tmp_path)) == [("n", "BF16", (3,)), ("w", "F32", (2, 4))]
    with pytest.raises(BufferError, match=r"no \*\.safetensors"):
        checkpoint_tensors(tmp_path / "..")


def test_plain_floats_take_the_models_dtype_and_quantized_weights_keep_theirs(tmp_path: Path) -> None:
    """A W8A8 FP8 checkpoint's e4m3 weights were laid out in the model's float32 (every float dtype was), so the
    sources' FP8 bytes had no float8 slot to go to: they keep the checkpoint's dtype, as INT8 weights always did."""
    save_file(
        {
            "w": torch.zeros(4, 2).to(torch.float8_e4m3fn),
            "w_scale": torch.ones(4, 1, dtype=torch.bfloat16),
            "q": torch.zeros(4, 2, dtype=torch.int8),
            "n": torch.ones(2, dtype=torch.float16),
        },
        str(tmp_path / "model.safetensors"),
    )
    found = {name: dtype for name, dtype, _ in buffer_dtypes(checkpoint_tensors(tmp_path), torch.float32)}
    assert found == {"w": torch.float8_e4m3fn, "w_scale": torch.float32, "q": torch.int8, "n": torch.float32}
    with pytest.raises(BufferError, match="x: the checkpoint holds it as F8_E5M2"):
        buffer_dtypes([("x", "F8_E5M2", (2,))], torch.float32)
