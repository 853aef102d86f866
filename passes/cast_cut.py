"""cast_cut: the exact cast placement of a graph as an s-t minimum cut (networkx).

The problem, apart from any graph: some labels are free (each is low precision or float32;
each starts low), others are constants (:data:`LOW`, :data:`FLOAT32`). Each
:class:`CastValue` is a value with a label and the labels it is read at; a read at another
label than the value's needs a cast, and casts are shared: one per value and direction, so a
value costs its ``cast_bytes`` once if any reader wants it wider, and once more if any wants
it narrower. A free label may also cost something of its own in float32 (``raise_cost``),
and ``tied`` labels must be equal (a view and what it views).

:func:`solve` returns a labeling of least total cost, and of the least-cost ones the one
that raises the fewest labels (the smallest source side of a minimum cut). Free labels only
ever move up: what the problem calls free starts low, and the answer raises some to float32.

The construction (Kolmogorov and Zabih's, "What energy functions can be minimized via graph
cuts?", 2004): the source side is float32, the sink side low. "Value low and some reader
float32" is a supermodular term, not pairwise, so it gets an auxiliary vertex that every
such reader's label pulls to float32 (infinite edges) and whose edge to the value's label
costs the cast; the narrowing direction is the mirror image. A value read at one label needs
no auxiliary vertex. All capacities are integers, so the cut is exact; :func:`solve` checks
that the cut's capacity equals the cost of the labeling it reads off.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import networkx as nx


class Constant:
    """A label no placement changes (known by its name, compared by identity)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


LOW = Constant("LOW")
FLOAT32 = Constant("FLOAT32")

Label = str | Constant
"""A free label's name, or a constant."""


@dataclass(frozen=True)
class CastValue:
    """A value labelled ``label``, read at each of ``readers``; one cast costs ``cast_bytes``."""

    name: str
    label: Label
    cast_bytes: int
    readers: tuple[Label, ...]


@dataclass(frozen=True)
class CastProblem:
    """Free labels, the values that cost casts, tied pairs and the cost of raising a label."""

    free: tuple[str, ...]
    values: tuple[CastValue, ...]
    tied: tuple[tuple[Label, Label], ...] = ()
    raise_cost: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        known = set(self.free)
        if len(known) != len(self.free):
            raise ValueError("CastProblem: a free label is named twice")
        labels = [v.label for v in self.values] + [r for v in self.values for r in v.readers]
        labels += [label for pair in self.tied for label in pair] + list(self.raise_cost)
        for label in labels:
            if not isinstance(label, Constant) and label not in known:
                raise ValueError(f"CastProblem: label {label!r} is neither free nor a constant")
        if any(FLOAT32 in pair for pair in self.tied):
            raise ValueError(
                "CastProblem: a label tied to FLOAT32 is not free (free labels start low)"
            )
        costs = [v.cast_bytes for v in self.values] + list(self.raise_cost.values())
        if any(not isinstance(c, int) or c < 0 for c in costs):
            raise ValueError("CastProblem: every cost is an int >= 0 (bytes)")


@dataclass(frozen=True)
class Placement:
    """The free labels :func:`solve` raised to float32, and the cost before and after."""

    raised: frozenset[str]
    cost: int
    cost_before: int


def _is_float32(label: Label, raised: Iterable[str] | frozenset[str]) -> bool:
    return label is FLOAT32 or (not isinstance(label, Constant) and label in raised)


def cost_of(problem: CastProblem, raised: Iterable[str]) -> int:
    """The bytes a labeling costs: free labels in ``raised`` float32, the others low. A
    labeling that breaks a tie costs nothing finite: an error."""
    up = frozenset(raised)
    for a, b in problem.tied:
        if _is_float32(a, up) != _is_float32(b, up):
            raise ValueError(f"labeling breaks the tie {a!r} = {b!r}")
    total = sum(problem.raise_cost.get(name, 0) for name in up)
    for value in problem.values:
        wide = _is_float32(value.label, up)
        read_wide = {_is_float32(r, up) for r in value.readers}
        total += value.cast_bytes * len(read_wide - {wide})  # one cast per direction
    return total


def casts_of(problem: CastProblem, raised: Iterable[str]) -> int:
    """How many casts a labeling makes: one per value and direction it is read in."""
    up = frozenset(raised)
    count = 0
    for value in problem.values:
        wide = _is_float32(value.label, up)
        count += len({_is_float32(r, up) for r in value.readers} - {wide})
    return count


