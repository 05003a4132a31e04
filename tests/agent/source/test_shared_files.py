"""What a trainer pod's agent leaves in /dev/shm for trainer code is group-shared, never world-readable (issue 26).

Before: the replica files and the pod-local token were 0600, so a trainer container running as another non-root user
(Pod Security ``restricted``) could neither stage nor publish. Now replica files are 0660 (the trainer stages into
them), the token 0640 (the trainer only reads it), folders 0750, whatever the umask; under a setgid folder (the
kubelet's ``fsGroup`` on the memory volume) every file and folder takes that folder's group. The operator's side
(the agent's group among a trainer pod's ``supplementalGroups``): ``tests/operator/test_builders.py``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from source_helpers import Full, Local, TargetMemory, tp_layout

from weightsync_agent.config import trainer_token_file
from weightsync_agent.shared_files import write_shared
from weightsync_agent.source.replica import ReplicaSet

MODEL: list[tuple[str, list[Full]]] = [("row", [Full("o", (4, 4), "float32")])]


@pytest.fixture(params=[0o077, 0o000], ids=["umask-077", "umask-000"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    """The strictest umask (the modes must not depend on it) and none (nothing may become world-readable)."""
    before = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(before)


def memory(locals_: list[Local]) -> TargetMemory:
    return TargetMemory(locals_, engine=0, rank=0, session_id="s-0-0")


def test_replicas_and_the_token_are_shared_with_the_group_only(tmp_path: Path, umask: int) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    os.chmod(shm, 0o2777)  # an emptyDir under an fsGroup: setgid, the group inherited below it
    folder = shm / "weightsync" / "g" / "source-0"
    replicas = ReplicaSet.for_manifests([memory(tp_layout(MODEL, 1, 0)).manifest], shm_dir=folder, pin=False)
    try:
        write_shared(trainer_token_file(folder), "a-pod-local-token")
        files = [*folder.glob("*.replica"), trainer_token_file(folder)]
        assert len(files) == 2
        modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in files}
        assert modes == {files[0].name: 0o660, files[1].name: 0o640}, {k: oct(v) for k, v in modes.items()}
        for made in (shm / "weightsync", shm / "weightsync" / "g", folder):
            mode = made.stat().st_mode
            assert stat.S_IMODE(mode) & 0o777 == 0o750 and mode & stat.S_ISGID, (made, oct(mode))
        for path in [*files, folder]:
            assert path.stat().st_gid == shm.stat().st_gid
            assert not stat.S_IMODE(path.stat().st_mode) & 0o007, f"{path} is open to others"
        assert not list(folder.glob(".*.tmp"))  # the token was renamed in whole
    finally:
        replicas.close(unlink=True)
