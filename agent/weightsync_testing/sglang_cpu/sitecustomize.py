"""Gated import-level workarounds that let the stock PyPI ``sglang==0.5.23`` server run on a CPU-only machine.

This directory is put on the SGLang server's ``PYTHONPATH`` by ``weightsync_testing.sglang_server`` **only**
when the server runs with ``--device cpu``; Python then imports this file at start-up in every SGLang process
(HTTP server, scheduler per TP rank, detokenizer). SGLang's site-packages stay unedited: each workaround is a
post-import hook that rebinds one name in one SGLang module, right after that module is first imported.

Gates, all required: ``WEIGHTSYNC_SGLANG_CPU_WORKAROUNDS`` names the workarounds to enable (comma-separated,
see :data:`WORKAROUNDS`), and at hook time ``torch.cuda.is_available()`` is false. On a CUDA host nothing is
patched (and the launcher does not put this directory on the path at all).

Evidence, so tests can assert it: each workaround appends a JSON line ``{"workaround", "event", "pid",
"target", ...}`` to the file named by ``WEIGHTSYNC_SGLANG_WORKAROUND_LOG`` (when set) and prints the marker
line ``weightsync-sglang-cpu-workaround: <event> <name> ...`` on stderr: event ``applied`` when the name is
rebound, ``used`` the first time (per process) the replacement actually runs.

Any ``sitecustomize`` that this file shadows (a distribution's own, later on ``sys.path``) is still run first.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

ENV_ENABLE = "WEIGHTSYNC_SGLANG_CPU_WORKAROUNDS"
ENV_LOG = "WEIGHTSYNC_SGLANG_WORKAROUND_LOG"
#: Test faults to arm (comma-separated, :data:`FAULTS`), and the file whose existence fires them.
ENV_FAULTS = "WEIGHTSYNC_SGLANG_TEST_FAULTS"
ENV_FAULT_TRIGGER = "WEIGHTSYNC_SGLANG_FAULT_TRIGGER"
MARKER = "weightsync-sglang-cpu-workaround:"

ROTARY_MODULE = "sglang.srt.layers.rotary_embedding.base"
REGISTER_MODULE = "sglang.srt.model_loader.remote_instance_weight_loader_utils"
PARALLEL_MODULE = "sglang.srt.distributed.parallel_state"
MLA_DISPATCH_MODULE = "sglang.srt.models.deepseek_common.attention_backend_handler"
RUNNER_UPDATER_MODULE = "sglang.srt.model_executor.model_runner_components.weight_updater"
PLACEHOLDER_MODULE = "_weightsync_vllm_custom_ops"

_HERE = os.path.dirname(os.path.abspath(__file__))
_lock = threading.Lock()
_used: set[str] = set()


def record(name: str, event: str, target: str, **detail: Any) -> None:
    """Append one evidence line to ``$WEIGHTSYNC_SGLANG_WORKAROUND_LOG`` and print the marker on stderr."""
    entry = {"workaround": name, "event": event, "pid": os.getpid(), "target": target, **detail}
    line = json.dumps(entry, sort_keys=True)
    path = os.environ.get(ENV_LOG)
    if path:
        with _lock, open(path, "a", encoding="utf-8") as log:  # one short write per line: O_APPEND keeps it whole
            log.write(line + "\n")
    print(f"{MARKER} {event} {name} {target} pid={os.getpid()}", file=sys.stderr, flush=True)


def _used_once(name: str, target: str, **detail: Any) -> None:
    with _lock:
        if name in _used:
            return
        _used.add(name)
    record(name, "used", target, **detail)


def _cuda_available() -> bool:
    torch = sys.modules.get("torch") or importlib.import_module("torch")
    return bool(torch.cuda.is_available())


# ---------------------------------------------------------------- workaround 1: rotary_vllm_placeholder


def rotary_vllm_placeholder(module: ModuleType) -> None:
    """Serve a placeholder ``vllm._custom_ops`` while a ``RotaryEmbedding`` is constructed.

    Why: ``RotaryEmbedding.__init__`` (``sglang/srt/layers/rotary_embedding/base.py`` lines 123-143 in 0.5.23)
    picks a fallback kernel when the platform is neither CUDA nor SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``,
    unusable: it needs a CPU build of ``sgl_kernel`` that PyPI does not ship) and runs
    ``from vllm._custom_ops import rotary_embedding``. vLLM is not installed, so model construction fails with
    ``ModuleNotFoundError: No module named 'vllm'``. The kernel is never called on this path: the layer
    dispatches to ``forward_native`` on the base platform.

    How: ``RotaryEmbedding.__init__`` is wrapped so that, only for the duration of the call, ``sys.modules``
    holds ``vllm`` and ``vllm._custom_ops`` placeholders whose ``rotary_embedding`` raises if ever called. No
    other SGLang code sees a ``vllm`` module (a placeholder on ``PYTHONPATH`` would also flip
    ``fused_moe.py``'s ``_has_vllm_ops`` to true).

    Risk: low. Import-only; if a future SGLang calls the fallback kernel on CPU, the placeholder raises
    ``RuntimeError`` at the first forward instead of computing something wrong.
    """
    name, target = "rotary_vllm_placeholder", f"{ROTARY_MODULE}:RotaryEmbedding.__init__"
    cls = module.RotaryEmbedding
    original = cls.__init__

    @functools.wraps(original)
    def init_with_placeholder(self: Any, *args: Any, **kwargs: Any) -> None:
        with _vllm_placeholder() as installed:
            original(self, *args, **kwargs)
        if installed and getattr(self, "use_fallback_kernel", False):
            _used_once(name, target, layer=type(self).__name__)

    cls.__init__ = init_with_placeholder
    record(name, "applied", target)


@contextmanager
def _vllm_placeholder() -> Iterator[bool]:
    if "vllm" in sys.modules or importlib.util.find_spec("vllm") is not None:
        yield False  # a real vLLM is importable: leave it alone
        return
    ops = importlib.import_module(PLACEHOLDER_MODULE)
    package = ModuleType("vllm")
    package.__path__ = []
    package._custom_ops = ops  # type: ignore[attr-defined]
    with _lock:
        sys.modules["vllm"] = package
        sys.modules["vllm._custom_ops"] = ops
    try:
        yield True
    finally:
        with _lock:
            sys.modules.pop("vllm._custom_ops", None)
            sys.modules.pop("vllm", None)


# ---------------------------------------------------------------- workaround 2: register_per_parameter


def register_per_parameter(module: ModuleType) -> None:
    """Register each parameter with Mooncake (SGLang's own ``register_memory_region_v1``) instead of ``v2``.

    Why: ``register_memory_region`` (``sglang/srt/model_loader/remote_instance_weight_loader_utils.py`` line 109
    in 0.5.23) always calls ``register_memory_region_v2`` when torch is importable. ``v2`` (line 139) builds the
    published ``{name: (ptr, numel, element_size)}`` from ``named_parameters()`` but registers memory by walking
    ``torch.cuda.memory.memory_snapshot()``, which is empty on CPU: nothing is registered, and Mooncake 0.3.13's
    TCP server rejects every write ("remote-supplied address ... is not within any registered buffer").
    ``v1`` (line 116, same module) registers each parameter and publishes the identical dict.

    How: the module's global ``register_memory_region_v2`` is rebound to a wrapper calling ``v1``;
    ``register_memory_region`` looks the name up at call time, so both of its callers
    (``model_runner_components/remote_instance_weight_transporter.py`` and ``model_loader/loader.py``) get it.

    Risk: medium. It rebinds an internal name (a rename upstream makes the hook fail loudly at import, which the
    tier's tests see). It changes how much memory is registered (per parameter instead of merged allocator
    blocks), not what is published. SGLang's production GPU path (v2) is not exercised by this tier.
    """
    name, target = "register_per_parameter", f"{REGISTER_MODULE}:register_memory_region_v2"
    v1 = module.register_memory_region_v1

    def register_memory_region_v2(model: Any, transfer_engine: Any) -> Any:
        weights = v1(model, transfer_engine)
        _used_once(name, target, parameters=len(weights))
        return weights

    setattr(module, "register_memory_region_v2", register_memory_region_v2)  # noqa: B010 (a module global)
    record(name, "applied", target)


# ---------------------------------------------------------------- workaround 3: no_pynccl


def no_pynccl(module: ModuleType) -> None:
    """Build every SGLang process group with ``use_pynccl=False`` (TP >= 2 only).

    Why: ``init_model_parallel_group`` (``sglang/srt/distributed/parallel_state.py`` lines 2160-2185 in 0.5.23)
    defaults ``use_pynccl`` to true on this platform, and ``GroupCoordinator.__init__`` (line 463) then builds a
    ``PyNcclCommunicator``, which raises "Expected a cuda device, but got: cpu" for any group larger than one.
    With pynccl off, collectives go through ``torch.distributed`` on the gloo CPU group. The custom all-reduce
    is switched off with SGLang's own ``--disable-custom-all-reduce`` flag (the launcher passes it).

    How: the module's global ``init_model_parallel_group`` is rebound to a wrapper that forces
    ``use_pynccl=False``; every caller inside ``parallel_state`` looks the name up at call time.

    Risk: medium-high. It changes the communicator of every group, and only TP=2 on CPU has been tried; on a
    GPU this would be wrong, hence the CUDA gate.
    """
    name, target = "no_pynccl", f"{PARALLEL_MODULE}:init_model_parallel_group"
    original = module.init_model_parallel_group
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_model_parallel_group(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.arguments["use_pynccl"] = False
        group = original(*bound.args, **bound.kwargs)
        if getattr(group, "world_size", 1) > 1:
            _used_once(name, target, group=str(bound.arguments.get("group_name")))
        return group

    setattr(module, "init_model_parallel_group", init_model_parallel_group)  # noqa: B010 (a module global)
    record(name, "applied", target)


# ---------------------------------------------------------------- workaround 4: absorbed_mla_on_torch_native


def absorbed_mla_on_torch_native(module: ModuleType) -> None:
    """Run MLA models (DeepSeek-V2/V3, Kimi-K2) in SGLang's absorbed MLA form on the ``torch_native`` backend.

    Why: without Intel AMX, SGLang's CPU backend is ``torch_native`` ("The current platform does not support Intel
    AMX, will fallback to torch_native backend"). ``AttentionBackendRegistry`` has no handler for it
    (``sglang/srt/models/deepseek_common/attention_backend_handler.py`` in 0.5.23), so ``get_handler`` falls back to
    the Triton one, which picks plain multi-head attention (``AttnForwardMethod.MHA``) for a prefill without a
    cached prefix; ``torch_native``'s ``forward_extend`` then reads keys and values from the MLA latent cache
    (576-wide in DeepSeek-V3) instead of the MHA keys it was given, and the first request fails ("Expected size
    for first two dimensions of batch2 tensor"). The absorbed form (``AttnForwardMethod.MLA``) attends over the
    latent cache itself, which is what ``torch_native`` reads: SGLang's own decode path, used for prefill too.

    How: a handler for ``torch_native`` is registered that returns the module's own ``_dispatch_mla_subtype``
    (the choice SGLang makes for every request that is not a prefix-less prefill).

    Risk: low. It only picks between two of SGLang's own forward methods that compute the same attention; the
    weights are the same parameters either way (``post_load_weights`` derives the absorbed ``w_kc``/``w_vc``).
    """
    name, target = "absorbed_mla_on_torch_native", f"{MLA_DISPATCH_MODULE}:AttentionBackendRegistry"
    dispatch = module._dispatch_mla_subtype

    def handle_attention_torch_native(attn: Any, forward_batch: Any) -> Any:
        _used_once(name, target)
        return dispatch(attn, forward_batch)

    module.AttentionBackendRegistry.register("torch_native", handle_attention_torch_native)
    record(name, "applied", target)


WORKAROUNDS: dict[str, tuple[str, Callable[[ModuleType], None]]] = {
    "rotary_vllm_placeholder": (ROTARY_MODULE, rotary_vllm_placeholder),
    "register_per_parameter": (REGISTER_MODULE, register_per_parameter),
    "no_pynccl": (PARALLEL_MODULE, no_pynccl),
    "absorbed_mla_on_torch_native": (MLA_DISPATCH_MODULE, absorbed_mla_on_torch_native),
}


# ---------------------------------------------------------------- test faults (never workarounds)


def skip_post_load_on_trigger(module: ModuleType) -> None:
    """A TEST FAULT, armed only by ``WEIGHTSYNC_SGLANG_TEST_FAULTS`` (the semantic gate's tests): while the file named
    by ``WEIGHTSYNC_SGLANG_FAULT_TRIGGER`` exists, a weight-update session ends without the model's
    ``post_load_weights``, as an engine whose post-processing step was skipped. For MLA (DeepSeek-V3, Kimi-K2),
    ``w_kc``/``w_vc`` then stay derived from the previous weights while every written parameter is new: byte
    verification passes, generation reads a model that is neither version.

    How: ``WeightUpdater.end_weight_update`` (the model runner's, ``run_post_load``) is wrapped; each time it fires
    it records a ``used`` line."""
    name, target = "skip_post_load_on_trigger", f"{RUNNER_UPDATER_MODULE}:WeightUpdater.end_weight_update"
    updater = module.WeightUpdater
    original = updater.end_weight_update

    def end_weight_update(self: Any, *, run_post_load: bool) -> None:
        trigger = os.environ.get(ENV_FAULT_TRIGGER, "")
        if run_post_load and trigger and os.path.exists(trigger):
            record(name, "used", target)
            run_post_load = False
        original(self, run_post_load=run_post_load)

    updater.end_weight_update = end_weight_update
    record(name, "applied", target)


FAULTS: dict[str, tuple[str, Callable[[ModuleType], None]]] = {
    "skip_post_load_on_trigger": (RUNNER_UPDATER_MODULE, skip_post_load_on_trigger),
}


# ---------------------------------------------------------------- post-import hooks


class _HookLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, hook: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._hook = hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        created: ModuleType | None = self._loader.create_module(spec)
        return created

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        if _cuda_available():
            print(f"{MARKER} skipped {module.__name__}: CUDA is available", file=sys.stderr, flush=True)
            return
        self._hook(module)

    def __getattr__(self, attr: str) -> Any:  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self._loader, attr)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs ``hook(module)`` right after the named module's code has executed (once, at its first import)."""

    def __init__(self, hooks: dict[str, Callable[[ModuleType], None]]) -> None:
        self._hooks = hooks

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        hook = self._hooks.pop(fullname, None)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _HookLoader(spec.loader, hook)
        return spec


def _run_shadowed_sitecustomize() -> None:
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None or spec.origin == os.path.abspath(__file__):
        return
    shadowed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shadowed)


def install(names: Sequence[str], faults: Sequence[str] = ()) -> None:
    unknown = [n for n in names if n not in WORKAROUNDS]
    if unknown:
        raise RuntimeError(f"{ENV_ENABLE}: unknown workaround(s) {unknown}; known: {sorted(WORKAROUNDS)}")
    unknown = [n for n in faults if n not in FAULTS]
    if unknown:
        raise RuntimeError(f"{ENV_FAULTS}: unknown test fault(s) {unknown}; known: {sorted(FAULTS)}")
    hooks = {WORKAROUNDS[n][0]: WORKAROUNDS[n][1] for n in names}
    hooks.update({FAULTS[n][0]: FAULTS[n][1] for n in faults})
    sys.meta_path.insert(0, _PostImportFinder(hooks))


def _names(variable: str) -> list[str]:
    return [n.strip() for n in os.environ.get(variable, "").split(",") if n.strip()]


_run_shadowed_sitecustomize()
_enabled, _faults = _names(ENV_ENABLE), _names(ENV_FAULTS)
if _enabled or _faults:
    install(_enabled, _faults)
