"""The replica reshards full tensors exactly as the target holds them, and refuses before writing."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from source_helpers import (
    Full,
    Local,
    TargetMemory,
    as_bytes,
    expected_local,
    part,
    random_full,
    tp_layout,
    whole,
)

from weightsync_agent.layout.buckets import replica_offsets
from weightsync_agent.source.replica import (
    Replica,
    ReplicaBusyError,
    ReplicaError,
    ReplicaLayout,
    ReplicaSet,
)

DTYPES = ["float32", "bfloat16", "float16", "int8", "uint8", "float64", "float8_e4m3fn", "int32"]


def manifest_of(locals_: list[Local], *, engine: int = 0, rank: int = 0) -> TargetMemory:
    return TargetMemory(locals_, engine=engine, rank=rank, session_id=f"s-{engine}-{rank}")


@st.composite
def toy_models(draw: st.DrawFn) -> tuple[list[tuple[str, list[Full]]], int]:
    """A few full tensors of varied kinds and dtypes, all dims divisible by ``tp``; odd byte sizes
    (int8/uint8/fp8 tensors) make later tensors' replica offsets misaligned for their dtype."""
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    kinds = draw(
        st.lists(
            st.sampled_from(
                ["column", "row", "replicated", "fused", "fused_cols", "expert", "padded", "experts_w13", "experts_w2"]
            ),
            min_size=1,
            max_size=6,
        )
    )
    model: list[tuple[str, list[Full]]] = []
    for index, kind in enumerate(kinds):
        dtype = draw(st.sampled_from(DTYPES))

        def dim(scale: int = tp) -> int:
            return scale * draw(st.integers(1, 3))

        if kind == "replicated":
            fulls = [Full(f"f{index}", (draw(st.integers(1, 7)),), dtype)]
        elif kind == "column":
            fulls = [Full(f"f{index}", (dim(), draw(st.integers(1, 5))), dtype)]
        elif kind == "row":
            fulls = [Full(f"f{index}", (draw(st.integers(1, 5)), dim()), dtype)]
        elif kind == "expert":
            fulls = [Full(f"f{index}", (dim(), draw(st.integers(1, 3)), draw(st.integers(1, 3))), dtype)]
        elif kind == "padded":  # every rank holds at least one row; the last one may hold fewer than the others
            per_rank = draw(st.integers(1, 4))
            rows = (tp - 1) * per_rank + draw(st.integers(1, per_rank))
            fulls = [Full(f"f{index}", (rows, draw(st.integers(1, 3))), dtype)]
        elif kind == "experts_w13":  # gate and up of each expert: same shape
            shape = (dim(), draw(st.integers(1, 3)))
            fulls = [Full(f"f{index}.{e}.{w}", shape, dtype) for e in range(draw(st.integers(1, 3))) for w in "gu"]
        elif kind == "experts_w2":
            shape = (draw(st.integers(1, 3)), dim())
            fulls = [Full(f"f{index}.{e}.down", shape, dtype) for e in range(draw(st.integers(1, 3)))]
        elif kind == "fused":  # q, k, v: different row counts, same columns
            cols = draw(st.integers(1, 4))
            fulls = [Full(f"f{index}.{w}", (dim(), cols), dtype) for w in "qkv"]
        else:  # fused_cols: same rows, different column counts
            rows = draw(st.integers(1, 4))
            fulls = [Full(f"f{index}.{w}", (rows, dim()), dtype) for w in "ab"]
        model.append((kind, fulls))
    return model, tp


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(toy_models(), st.integers(0, 2**31 - 1), st.randoms(use_true_random=False))
def test_staging_reshards_like_an_independent_slice_and_cat(
    drawn: tuple[list[tuple[str, list[Full]]], int], seed: int, rnd: object
) -> None:
    model, tp = drawn
    gen = torch.Generator().manual_seed(seed)
    fulls = {f.name: random_full(f, gen) for _, group in model for f in group}
    targets = [manifest_of(tp_layout(model, tp, r), rank=r) for r in range(tp)]
    replicas = ReplicaSet.for_manifests([t.manifest for t in targets], pin=False)
    assert len(replicas) == len({t.manifest.layout_fingerprint for t in targets})
    names = list(fulls)
    rnd.shuffle(names)  # type: ignore[attr-defined]
    for name in names:
        assert replicas.stage(name, fulls[name]) >= 1
    assert replicas.missing() == []
    for target in targets:
        replica = replicas[target.manifest.layout_fingerprint]
        offsets = replica_offsets(target.manifest)
        for entry in target.manifest.tensors:
            want = as_bytes(expected_local(entry, fulls))
            got = replica.buffer.narrow(0, offsets[entry.name], entry.nbytes)
            assert torch.equal(got, want), entry.name
            assert torch.equal(as_bytes(replica.tensor(entry.name)), want)
    replicas.close()


