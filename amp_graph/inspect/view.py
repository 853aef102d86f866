"""What a drawing shows: boxes, edges and module clusters, before any layout.

:func:`build_view` turns annotated graph nodes (:class:`Item`) into a :class:`View`:

* each node becomes a :class:`Box` labelled with its name, op, shape and dtype, and
  classed by dtype (:mod:`amp_graph.inspect.style`);
* nodes are grouped into clusters by the module that ran them; a cluster holding a
  single box is dissolved into its parent, so that only real groups are boxed;
* ``collapse`` folds every module ``collapse`` levels deep into one box that counts its ops
  per dtype and its casts; a cast that crosses the module's boundary stays visible;
* ``focus``/``max_nodes`` keep a region, and its direct neighbours are drawn as dashed
  "ghost" boxes so that the region's inputs and outputs stay visible.

Both renderers (graphviz and the networkx fallback) draw the same View.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from amp_graph.passes.meta import (
    AMP,
    VAL,
    AmpInfo,
    Role,
    inputs_behind_reads,
    is_cast_read,
    short,
    tensor_facts,
)
from amp_graph.policy import Rule, nearest

from .modules import node_modules
from .style import DTYPE_CLASSES, STATUS_MARK, node_class

DEFAULT_FOCUS_NODES = 25
"""How many nodes ``focus=<node name>`` draws when ``max_nodes`` is not given."""

OP_ROLES = (Role.OP, Role.USER_CAST, Role.INPLACE)
"""The roles counted as ops (the model's computations, its own casts included)."""


@dataclass
class Item:
    """One graph node as the drawing needs it (the nodes of two graphs, for a diff)."""

    name: str
    amp: AmpInfo
    val: Any
    inputs: tuple[str, ...]
    module: str = ""  # the module path it is filed under (modules.node_modules)
    cast_to: str = ""  # casts: the target dtype ("bf16")
    status: str = ""  # diff: "added", "removed", "changed", or ""
    note: str = ""  # diff: what changed, e.g. "fp32 -> bf16"


@dataclass
class Box:
    """A drawn node: a graph node, a collapsed module, or a ghost (a neighbour not drawn)."""

    key: str
    title: str
    lines: list[str]
    kind: str  # "input", "param", "op", "cast", "output", "other", "module" or "ghost"
    dtype: str  # one of style.DTYPE_CLASSES
    cluster: str = ""  # the module path of the cluster drawn around it; "" for none
    status: str = ""
    tooltip: str = ""

    @property
    def css_class(self) -> str:
        """SVG class: ``"cast bf16"``, ``"op fp32 changed"``... (drawings are parsed by it)."""
        return " ".join(c for c in (self.kind, self.dtype, self.status) if c)


@dataclass
class View:
    """Boxes, edges between box keys, and the labels of the clusters to draw."""

    title: str
    boxes: dict[str, Box]
    edges: list[tuple[str, str]]
    clusters: dict[str, str] = field(default_factory=dict)  # path -> label
    notes: list[str] = field(default_factory=list)
    order: dict[str, int] = field(default_factory=dict)  # box key -> first graph position

    def parent(self, path: str) -> str:
        """The innermost drawn cluster strictly containing cluster ``path`` ("" if none)."""
        while "." in path:
            path = path.rsplit(".", 1)[0]
            if path in self.clusters:
                return path
        return ""


def items_of(gm: fx.GraphModule) -> list[Item]:
    """The nodes of an annotated graph, in graph order."""

    def cast_to(node: fx.Node) -> str:
        is_cast = node.meta[AMP].role is Role.CAST and len(node.args) > 1
        return short(node.args[1]) if is_cast else ""

    modules = node_modules(gm)
    return [
        Item(
            n.name,
            n.meta[AMP],
            n.meta.get(VAL),
            tuple(a.name for a in inputs_behind_reads(n)),
            modules[n.name],
            cast_to(n),
        )
        for n in gm.graph.nodes
        if not is_cast_read(n)  # a shared cast's read: drawn as the cast's edge
    ]


def shape_text(val: Any) -> str:
    """``[2, 8, 32]`` for a tensor, ``([2, 8], [2])`` for a tuple of them, else ``""``."""
    if isinstance(val, torch.Tensor):
        return "[" + ", ".join(str(s) for s in val.shape) + "]"
    if isinstance(val, (tuple, list)):
        parts = [shape_text(v) for v in val if isinstance(v, torch.Tensor)]
        text = "(" + ", ".join(parts) + ")" if parts else ""
        return text if len(text) <= 40 else text[:37] + "...)"
    return ""


def value_numel(node: fx.Node) -> int | None:
    """Elements of the node's value (a cast's value, and a consumer's ``cast_read`` of it,
    is shaped like its input); None when unknown or symbolic."""
    while (
        (node.meta[AMP].role is Role.CAST or is_cast_read(node))
        and VAL not in node.meta
        and node.all_input_nodes
    ):
        node = node.all_input_nodes[0]
    val = node.meta.get(VAL)
    numel = val.numel() if isinstance(val, torch.Tensor) else None
    return numel if isinstance(numel, int) else None


def _inside(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def _select(
    items: list[Item], focus: str | None, max_nodes: int | None
) -> tuple[list[Item], list[str]]:
    """The items to draw, in graph order, and a note when some are left out."""
    if max_nodes is not None and max_nodes < 1:
        raise ValueError(f"max_nodes is a positive number of nodes; got {max_nodes}")
    by_name = {item.name: item for item in items}
    if focus is None:
        if max_nodes is None or max_nodes >= len(items):
            return items, []
        return items[:max_nodes], [f"the first {max_nodes} of {len(items)} nodes"]
    if focus in by_name:
        limit = max_nodes or DEFAULT_FOCUS_NODES
        neighbours: dict[str, set[str]] = {item.name: set() for item in items}
        for item in items:
            for name in item.inputs:
                if name in neighbours:
                    neighbours[item.name].add(name)
                    neighbours[name].add(item.name)
        order = {name: i for i, name in enumerate(by_name)}
        seen, queue = {focus}, deque([focus])
        while queue and len(seen) < limit:
            for other in sorted(neighbours[queue.popleft()], key=order.__getitem__):
                if len(seen) < limit and other not in seen:
                    seen.add(other)
                    queue.append(other)
        chosen = [item for item in items if item.name in seen]
        return chosen, [f"{len(chosen)} nodes nearest '{focus}' of {len(items)}"]
    chosen = [item for item in items if _inside(item.module, focus)]
    if not chosen:
        modules = sorted({item.module for item in items if item.module})
        raise KeyError(
            f"focus={focus!r} names no node and no module of this graph."
            f"{nearest(focus, [*by_name, *modules])} Give a node name (see amp_graph.report) "
            "or a module path (see model.named_modules())."
        )
    note = [f"module '{focus}': {len(chosen)} of {len(items)} nodes"]
    if max_nodes is not None and len(chosen) > max_nodes:
        chosen = chosen[:max_nodes]
        note = [f"module '{focus}': the first {max_nodes} of its nodes"]
    return chosen, note


def _is_bookkeeping(item: Item) -> bool:
    """Size arithmetic and other nodes that produce no tensor (``x.shape``, ``d // h``)."""
    return item.amp.role in (Role.OP, Role.OTHER) and not tensor_facts(item.amp.out_dtype)


def _fold(path: str, depth: int | None) -> str | None:
    """The collapsed module a node of module ``path`` folds into, or None."""
    if depth is None or not path:
        return None
    parts = path.split(".")
    return ".".join(parts[:depth]) if len(parts) >= depth else None


def _label(item: Item, by_name: dict[str, Item]) -> tuple[str, list[str], str]:
    """(kind, label lines below the title, tooltip) of one node."""
    amp = item.amp
    shape = shape_text(item.val)
    out = short(amp.out_dtype)
    dtype_line = " ".join(part for part in (shape, out if out != "-" else "") if part)
    if amp.role is Role.CAST:  # its shape is its input's
        source = by_name.get(item.inputs[0]) if item.inputs else None
        src = short(source.amp.out_dtype) if source else "?"
        shape = shape_text(source.val) if source else ""
        return "cast", [f"cast {src} \u2192 {item.cast_to or out}", shape], amp.detail
    if amp.role is Role.INPUT:
        return "input", ["input", dtype_line], amp.detail
    if amp.role is Role.PARAM:
        return "param", ["parameter", dtype_line], amp.detail
    if amp.role is Role.OUTPUT:
        return "output", ["output", out], "the graph's output"
    op = amp.op or "?"
    if amp.role is Role.OP and amp.rule in (Rule.ALLOW, Rule.DENY, Rule.PROMOTE):
        op = f"{op} \u00b7 {amp.rule}"
    elif amp.role is Role.USER_CAST:
        op = f"{op} \u00b7 model's cast"
    compute = amp.compute_dtype
    if compute is not None and short(compute) != out:
        dtype_line += f" (computes {short(compute)})"
    kind = "op" if amp.role in OP_ROLES else "other"
    return kind, [op, dtype_line], f"{amp.source}: {amp.detail}" if amp.source else amp.detail


def _node_box(item: Item, by_name: dict[str, Item], cluster: str) -> Box:
    kind, lines, tooltip = _label(item, by_name)
    title = item.name
    if item.status:
        title = f"{STATUS_MARK[item.status]} {title}"
        if item.note:
            lines.append(item.note)
    return Box(
        item.name,
        title,
        [line for line in lines if line],
        kind,
        node_class(item.amp),
        cluster,
        item.status,
        tooltip,
    )


def _ghost_box(item: Item) -> Box:
    return Box(
        item.name,
        item.name,
        ["not drawn"],
        "ghost",
        node_class(item.amp),
        tooltip="outside the drawn region",
    )


def _edges(
    items: list[Item], key_of: dict[str, str], boxes: dict[str, Box]
) -> list[tuple[str, str]]:
    """Edges between drawn boxes, once each; none inside a folded module or between ghosts."""
    edges: dict[tuple[str, str], None] = {}
    for item in items:
        for name in item.inputs:
            if name in key_of and item.name in key_of:
                a, b = key_of[name], key_of[item.name]
                if a != b and not (boxes[a].kind == "ghost" and boxes[b].kind == "ghost"):
                    edges[(a, b)] = None
    return list(edges)


def _module_box(path: str, members: list[Item], type_name: str, cluster: str) -> Box:
    ops = Counter(
        node_class(m.amp)
        for m in members
        if m.amp.role in OP_ROLES and tensor_facts(m.amp.out_dtype)
    )
    casts = sum(m.amp.role is Role.CAST for m in members)
    dominant = max(ops, key=lambda c: (ops[c], -DTYPE_CLASSES.index(c))) if ops else "other"
    per_dtype = " \u00b7 ".join(f"{ops[c]} {c}" for c in DTYPE_CLASSES if ops[c])
    lines = [type_name, f"{sum(ops.values())} ops: {per_dtype}" if ops else "no tensor ops"]
    if casts:
        lines.append(f"{casts} cast{'s' * (casts != 1)} inside")
    statuses = Counter(m.status for m in members if m.status)
    status = ""
    if statuses:
        lines.append(" ".join(f"{STATUS_MARK[s]}{n} {s}" for s, n in sorted(statuses.items())))
        status = "changed"
    tooltip = f"module {path}: {len(members)} nodes collapsed"
    return Box(f"module:{path}", path, lines, "module", dominant, cluster, status, tooltip)


def _prune_clusters(boxes: Iterable[Box], types: dict[str, str]) -> dict[str, str]:
    """Clusters holding at least two boxes or sub-clusters; boxes move to the nearest kept.

    Deepest first: a dissolved cluster hands its children to its parent, whose count is
    then final when its turn comes.
    """
    boxes = list(boxes)
    kept: set[str] = set()
    for box in boxes:
        parts = box.cluster.split(".") if box.cluster else []
        kept.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    children = Counter(box.cluster for box in boxes)
    children.update(path.rpartition(".")[0] for path in kept)
    for path in sorted(kept, key=lambda p: -p.count(".")):
        if children[path] < 2:
            kept.discard(path)
            children[path.rpartition(".")[0]] += children[path] - 1
    for box in boxes:
        box.cluster = _drawn_parent(box.cluster, kept)
    return {p: f"{p} \u00b7 {types[p]}" if p in types else p for p in sorted(kept)}


def _drawn_parent(path: str, kept: set[str]) -> str:
    """``path`` itself if kept, else its innermost kept ancestor, else ""."""
    while path and path not in kept:
        path = path.rpartition(".")[0]
    return path


def build_view(
    items: list[Item],
    *,
    title: str,
    types: dict[str, str],
    collapse: bool | int = False,
    focus: str | None = None,
    max_nodes: int | None = None,
    bookkeeping: bool = False,
) -> View:
    """The View of ``items`` (see the module docstring for the options)."""
    depth = _collapse_depth(collapse)
    hidden = set() if bookkeeping else {item.name for item in items if _is_bookkeeping(item)}
    items = [item for item in items if item.name not in hidden]
    by_name = {item.name: item for item in items}
    chosen, notes = _select(items, focus, max_nodes)
    if hidden:
        notes.append(f"{len(hidden)} non-tensor node{'s' * (len(hidden) != 1)} (sizes) not drawn")
    chosen_names = {item.name for item in chosen}
    users: dict[str, list[str]] = {item.name: [] for item in items}
    for item in items:
        for name in item.inputs:
            users.setdefault(name, []).append(item.name)

    def fold(item: Item) -> str | None:
        module = _fold(item.module, depth)
        if module is None or item.amp.role is not Role.CAST:
            return module
        consumers = [by_name[u] for u in users.get(item.name, []) if u in by_name]
        inside = all(_fold(c.module, depth) == module for c in consumers)
        return module if inside else None  # a cast crossing the module's boundary stays

    position = {item.name: i for i, item in enumerate(items)}
    key_of: dict[str, str] = {}
    boxes: dict[str, Box] = {}
    folded: dict[str, list[Item]] = {}
    for item in chosen:
        module = fold(item)
        if module is None:
            cluster = item.module
            if depth is not None and _fold(cluster, depth) is not None:  # a boundary cast
                cluster = _fold(cluster, depth).rpartition(".")[0]
            boxes[item.name] = _node_box(item, by_name, cluster)
            key_of[item.name] = item.name
        else:
            folded.setdefault(module, []).append(item)
            key_of[item.name] = f"module:{module}"
    for module, members in folded.items():
        box = _module_box(module, members, types.get(module, "module"), module.rpartition(".")[0])
        boxes[box.key] = box
    if len(chosen) < len(items):  # ghosts: the region's neighbours, drawn dashed
        for item in items:
            outside = item.name not in chosen_names
            if outside and chosen_names & {*item.inputs, *users.get(item.name, [])}:
                boxes[item.name] = _ghost_box(item)
                key_of[item.name] = item.name
    edges = _edges(items, key_of, boxes)
    clusters = _prune_clusters(boxes.values(), types)
    order: dict[str, int] = {}
    for name, key in key_of.items():
        order[key] = min(order.get(key, position[name]), position[name])
    boxes = dict(sorted(boxes.items(), key=lambda kv: order[kv[0]]))
    return View(title, boxes, edges, clusters, notes, order)


def _collapse_depth(collapse: bool | int) -> int | None:
    if collapse is False or collapse is None:
        return None
    if collapse is True:
        return 1
    if isinstance(collapse, int) and collapse >= 1:
        return collapse
    raise ValueError(
        f"collapse_modules is True (top-level modules), False, or a module depth >= 1 "
        f"(2 folds 'blocks.0'); got {collapse!r}"
    )


__all__ = ["Box", "Item", "View", "build_view", "items_of", "shape_text", "value_numel"]
