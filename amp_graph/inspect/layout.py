"""The fallback layout, used where graphviz is not installed: layered, top to bottom.

A compound Sugiyama-style layout, small enough to read:

1. every cluster is laid out on its own, inner clusters first, and then placed in its
   parent as one block, so that module boxes never overlap;
2. within a cluster, blocks are layered by longest path from the sources
   (``networkx.topological_generations``); sources such as parameters then move down next
   to their first consumer;
3. an edge spanning several layers gets a narrow lane in each layer it passes, so that
   it runs between boxes rather than through them;
4. each layer is ordered by the barycentre of its neighbours (two sweeps each way) and
   placed under its predecessors, pushed apart where boxes would overlap.

Where blocks form a cycle (two modules that feed each other in turn), the edge going most
backwards in graph order is ignored when layering, and drawn as a curve all the same.
Sizes are estimated from the label text, since no font metrics are at hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .view import Box, View

if TYPE_CHECKING:
    import networkx as nx

FONT_SIZE = 11
CHAR_W = 6.5  # average width of a character at FONT_SIZE (bold titles: TITLE_CHAR_W)
TITLE_CHAR_W = 7.2
LINE_H = 14
PAD_X, PAD_Y = 9, 6
CAST_TIP = 12  # the extra width of a cast hexagon's pointed ends
NODE_GAP, RANK_GAP = 14, 26
CLUSTER_PAD, CLUSTER_HEAD = 10, 18
LANE_W = 4  # the width an edge reserves in each layer it passes through
CLUSTER, LANE = "cluster:", "lane:"  # prefixes of the items that are not boxes


@dataclass
class Rect:
    x: float
    y: float
    w: float
    h: float

    @property
    def cx(self) -> float:
        return self.x + self.w / 2

    @property
    def bottom(self) -> float:
        return self.y + self.h


Lane = tuple[float, float, float]
"""Where a long edge crosses a layer: x, and the layer's top and bottom."""


@dataclass
class Layout:
    """Absolute rectangles of boxes and clusters, the lanes of long edges (by box edge),
    and the overall size."""

    boxes: dict[str, Rect] = field(default_factory=dict)
    clusters: dict[str, Rect] = field(default_factory=dict)
    routes: dict[tuple[str, str], list[Lane]] = field(default_factory=dict)
    width: float = 0.0
    height: float = 0.0


def box_size(box: Box) -> tuple[float, float]:
    """Width and height of a box from its label."""
    width = max([len(box.title) * TITLE_CHAR_W] + [len(line) * CHAR_W for line in box.lines])
    width += 2 * PAD_X + (2 * CAST_TIP if box.kind == "cast" else 0)
    return width, (1 + len(box.lines)) * LINE_H + 2 * PAD_Y


