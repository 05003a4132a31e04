"""The testbed's pure parts: who sits on which emulated node, link rates, link loads and the lower bound.

Nothing here touches the network or starts a process, so it is unit-tested on its own
(``tests/unit/agent/test_testbed_scenario.py``).

**Nodes.** Every trainer rank is a node ``t<i>`` (one trainer rank per pod). Every engine *rank* is a node
``e<e>r<r>`` (engine pods of one rank each, ``ranksPerPod: 1``), so each inference rank has its own link.
Each node has one full-duplex link to a switch, capped at ``rate`` bits/s in each direction.

**The lower bound.** A link carries at most ``rate`` in each direction, so a round cannot finish before
the busiest link direction has moved its bytes::

    bound_s = max over nodes n, directions d of bytes(n, d) * 8 / rate

p2p: a trainer node sends the shard bytes of every target the plan gives it (``out``), a target node
receives its own shard bytes (``in``); each target has exactly one source. Broadcast (gloo): the binomial
tree of ``gloo::broadcast`` (see :func:`binomial_sends`): the sender sends the whole message
``ceil(log2(world))`` times, and some receivers forward it.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from weightsync_tools.simulate.model import binomial_children

MiB = 1 << 20
Target = tuple[int, int]
Link = tuple[str, str]  # (node, "in" | "out")

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)?\s*$", re.IGNORECASE)
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def parse_rate(text: str) -> int:
    """``"1gbit"`` → 1_000_000_000 bits/s (tc's decimal units; a bare number is bits/s)."""
    match = _RATE.match(text)
    if not match:
        raise ValueError(f"rate {text!r}: expected a number with bit, kbit, mbit, gbit or tbit (e.g. 1gbit)")
    bits = float(match.group(1)) * _UNITS[(match.group(2) or "bit").lower()]
    if bits < 1000:
        raise ValueError(f"rate {text!r} is below 1 kbit/s")
    return int(bits)


def format_rate(bits_per_second: int) -> str:
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits_per_second >= scale and bits_per_second % scale == 0:
            return f"{bits_per_second // scale}{unit}"
    return f"{bits_per_second}bit"


def trainer_node(rank: int) -> str:
    return f"t{rank}"


def engine_node(engine: int, rank: int) -> str:
    return f"e{engine}r{rank}"


@dataclass(frozen=True)
class Layout:
    """Scenario shape: ``trainers`` trainer nodes, ``engines`` engines of ``tp`` ranks, one node per rank."""

    trainers: int
    engines: int
    tp: int

    def __post_init__(self) -> None:
        if self.trainers < 1 or self.engines < 1 or self.tp < 1:
            raise ValueError(f"need at least one trainer, engine and rank: {self}")

    @property
    def trainer_nodes(self) -> list[str]:
        return [trainer_node(i) for i in range(self.trainers)]

    @property
    def engine_nodes(self) -> list[str]:
        return [engine_node(e, r) for e in range(self.engines) for r in range(self.tp)]

    @property
    def nodes(self) -> list[str]:
        return self.trainer_nodes + self.engine_nodes

    def address(self, node: str, subnet: int) -> str:
        """The node's IPv4 address in ``10.231.<subnet>.0/24``: trainers from .10, engine ranks from .100."""
        if not 0 <= subnet <= 255:
            raise ValueError(f"subnet {subnet} outside 0..255")
        if node.startswith("t"):
            host = 10 + int(node[1:])
        else:
            engine, rank = (int(x) for x in node[1:].split("r"))
            host = 100 + engine * self.tp + rank
        if host > 254:
            raise ValueError(f"too many nodes for one /24: {node}")
        return f"10.231.{subnet}.{host}"


# ----------------------------------------------------------------------------------------- link loads


def p2p_link_loads(assignments: Mapping[int, Sequence[Target]], target_bytes: Mapping[Target, int]) -> dict[Link, int]:
    """Bytes per link direction when trainer rank ``s`` writes ``target_bytes[t]`` to each of its targets."""
    loads: dict[Link, int] = {}
    for source, targets in assignments.items():
        for target in targets:
            nbytes = target_bytes[target]
            out = (trainer_node(source), "out")
            loads[out] = loads.get(out, 0) + nbytes
            into = (engine_node(*target), "in")
            loads[into] = loads.get(into, 0) + nbytes
    return loads


def binomial_sends(world: int, root: int = 0) -> list[tuple[int, int]]:
    """``(sender, receiver)`` group-rank pairs of one ``gloo::broadcast``, round by round: the simulator's tree
    (:func:`weightsync_tools.simulate.model.binomial_children`, virtual rank ``v = (rank - root) mod world``), where a
    child ``v | 2^i`` is sent to in round ``i``."""
    if not 0 <= root < world:
        raise ValueError(f"world {world}, root {root}")
    children = binomial_children(world)
    pairs = sorted(((parent, child) for parent, kids in enumerate(children) for child in kids),
                   key=lambda pair: (pair[1] - pair[0], pair[0]))  # fmt: skip
    return [((parent + root) % world, (child + root) % world) for parent, child in pairs]


def broadcast_link_loads(member_nodes: Sequence[str], sender_node: str, nbytes: int) -> dict[Link, int]:
    """Bytes per link direction of a broadcast of ``nbytes`` from group rank 0 (on ``sender_node``) to
    group ranks ``1..`` (member ``i`` on ``member_nodes[i - 1]``), over gloo's binomial tree.

    Members of one process share a node; a send between two members of the same node crosses no link.
    """
    nodes = [sender_node, *member_nodes]
    loads: dict[Link, int] = {}
    for sender, receiver in binomial_sends(len(nodes)):
        a, b = nodes[sender], nodes[receiver]
        if a == b:
            continue
        loads[(a, "out")] = loads.get((a, "out"), 0) + nbytes
        loads[(b, "in")] = loads.get((b, "in"), 0) + nbytes
    return loads


def busiest(loads: Mapping[Link, int]) -> tuple[Link, int]:
    if not loads:
        raise ValueError("no link carries anything")
    link = max(sorted(loads), key=lambda k: loads[k])
    return link, loads[link]


def bound_seconds(loads: Mapping[Link, int], rate_bits: int) -> float:
    """The link-bound lower bound: bytes on the busiest link direction / link rate."""
    return busiest(loads)[1] * 8 / rate_bits


# ----------------------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Stats:
    n: int
    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Stats:
        data = list(values)
        if not data:
            raise ValueError("no values")
        return cls(len(data), statistics.median(data), min(data), max(data))

    def as_json(self) -> dict[str, float | int]:
        return {"n": self.n, "median": round(self.median, 4), "min": round(self.min, 4), "max": round(self.max, 4)}


def parse_points(text: str, limit: int = 8) -> list[int]:
    """``"1-8"`` or ``"1,2,4,8"`` → sorted engine counts, each 1..``limit``."""
    points: set[int] = set()
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            continue
        if "-" in part:
            low, high = (int(x) for x in part.split("-", 1))
            points.update(range(low, high + 1))
        else:
            points.add(int(part))
    if not points or min(points) < 1 or max(points) > limit:
        raise ValueError(f"engine counts {text!r}: need values in 1..{limit}")
    return sorted(points)


def model_shape(mib: float) -> dict[str, int]:
    """Reference-model fields (``ModelConfig``) for about ``mib`` MiB of float32 full tensors.

    Per layer ``15 h^2`` floats (qkv 2h^2, o h^2, gate_up 8h^2, down 4h^2); embedding and LM head
    ``2 vocab h`` (replicated on every TP rank by the reference engine). Same rule as bench/layout_bench.py.
    """
    hidden = 1024 if mib >= 128 else 256
    vocab = 4096
    per_layer = 15 * hidden * hidden * 4
    embeddings = 2 * vocab * hidden * 4
    layers = max(1, round((mib * MiB - embeddings) / per_layer))
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_layers": layers,
        "num_heads": 8,
        "num_kv_heads": 4,
        "head_dim": hidden // 8,
        "intermediate_size": 4 * hidden,
    }
