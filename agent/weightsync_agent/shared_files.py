"""What a trainer pod's agent shares with trainer code in the pod's ``/dev/shm``: group-shared, never world-readable.

The trainer container may run as another user than the agent (any non-root uid, as Pod Security ``restricted``
asks), so files only their owner could open (0600) locked trainer code out of its replica and its pod-local token.
They are shared with a group instead: the pod's ``fsGroup`` where the template sets one (the kubelet makes the memory
volume setgid to it, so what the agent creates inherits it, and every container of the pod is in it), else the
agent's own group, which the operator adds to every container's supplemental groups (``builders/pods.py``). Modes are
set explicitly, whatever the umask; a folder's setgid bit is kept, so the group keeps being inherited below it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

#: Replica files: the trainer process stages into them (it maps them read-write), the agent sends from them.
SHARED_READ_WRITE = 0o660
#: The pod-local token: the trainer reads it, only the agent writes it.
SHARED_READ = 0o640
#: Folders: the group lists and enters them (the trainer finds its replica files there), only the agent adds to them.
SHARED_FOLDER = 0o750


def make_shared_folders(path: Path) -> None:
    """``path`` and every missing folder above it, each :data:`SHARED_FOLDER`; folders that exist are left alone."""
    missing: list[Path] = []
    folder = path
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(SHARED_FOLDER)
        except FileExistsError:  # another rank's agent thread made it meanwhile
            continue
        os.chmod(folder, SHARED_FOLDER | (folder.stat().st_mode & stat.S_ISGID))


def open_shared(path: Path, flags: int, mode: int) -> int:
    """``os.open(path, flags | O_CREAT)`` whose file gets exactly ``mode`` (the umask would narrow it)."""
    fd = os.open(path, flags | os.O_CREAT, mode)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_shared(path: Path, text: str, mode: int = SHARED_READ) -> None:
    """Write ``text`` to ``path`` with ``mode``, replacing it atomically (a reader sees the old text or the new)."""
    make_shared_folders(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = open_shared(tmp, os.O_WRONLY | os.O_TRUNC, mode)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
