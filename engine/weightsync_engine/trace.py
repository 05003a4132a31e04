#!/usr/bin/env python3
"""The stock engines' shard-map trace, one entry point for every engine kind. Run BY PATH with the ENGINE's Python
(the one the engine is installed in, where weightsync is not)::

    python .../weightsync_engine/trace.py {sglang,vllm} --model DIR --tp T --rank R --dtype DTYPE
    python .../weightsync_engine/trace.py {sglang,vllm} --serve
    python .../weightsync_engine/trace.py sglang --replica-layout --model DIR --tp T --rank R --dtype D [--ep E]
    python .../weightsync_engine/trace.py sglang --replica-serve

It prints the engine's trace as one JSON object on stdout (``weightsync_engine.<engine>.trace_model``, on the
engine-independent ``trace_core``), or one line on stderr and exit 1 on a real error (2 on bad arguments).
``--serve`` imports the engine once and answers many traces, one JSON line per request line
(``trace_core.serve``). ``--replica-layout`` and ``--replica-serve`` are the engine replica's
(``weightsync_engine.sglang.replica_serve``).

The engine's interpreter imports this root from the directory this file is in, registered as the package
``weightsync_engine`` (:func:`engine_module`), never by adding a directory to ``sys.path``: the directory holding
the package is, in the agent's image, its site-packages, and its torch must not mix with the engine's. The agent
finds this file with ``importlib.util.find_spec("weightsync_engine.trace")`` (``targets/engine_trace.py``), without
importing it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

PACKAGE = "weightsync_engine"
ROOT = Path(__file__).resolve().parent
ENGINES = ("sglang", "vllm")


def package() -> ModuleType:
    """The ``weightsync_engine`` package: the one imported, else this file's directory registered under its name
    (in the engine's interpreter, where it is not installed)."""
    if PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            PACKAGE, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
        )
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {PACKAGE} from {ROOT}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = module
        spec.loader.exec_module(module)
    return sys.modules[PACKAGE]


def engine_module(engine: str) -> ModuleType:
    """``weightsync_engine.<engine>.trace_model``: the engine's side of the trace (``ENGINE``, ``run``)."""
    if engine not in ENGINES:
        raise ValueError(f"no trace for engine {engine!r} (one of {', '.join(ENGINES)})")
    package()
    return importlib.import_module(f"{PACKAGE}.{engine}.trace_model")


def main(argv: list[str] | None = None) -> int:
    """``ENGINE --model DIR --tp T --rank R --dtype DTYPE``: the engine's trace through the core's CLI."""
    args = sys.argv[1:] if argv is None else argv
    package()
    from weightsync_engine import trace_core

    if not args or args[0] not in ENGINES:
        print(f"{trace_core.PROG}: the first argument names the engine ({', '.join(ENGINES)})", file=sys.stderr)
        return 2
    if args[0] == "sglang" and args[1:2] == ["--replica-layout"]:
        from weightsync_engine.sglang import replica_serve

        return replica_serve.layout_main(args[2:])
    if args[0] == "sglang" and args[1:] == ["--replica-serve"]:
        from weightsync_engine.sglang import replica_serve

        return replica_serve.serve()
    traced = engine_module(args[0])
    description = traced.__doc__.splitlines()[0] if traced.__doc__ else ""
    if args[1:] == ["--serve"]:
        return trace_core.serve(engine=traced.ENGINE, description=description, run=traced.run, preload=traced.IMPORT)
    return trace_core.main(args[1:], engine=traced.ENGINE, description=description, run=traced.run)


if __name__ == "__main__":
    # Run as a file, this directory is sys.path[0]: its sglang/ and vllm/ would shadow the engines' own packages.
    if sys.path and Path(sys.path[0] or os.curdir).resolve() == ROOT:
        del sys.path[0]
    sys.exit(main())