class _Compound:
    """Lays out clusters bottom-up; positions are relative to the enclosing cluster."""

    def __init__(self, view: View) -> None:
        self.view = view
        self.chains = {key: self._chain(box.cluster) for key, box in view.boxes.items()}
        self.children: dict[str, list[str]] = {"": []}
        for path in view.clusters:
            self.children.setdefault(path, [])
            self.children.setdefault(view.parent(path), []).append(CLUSTER + path)
        for key in view.boxes:
            self.children[self.chains[key][-1]].append(key)
        self.sizes = {key: box_size(box) for key, box in view.boxes.items()}
        self.relative: dict[str, tuple[float, float]] = {}  # item -> offset in its cluster
        self.lanes: dict[str, dict[str, Lane]] = {}  # cluster -> lane -> relative lane
        self.long_edges: dict[tuple[str, str, str], list[str]] = {}  # (cluster, u, v) -> lanes
        self.lane_order: dict[str, int] = {}  # lane -> the graph position it is sorted by
        self.cluster_order: dict[str, int] = {}

    def _chain(self, cluster: str) -> list[str]:
        """The drawn clusters from the top ("") down to ``cluster``."""
        chain = [cluster]
        while chain[-1]:
            chain.append(self.view.parent(chain[-1]))
        return chain[::-1]

    def order(self, item: str) -> int:
        """The graph position an item is sorted by: a cluster's is its first box's."""
        if item.startswith(CLUSTER):
            if item not in self.cluster_order:
                children = self.children[item[len(CLUSTER) :]]
                self.cluster_order[item] = min(self.order(c) for c in children)
            return self.cluster_order[item]
        if item.startswith(LANE):
            return self.lane_order[item]
        return self.view.order.get(item, 0)

    def member(self, cluster: str, key: str) -> str | None:
        """The child item of ``cluster`` that contains box ``key``, or None."""
        chain = self.chains[key]
        if cluster not in chain:
            return None
        i = chain.index(cluster)
        return key if i == len(chain) - 1 else CLUSTER + chain[i + 1]

    def common(self, a: str, b: str) -> str:
        """The innermost cluster containing boxes ``a`` and ``b``."""
        common = ""
        for x, y in zip(self.chains[a], self.chains[b], strict=False):
            if x != y:
                break
            common = x
        return common

    def place(self, cluster: str) -> tuple[float, float]:
        """Lay out one cluster's children; return the cluster's content size."""
        items = sorted(self.children[cluster], key=self.order)
        for item in items:
            if item.startswith(CLUSTER):
                w, h = self.place(item[len(CLUSTER) :])
                self.sizes[item] = (w + 2 * CLUSTER_PAD, h + 2 * CLUSTER_PAD + CLUSTER_HEAD)
        graph, layer = self._layering(cluster, items)
        if cluster:
            self._add_ports(cluster, graph, layer)
        self._add_lanes(cluster, graph, layer)
        layers: list[list[str]] = [[] for _ in range(max(layer.values(), default=-1) + 1)]
        for node in sorted(graph, key=self.order):
            layers[layer[node]].append(node)
        layers = [row for row in layers if row]
        _order_layers(graph, layers)
        return self._coordinates(cluster, graph, layers)

    def _layering(self, cluster: str, items: list[str]) -> tuple[nx.DiGraph, dict[str, int]]:
        """The children's graph, made acyclic, and each child's layer."""
        import networkx as nx

        graph = nx.DiGraph()
        graph.add_nodes_from(items)
        for a, b in self.view.edges:
            u, v = self.member(cluster, a), self.member(cluster, b)
            if u is not None and v is not None and u != v:
                graph.add_edge(u, v)
        while not nx.is_directed_acyclic_graph(graph):  # modules that call each other in turn
            cycle = nx.find_cycle(graph)
            graph.remove_edge(*max(cycle, key=lambda e: self.order(e[0]) - self.order(e[1]))[:2])
        layer = {n: i for i, gen in enumerate(nx.topological_generations(graph)) for n in gen}
        for node in sorted(graph, key=lambda n: -layer[n]):  # sources next to their consumers
            if graph.in_degree(node) == 0 and graph.out_degree(node) > 0:
                layer[node] = min(layer[s] for s in graph.successors(node)) - 1
        return graph, layer

    def _add_ports(self, cluster: str, graph: nx.DiGraph, layer: dict[str, int]) -> None:
        """Lanes in the first (last) layer where edges from (to) outside the cluster enter
        (leave), so that they reach their box between the boxes above (below) it."""
        last = max(layer.values(), default=0)
        for a, b in self.view.edges:
            u, v = self.member(cluster, a), self.member(cluster, b)
            if u is None and v is not None and layer[v] > 0:
                graph.add_edge(port := f"{LANE}\0{v}\0in", v)
                self._lane(port, v, layer, 0)
            elif u is not None and v is None and layer[u] < last:
                graph.add_edge(u, port := f"{LANE}\0{u}\0out")
                self._lane(port, u, layer, last)

    def _add_lanes(self, cluster: str, graph: nx.DiGraph, layer: dict[str, int]) -> None:
        """Split every edge spanning several layers into a chain of lanes, one per layer."""
        import networkx as nx

        for u, v in list(graph.edges):
            if layer[v] - layer[u] > 1:
                lanes = [f"{LANE}\0{u}\0{v}\0{i}" for i in range(layer[u] + 1, layer[v])]
                for i, lane in enumerate(lanes, start=layer[u] + 1):
                    self._lane(lane, u, layer, i)
                graph.remove_edge(u, v)
                nx.add_path(graph, [u, *lanes, v])
                self.long_edges[(cluster, u, v)] = lanes

    def _lane(self, lane: str, near: str, layer: dict[str, int], index: int) -> None:
        """Register a lane (a narrow, empty item) in layer ``index``, sorted like ``near``."""
        layer[lane], self.sizes[lane] = index, (LANE_W, 0.0)
        self.lane_order[lane] = self.order(near)

    def _coordinates(
        self, cluster: str, graph: nx.DiGraph, layers: list[list[str]]
    ) -> tuple[float, float]:
        center: dict[str, float] = {}
        for row in layers:  # under the predecessors
            self._spread(row, [self._mean(graph.predecessors(n), center) for n in row], center)
        for row in layers[::-1]:  # sources: over their successors
            wanted = [
                center[n]
                if graph.in_degree(n)
                else self._mean(graph.successors(n), center, center[n])
                for n in row
            ]
            self._spread(row, wanted, center)
        left = min((center[n] - self.sizes[n][0] / 2 for row in layers for n in row), default=0.0)
        y, width = 0.0, 0.0
        for row in layers:
            height = max(self.sizes[n][1] for n in row)
            for n in row:
                w, h = self.sizes[n]
                if n.startswith(LANE):
                    self.lanes.setdefault(cluster, {})[n] = (center[n] - left, y, y + height)
                else:
                    self.relative[n] = (center[n] - w / 2 - left, y + (height - h) / 2)
                width = max(width, center[n] + w / 2 - left)
            y += height + RANK_GAP
        return width, max(y - RANK_GAP, 0.0)

    @staticmethod
    def _mean(
        nodes: object, center: dict[str, float], default: float | None = None
    ) -> float | None:
        known = [center[m] for m in nodes if m in center]
        return sum(known) / len(known) if known else default

    def _spread(self, row: list[str], wanted: list[float | None], center: dict[str, float]) -> None:
        """Centres as close to ``wanted`` as the order and the gaps allow."""
        x = 0.0
        placed: list[float] = []
        for n, want in zip(row, wanted, strict=True):
            w = self.sizes[n][0]
            lowest = x + w / 2
            placed.append(max(lowest, want) if want is not None else lowest)
            x = placed[-1] + w / 2 + NODE_GAP
        known = [(p, want) for p, want in zip(placed, wanted, strict=True) if want is not None]
        shift = sum(want - p for p, want in known) / len(known) if known else 0.0
        for n, p in zip(row, placed, strict=True):
            center[n] = p + shift

    def absolute(
        self, cluster: str, x: float, y: float, out: Layout, lanes: dict[str, Lane]
    ) -> None:
        """Fill ``out`` (and ``lanes``) with absolute positions, the cluster at (x, y)."""
        for lane, (lx, top, bottom) in self.lanes.get(cluster, {}).items():
            lanes[lane] = (lx + x, top + y, bottom + y)
        for item in self.children[cluster]:
            dx, dy = self.relative[item]
            w, h = self.sizes[item]
            if item.startswith(CLUSTER):
                path = item[len(CLUSTER) :]
                out.clusters[path] = Rect(x + dx, y + dy, w, h)
                self.absolute(
                    path, x + dx + CLUSTER_PAD, y + dy + CLUSTER_PAD + CLUSTER_HEAD, out, lanes
                )
            else:
                out.boxes[item] = Rect(x + dx, y + dy, w, h)

    def route(self, a: str, b: str, lanes: dict[str, Lane]) -> list[Lane]:
        """The lanes box edge a -> b passes, top to bottom: out of a's clusters through their
        exit ports, across the innermost common cluster, into b's through entry ports."""
        common = self.common(a, b)
        names: list[str] = []
        for cluster in reversed(self.chains[a][self.chains[a].index(common) + 1 :]):
            u = self.member(cluster, a)
            port = f"{LANE}\0{u}\0out"
            if port in lanes:
                names += [*self.long_edges.get((cluster, u, port), []), port]
        u, v = self.member(common, a), self.member(common, b)
        names += self.long_edges.get((common, u, v), [])
        for cluster in self.chains[b][self.chains[b].index(common) + 1 :]:
            v = self.member(cluster, b)
            port = f"{LANE}\0{v}\0in"
            if port in lanes:
                names += [port, *self.long_edges.get((cluster, port, v), [])]
        return [lanes[name] for name in names]


def _order_layers(graph: nx.DiGraph, layers: list[list[str]], sweeps: int = 2) -> None:
    """Reorder each layer by the barycentre of its neighbours in the previous layer."""
    for _ in range(sweeps):
        for rows, neighbours in ((layers, graph.predecessors), (layers[::-1], graph.successors)):
            position: dict[str, float] = {}
            for row in rows:
                keys = []
                for i, n in enumerate(row):
                    near = [position[m] for m in neighbours(n) if m in position]
                    keys.append(sum(near) / len(near) if near else i / len(row))
                row[:] = [n for _, _, n in sorted(zip(keys, range(len(row)), row, strict=True))]
                position.update({n: i / len(row) for i, n in enumerate(row)})


def layout(view: View, top: float = 0.0) -> Layout:
    """Place every box and cluster of ``view``; the drawing starts ``top`` pixels down."""
    compound = _Compound(view)
    width, height = compound.place("")
    out = Layout(width=width, height=height + top)
    lanes: dict[str, Lane] = {}
    compound.absolute("", 0.0, top, out, lanes)
    for a, b in view.edges:
        route = compound.route(a, b, lanes)
        if route:
            out.routes[(a, b)] = route
    return out


__all__ = ["Layout", "Rect", "box_size", "layout"]