def test_reference_model_cross_check() -> None:
    """Against the reference engine's own resharding (written with chunk/cat, independently)."""
    from weightsync_testing.reference_engine import model as ref

    full = ref.full_state(seed=3)
    for tp in (1, 2):
        for rank in range(tp):
            weights = ref.RankWeights(tp, rank)
            manifest = weights.manifest(engine=0, session_id="x")
            replica = Replica(manifest, pin=False)
            for name, tensor in full.items():
                replica.stage(name, tensor)
            assert replica.missing() == []
            for name, local in ref.shard(full, tp, rank).items():
                assert torch.equal(as_bytes(replica.tensor(name)), as_bytes(local)), name


# --- Refusals ------------------------------------------------------------------------------------

QKV = [Full("q", (4, 3), "bfloat16"), Full("k", (2, 3), "bfloat16"), Full("v", (2, 3), "bfloat16")]
MODEL: list[tuple[str, list[Full]]] = [
    ("fused", QKV),
    ("row", [Full("o", (3, 4), "bfloat16")]),
    ("replicated", [Full("norm", (3,), "float32")]),
]


def fulls_of(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f.name: random_full(f, gen) for _, group in MODEL for f in group}


@pytest.fixture
def two_shapes() -> Iterator[ReplicaSet]:
    targets = [manifest_of(tp_layout(MODEL, 2, r), rank=r) for r in range(2)]
    replicas = ReplicaSet.for_manifests([t.manifest for t in targets], pin=False)
    yield replicas
    replicas.close()


def snapshot(replicas: ReplicaSet) -> list[tuple[torch.Tensor, list[str]]]:
    return [(r.buffer.clone(), [str(m) for m in r.missing()]) for r in replicas]


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (torch.zeros(4, 3, dtype=torch.float32), r"cannot stage 'q' into 't0\.fused': dtype torch\.float32 differs"),
        (torch.zeros(4, 4, dtype=torch.bfloat16), r"cannot stage 'q' into 't0\.fused': shape \[4, 4\] differs"),
        (torch.zeros(12, dtype=torch.bfloat16), r"shape \[12\] differs from the full shape .* \[4, 3\]"),
    ],
)
def test_mismatch_is_refused_before_any_write(two_shapes: ReplicaSet, tensor: torch.Tensor, message: str) -> None:
    for r in two_shapes:
        r.buffer.fill_(0xAB)
    before = snapshot(two_shapes)
    with pytest.raises(ReplicaError, match=message):
        two_shapes.stage("q", tensor)
    after = snapshot(two_shapes)
    for (b_buf, b_missing), (a_buf, a_missing) in zip(before, after, strict=True):
        assert torch.equal(b_buf, a_buf)
        assert b_missing == a_missing


def test_one_refusing_replica_means_no_replica_is_written() -> None:
    """Two layouts want the same full name with different dtypes: the set refuses as a whole."""
    a = manifest_of([Local("w", "float32", (whole("w", (4,)),))], rank=0)
    b = manifest_of([Local("w", "float16", (whole("w", (4,)),))], rank=1)
    replicas = ReplicaSet.for_manifests([a.manifest, b.manifest], pin=False)
    with pytest.raises(ReplicaError, match=r"dtype torch\.float32 differs from the target's torch\.float16"):
        replicas.stage("w", torch.ones(4))
    assert all(int(r.buffer.count_nonzero()) == 0 for r in replicas)
    assert len(replicas.missing()) == 2