def savings(problem: CastProblem, raised: Iterable[str]) -> dict[str, int]:
    """What each raised label saves on its own: the cost of lowering it alone again, less the
    cost of ``raised`` (as :func:`cost_of` with one label fewer, counted only over the values
    it takes part in). A label whose lowering breaks a tie is left out."""
    up = frozenset(raised)
    touching: dict[str, list[CastValue]] = {name: [] for name in up}
    for value in problem.values:
        for label in {value.label, *value.readers}:
            if label in touching:
                touching[label].append(value)  # type: ignore[index]
    tied = {label for pair in problem.tied for label in pair}

    def local(values: list[CastValue], labels: frozenset[str]) -> int:
        total = 0
        for value in values:
            wide = _is_float32(value.label, labels)
            total += value.cast_bytes * len(
                {_is_float32(r, labels) for r in value.readers} - {wide}
            )
        return total

    saved = {}
    for name in up - tied:
        values = touching[name]
        lowered = local(values, up - {name}) - problem.raise_cost.get(name, 0)
        saved[name] = lowered - local(values, up)
    return saved


_SOURCE, _SINK = ("source",), ("sink",)


def _vertex(label: Label) -> tuple:
    if label is FLOAT32:
        return _SOURCE
    if label is LOW:
        return _SINK
    return ("label", label)


def flow_network(problem: CastProblem) -> nx.DiGraph:
    """The cut graph: a cut's capacity is the cost of the labeling it separates (source
    side float32), every finite edge being a cast or a raise."""
    edges: dict[tuple[tuple, tuple], int] = {}
    infinite: list[tuple[tuple, tuple]] = []

    def add(u: tuple, v: tuple, capacity: int) -> None:
        if u != v and capacity:
            edges[u, v] = edges.get((u, v), 0) + capacity

    for name, cost in problem.raise_cost.items():
        add(_vertex(name), _SINK, cost)
    for i, value in enumerate(problem.values):
        own = _vertex(value.label)
        readers = {_vertex(r) for r in value.readers} - {own}
        wider = sorted(readers - {_SINK})  # may read it float32 while it is low
        narrower = sorted(readers - {_SOURCE})  # may read it low while it is float32
        if own != _SOURCE and wider:
            if len(wider) == 1:
                add(wider[0], own, value.cast_bytes)
            else:  # any wider reader pulls the up-cast in: one cast for all of them
                aux = ("up", i)
                infinite += [(r, aux) for r in wider]
                add(aux, own, value.cast_bytes)
        if own != _SINK and narrower:
            if len(narrower) == 1:
                add(own, narrower[0], value.cast_bytes)
            else:
                aux = ("down", i)
                infinite += [(aux, r) for r in narrower]
                add(own, aux, value.cast_bytes)
    for a, b in problem.tied:
        infinite += [(_vertex(a), _vertex(b)), (_vertex(b), _vertex(a))]
    big = sum(edges.values()) + 1  # more than every finite edge together: never cut
    import networkx as nx  # here: off by default, the placement costs no import time

    graph = nx.DiGraph()
    graph.add_nodes_from([_SOURCE, _SINK])
    graph.add_nodes_from(_vertex(name) for name in problem.free)
    for (u, v), capacity in edges.items():
        graph.add_edge(u, v, capacity=capacity)
    for u, v in infinite:
        if u != v:
            graph.add_edge(u, v, capacity=big)
    return graph


def solve(problem: CastProblem) -> Placement:
    """The labeling of least cost, raising the fewest labels among those (see the module
    docstring). Raises RuntimeError if the cut and the labeling's cost disagree (a bug)."""
    before = cost_of(problem, ())
    if not problem.free:
        return Placement(frozenset(), before, before)
    graph = flow_network(problem)
    from networkx.algorithms.flow import preflow_push

    residual = preflow_push(graph, _SOURCE, _SINK)
    # The smallest source side of a minimum cut: what the source still reaches.
    reached = {_SOURCE}
    queue = deque([_SOURCE])
    while queue:
        u = queue.popleft()
        for v, edge in residual[u].items():
            if v not in reached and edge["capacity"] - edge["flow"] > 0:
                reached.add(v)
                queue.append(v)
    if _SINK in reached:
        raise RuntimeError("cast_cut: the flow is not maximal (the sink is still reached)")
    raised = frozenset(name for name in problem.free if _vertex(name) in reached)
    cost = cost_of(problem, raised)
    if cost != residual.graph["flow_value"]:
        raise RuntimeError(
            f"cast_cut: the cut costs {residual.graph['flow_value']} bytes but its labeling "
            f"costs {cost}: the flow network does not model the problem"
        )
    return Placement(raised, cost, before)


__all__ = [
    "FLOAT32",
    "LOW",
    "CastProblem",
    "CastValue",
    "Constant",
    "Label",
    "Placement",
    "casts_of",
    "cost_of",
    "flow_network",
    "savings",
    "solve",
]
