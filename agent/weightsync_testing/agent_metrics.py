"""Reading an agent's Prometheus ``/metrics`` in tests (an open route): what a round or a scrub counted."""

from __future__ import annotations

import urllib.request


def metric(url: str, name: str, **labels: str) -> float:
    """The sample of ``name`` whose labels include ``labels`` on the agent at ``url`` (0 when there is none yet)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