def test_unknown_name_strict_and_lenient(two_shapes: ReplicaSet) -> None:
    with pytest.raises(ReplicaError, match="no target tensor of this source is cut from 'nope'"):
        two_shapes.stage("nope", torch.zeros(1))
    assert two_shapes.stage("nope", torch.zeros(1), strict=False) == 0
    with pytest.raises(ReplicaError, match=r"expected a torch\.Tensor"):
        two_shapes.stage("q", [1, 2, 3])  # type: ignore[arg-type]


def test_missing_tracks_parts_and_reset_keeps_bytes(two_shapes: ReplicaSet) -> None:
    fulls = fulls_of()
    assert {m.source for m in two_shapes.missing()} == set(fulls)
    two_shapes.stage("q", fulls["q"])
    missing = two_shapes.missing()
    assert "q" not in {m.source for m in missing}
    assert "t0.fused (from k)" in {str(m) for m in missing}
    assert two_shapes.stage_many(fulls) == 2 * 5
    assert two_shapes.missing() == []
    kept = [r.buffer.clone() for r in two_shapes]
    two_shapes.reset()
    assert len(two_shapes.missing()) == 2 * 5
    assert all(torch.equal(k, r.buffer) for k, r in zip(kept, two_shapes, strict=True))


def test_no_staging_while_publishing(two_shapes: ReplicaSet) -> None:
    fulls = fulls_of()
    with two_shapes.publishing():
        with pytest.raises(ReplicaBusyError, match="being published"):
            two_shapes.stage("q", fulls["q"])
        with pytest.raises(ReplicaBusyError):
            two_shapes.reset()
        with pytest.raises(ReplicaBusyError, match="already being published"), two_shapes.publishing():
            pass
    two_shapes.stage("q", fulls["q"])


def test_layout_from_manifest_matches_bucket_offsets_and_memory_cost() -> None:
    targets = [manifest_of(tp_layout(MODEL, 2, r), rank=r) for r in range(2)]
    layout = ReplicaLayout.of(targets[0].manifest)
    assert {t.name: t.offset for t in layout.tensors} == replica_offsets(targets[0].manifest)
    assert layout.fingerprint == targets[0].manifest.layout_fingerprint
    replicas = ReplicaSet.for_manifests([t.manifest for t in targets] * 3, pin=False)  # 6 targets, 2 shapes
    assert replicas.nbytes == sum(t.manifest.total_bytes for t in targets)
    assert layout.full_shapes()["q"] == ((4, 3), "bfloat16")


