"""The gate every weightsync fix of a stock vLLM defect passes before it is installed (docs/engines/vllm.md): only on
vLLM's CPU platform (the defects are in its CPU kernels), only for the release it was checked against, never when its
switch says ``0``. Each fix says why it was not installed, so the plugin's log and the tests can tell."""

from __future__ import annotations

import os
from collections.abc import Callable


def why_not(switch: str, validated: str, off_cpu: str) -> str | None:
    """Why a fix switched by ``switch`` and checked against vLLM ``validated`` is not wanted here, or None."""
    if os.environ.get(switch, "1") == "0":
        return f"{switch}=0"
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return off_cpu
    if vllm.__version__ != validated:
        return f"vLLM {vllm.__version__}, checked against {validated} only"
    return None


def install_if_wanted(why: str | None, install: Callable[[], bool]) -> str:
    """Install unless ``why`` says not; what the plugin's ``register`` logs."""
    if why is not None:
        return f"not installed: {why}"
    install()
    return "installed"
