"""The few NCCL calls a unique-id broadcast group needs, through ``ctypes`` on the ``libnccl.so.2`` torch ships.

Why not ``torch.distributed``: a torch process group meets its peers through a torch store, and engines that take a
raw ``ncclUniqueId`` (vLLM's ``nccl`` weight-transfer backend, ``nccl_unique_id_b64``) never touch one. Why not
vLLM's own wrapper: the trainer must not need vLLM installed. The library is found at ``$WEIGHTSYNC_NCCL_LIBRARY``,
else in the ``nvidia-nccl`` wheel torch's CUDA builds depend on, else by the loader (``libnccl.so.2``).

Only what :mod:`weightsync_agent.transport.nccl_uid_group` calls is bound; every call's result is checked and an
error raises :class:`NcclError` with NCCL's own text.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path
from typing import Final

ENV_LIBRARY: Final = "WEIGHTSYNC_NCCL_LIBRARY"
UNIQUE_ID_BYTES: Final = 128

# ncclDataType_t and ncclRedOp_t values (nccl.h, stable since NCCL 2.0).
NCCL_DTYPES: Final[dict[str, int]] = {
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "uint32": 3,
    "int64": 4,
    "uint64": 5,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
}
NCCL_SUM: Final = 0
NCCL_SUCCESS: Final = 0
NCCL_IN_PROGRESS: Final = 7


class NcclError(RuntimeError):
    """An NCCL call failed or the library could not be loaded; the message is NCCL's (or the loader's)."""


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]

    @classmethod
    def from_bytes(cls, raw: bytes) -> UniqueId:
        if len(raw) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
        unique = cls()
        ctypes.memmove(ctypes.byref(unique), raw, UNIQUE_ID_BYTES)
        return unique

    def raw(self) -> bytes:
        return ctypes.string_at(ctypes.byref(self), UNIQUE_ID_BYTES)


Comm = ctypes.c_void_p

#: ``ncclConfig_t`` as NCCL 2.14 laid it out. NCCL reads a caller's config by its ``size`` and ``version`` and
#: defaults every later field, so this prefix works with every NCCL since (the struct's stated compatibility rule).
NCCL_CONFIG_MAGIC: Final = 0xCAFEBEEF
NCCL_CONFIG_VERSION: Final = 21403  # NCCL_VERSION(2, 14, 3)
NCCL_CONFIG_UNDEF_INT: Final = -(2**31)


class Config(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
    ]

    @classmethod
    def nonblocking(cls) -> Config:
        """``NCCL_CONFIG_INITIALIZER`` with ``blocking = 0``: calls return ``ncclInProgress`` instead of waiting."""
        undef = NCCL_CONFIG_UNDEF_INT
        return cls(ctypes.sizeof(cls), NCCL_CONFIG_MAGIC, NCCL_CONFIG_VERSION, 0, undef, undef, undef, None)


def library_path() -> str:
    """Where the NCCL library is taken from (the environment, torch's wheel, or the loader's search)."""
    explicit = os.environ.get(ENV_LIBRARY)
    if explicit:
        return explicit
    spec = importlib.util.find_spec("nvidia.nccl")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(root) / "lib" / "libnccl.so.2"
        if candidate.exists():
            return str(candidate)
    return "libnccl.so.2"


class NcclLibrary:
    """``libnccl.so.2``, loaded once per path."""

    _loaded: dict[str, ctypes.CDLL] = {}

    def __init__(self, path: str | None = None) -> None:
        self.path = path or library_path()
        lib = self._loaded.get(self.path)
        if lib is None:
            try:
                lib = ctypes.CDLL(self.path)
            except OSError as exc:
                raise NcclError(f"cannot load the NCCL library {self.path}: {exc} (set {ENV_LIBRARY})") from exc
            self._declare(lib)
            self._loaded[self.path] = lib
        self.lib = lib

    @staticmethod
    def _declare(lib: ctypes.CDLL) -> None:
        c_int, c_size_t, c_void_p = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p
        signatures: dict[str, list[object]] = {
            "ncclGetVersion": [ctypes.POINTER(c_int)],
            "ncclGetUniqueId": [ctypes.POINTER(UniqueId)],
            "ncclCommInitRank": [ctypes.POINTER(Comm), c_int, UniqueId, c_int],
            "ncclCommInitRankConfig": [ctypes.POINTER(Comm), c_int, UniqueId, c_int, ctypes.POINTER(Config)],
            "ncclAllReduce": [c_void_p, c_void_p, c_size_t, c_int, c_int, Comm, c_void_p],
            "ncclBroadcast": [c_void_p, c_void_p, c_size_t, c_int, c_int, Comm, c_void_p],
            "ncclCommGetAsyncError": [Comm, ctypes.POINTER(c_int)],
            "ncclCommAbort": [Comm],
        }
        for name, arguments in signatures.items():
            function = getattr(lib, name)
            function.restype = c_int
            function.argtypes = arguments
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [c_int]

    def check(self, result: int, what: str) -> None:
        """Raise unless ``result`` is success, or ``ncclInProgress`` (a non-blocking communicator's call under way:
        its outcome is :meth:`state`'s)."""
        if result not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            raise NcclError(f"{what}: {self.error_text(result)} (NCCL error {result})")

    def version(self) -> int:
        value = ctypes.c_int()
        self.check(self.lib.ncclGetVersion(ctypes.byref(value)), "ncclGetVersion")
        return value.value

    def unique_id(self) -> bytes:
        """A fresh ``ncclUniqueId`` (it names a bootstrap listener of this process; no GPU needed)."""
        unique = UniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(unique)), "ncclGetUniqueId")
        return unique.raw()

    def init_rank(self, world_size: int, unique_id: bytes, rank: int) -> ctypes.c_void_p:
        """``ncclCommInitRank`` on the current CUDA device: blocks until every rank of the world joined."""
        comm = Comm()
        self.check(
            self.lib.ncclCommInitRank(ctypes.byref(comm), world_size, UniqueId.from_bytes(unique_id), rank),
            f"ncclCommInitRank(rank {rank} of {world_size})",
        )
        return comm

    def all_reduce_sum(self, pointer: int, count: int, dtype: str, comm: ctypes.c_void_p, stream: int) -> None:
        self.check(
            self.lib.ncclAllReduce(pointer, pointer, count, NCCL_DTYPES[dtype], NCCL_SUM, comm, stream),
            "ncclAllReduce",
        )

    def broadcast(self, pointer: int, count: int, dtype: str, root: int, comm: ctypes.c_void_p, stream: int) -> None:
        self.check(
            self.lib.ncclBroadcast(pointer, pointer, count, NCCL_DTYPES[dtype], root, comm, stream), "ncclBroadcast"
        )

    def init_rank_nonblocking(self, world_size: int, unique_id: bytes, rank: int) -> ctypes.c_void_p:
        """``ncclCommInitRankConfig`` with ``blocking = 0`` on the current CUDA device: returns at once; the join is
        complete when :meth:`state` is success, and can be given up with :meth:`abort` while it is not."""
        comm, config = Comm(), Config.nonblocking()
        self.check(
            self.lib.ncclCommInitRankConfig(
                ctypes.byref(comm), world_size, UniqueId.from_bytes(unique_id), rank, ctypes.byref(config)
            ),
            f"ncclCommInitRankConfig(rank {rank} of {world_size})",
        )
        return comm

    def state(self, comm: ctypes.c_void_p) -> int:
        """``ncclCommGetAsyncError``'s raw state: success, ``ncclInProgress``, or an error code."""
        value = ctypes.c_int()
        self.check(self.lib.ncclCommGetAsyncError(comm, ctypes.byref(value)), "ncclCommGetAsyncError")
        return value.value

    def error_text(self, code: int) -> str:
        return str(self.lib.ncclGetErrorString(code).decode(errors="replace"))

    def async_error(self, comm: ctypes.c_void_p) -> str | None:
        """NCCL's pending asynchronous error on ``comm`` (a peer gone, a timeout), or None."""
        state = self.state(comm)
        return None if state in (NCCL_SUCCESS, NCCL_IN_PROGRESS) else self.error_text(state)

    def abort(self, comm: ctypes.c_void_p) -> None:
        """``ncclCommAbort``: frees the communicator and makes its pending kernels return."""
        self.check(self.lib.ncclCommAbort(comm), "ncclCommAbort")