# --- Shared memory -------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from weightsync_agent.source.replica import ReplicaSet
    replicas = ReplicaSet.attach(sys.argv[1], pin=False)
    out = {"missing": sorted(str(m) for r in replicas for m in r.missing()),
           "bytes": {r.fingerprint: r.buffer.tolist() for r in replicas}}
    # stage the last tensor from this process; the parent must see it
    replicas.stage("norm", torch.full((3,), 2.5))
    print(json.dumps(out))
    """
)


def test_shm_replica_attached_from_another_process(tmp_path: Path) -> None:
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    folder = shm / f"ws-test-{tmp_path.name}"
    targets = [manifest_of(tp_layout(MODEL, 2, r), rank=r) for r in range(2)]
    replicas = ReplicaSet.for_manifests([t.manifest for t in targets], shm_dir=folder, pin=False)
    try:
        fulls = fulls_of(7)
        for name in ("q", "k", "v", "o"):
            replicas.stage(name, fulls[name])
        before = {r.fingerprint: r.buffer.tolist() for r in replicas}
        child = subprocess.run(
            [sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True, timeout=60, check=False
        )
        assert child.returncode == 0, child.stderr
        seen = json.loads(child.stdout)
        assert seen["missing"] == ["t2.norm (from norm)", "t2.norm (from norm)"]
        for r in replicas:  # the child read what the parent staged ...
            assert seen["bytes"][r.fingerprint] == before[r.fingerprint]
            # ... and the parent sees what the child staged, flags included
            assert torch.equal(r.tensor("t2.norm"), torch.full((3,), 2.5))
        assert replicas.missing() == []
    finally:
        replicas.close(unlink=True)
        folder.rmdir()


def test_shm_publish_lock_excludes_staging_from_another_mapping(tmp_path: Path) -> None:
    """A second mapping (another open file: what another process has) is locked out while publishing."""
    target = manifest_of(tp_layout(MODEL, 1, 0))
    path = tmp_path / "one.replica"
    mine = Replica.create(target.manifest, shm_path=path, pin=False)
    theirs = Replica.attach(path, pin=False)
    fulls = fulls_of()
    with mine.publishing(), pytest.raises(ReplicaBusyError, match="another process has it published"):
        theirs.stage("q", fulls["q"])
    theirs.stage("q", fulls["q"])
    with theirs._staging(), pytest.raises(ReplicaBusyError, match="another process has it staged"):
        mine.publishing().__enter__()
    assert torch.equal(mine.buffer, theirs.buffer)
    theirs.close()
    mine.close(unlink=True)
    assert not path.exists()


def test_attach_refuses_foreign_or_corrupt_files(tmp_path: Path) -> None:
    junk = tmp_path / "junk.replica"
    junk.write_bytes(b"hello")
    with pytest.raises(ReplicaError, match="too short"):
        Replica.attach(junk)
    junk.write_bytes(b"x" * 200)
    with pytest.raises(ReplicaError, match="not a weightsync replica file"):
        Replica.attach(junk)
    path = tmp_path / "ok.replica"
    Replica.create(manifest_of(tp_layout(MODEL, 1, 0)).manifest, shm_path=path, pin=False).close()
    data = bytearray(path.read_bytes())
    data[70] ^= 0xFF  # inside the JSON header
    path.write_bytes(bytes(data))
    with pytest.raises(ReplicaError, match="corrupt"):
        Replica.attach(path)
    with pytest.raises(ReplicaError, match="no replica files"):
        ReplicaSet.attach(tmp_path / "empty")
    assert struct.calcsize("<8sQQQQQQ8x") == 64


def test_misaligned_tensor_round_trips() -> None:
    """A 3-byte int8 tensor first puts the float32 tensor at replica offset 3: staged through a copy."""
    locals_ = [
        Local("odd", "int8", (whole("odd", (3,)),)),
        Local("w", "float32", (part("w", (4, 2), 0, 2, 2),)),
    ]
    replica = Replica(manifest_of(locals_).manifest, pin=False)
    w = torch.arange(8, dtype=torch.float32).view(4, 2)
    replica.stage("w", w)
    replica.stage("odd", torch.tensor([1, -2, 3], dtype=torch.int8))
    assert torch.equal(replica.tensor("w"), w[2:])
    assert replica.raw("w").data_ptr() % 4 != 0 or replica.address % 4 != 0
    assert torch.equal(replica.tensor("odd"), torch.tensor([1, -2, 3], dtype=torch.int8))


FP8_CONFIG = {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "head_dim": 128, "intermediate_size": 512,
              "dtype": "bfloat16", "quantization": "fp8-block"}  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2])
def test_an_fp8_block_target_is_staged_from_bf16_trainer_tensors_as_its_checkpoint_holds(tp: int) -> None:
    """A traced FP8 block target (the reference engine's, fused qkv and gate_up cut over TP on tile edges): the sources
    quantize each BF16 trainer tensor whole and cut weight and scale tiles as the engine does; the trainer stages only
    its own tensors (the scales come with their weights)."""
    from weightsync_testing.reference_engine import model as ref

    config = ref.ModelConfig(**FP8_CONFIG)  # type: ignore[arg-type]
    full = ref.full_state(seed=5, config=config)
    manifests = [ref.RankWeights(tp, rank, config).manifest(engine=0, session_id=f"s{rank}") for rank in range(tp)]
    assert any(t.quantize == "fp8-block" for t in manifests[0].tensors)
    replicas = ReplicaSet.for_manifests(manifests, pin=False)
    assert set().union(*(r.full_names() for r in replicas.every())) == set(full)
    for name, tensor in full.items():
        assert replicas.stage(name, tensor) >= 1
    assert replicas.missing() == []
    for rank, manifest in enumerate(manifests):
        replica = replicas[manifest.layout_fingerprint]
        want = ref.local_state(full, tp, rank, config)
        assert set(want) == {t.name for t in manifest.tensors}
        for name, local in want.items():
            assert torch.equal(as_bytes(replica.tensor(name)), as_bytes(local)), name
    replicas.close()
