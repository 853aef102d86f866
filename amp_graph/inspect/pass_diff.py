"""``diff``: what the passes added, removed and changed between two graphs.

Nodes are matched by name (the passes keep the names of the nodes they rewrite). A node
is *added* or *removed* when only one graph has it, and *changed* when its dtype (what it
computes in, else what it returns), its op or its inputs differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from pathlib import Path

import torch.fx as fx

from amp_graph.frontends.compiler import unwrap
from amp_graph.passes.meta import (
    Role,
    inputs_behind_reads,
    is_cast_read,
    short,
    users_through_reads,
)
from amp_graph.policy import op_key_name

from .drawing import SVG, finish, title_of
from .modules import module_types, node_modules
from .stages import annotate, before_passes, is_annotated
from .style import STATUS_COLORS, STATUS_MARK
from .table_format import badge, html_table, text_table
from .view import Item, build_view, items_of

CHANGES = ("added", "removed", "changed")


@dataclass
class DiffRow:
    """One added, removed or changed node."""

    change: str  # "added", "removed" or "changed"
    node: str
    op: str
    module: str
    before: str  # dtype before ("-" when the node is new)
    after: str  # dtype after ("-" when the node is gone)
    detail: str


@dataclass
class Diff:
    """The changes, in graph order. ``print`` it, view it in Jupyter, or :meth:`draw` it."""

    before: str  # titles of the two graphs
    after: str
    rows: list[DiffRow]
    unchanged: int
    items: list[Item] = field(default_factory=list, repr=False)  # for the drawing
    types: dict[str, str] = field(default_factory=dict, repr=False)

    def count(self, change: str) -> int:
        """How many rows are ``"added"``, ``"removed"`` or ``"changed"``."""
        return sum(row.change == change for row in self.rows)

    def summary(self) -> str:
        counts = ", ".join(f"{self.count(c)} {c}" for c in CHANGES)
        return f"{self.before} -> {self.after}: {counts}, {self.unchanged} unchanged"

    def __repr__(self) -> str:
        return f"<Diff {self.summary()}>"

    def __str__(self) -> str:
        headers = ("", "node", "op", "module", "before", "after", "detail")
        rows = [
            (STATUS_MARK[r.change], r.node, r.op, r.module or "-", r.before, r.after, r.detail)
            for r in self.rows
        ]
        return text_table(headers, rows) + "\n\n" + self.summary()

    def _repr_html_(self) -> str:
        headers = ("", "node", "op", "module", "before", "after", "detail")
        rows = [
            (r.change, r.node, r.op, r.module or "-", r.before, r.after, r.detail)
            for r in self.rows
        ]

        def render(column: int, value: object) -> str:
            text = str(value)
            if column == 0:
                return (
                    f'<b style="color:{STATUS_COLORS[text]}">{STATUS_MARK[text]}</b> {escape(text)}'
                )
            return badge(text, text) if column in (4, 5) else escape(text)

        return (
            f"<div><b>{escape(self.summary())}</b>" + html_table(headers, rows, render) + "</div>"
        )

    def draw(
        self,
        *,
        collapse_modules: bool | int = False,
        focus: str | None = None,
        max_nodes: int | None = None,
        path: str | Path | None = None,
        renderer: str = "auto",
    ) -> SVG:
        """The after graph with added nodes outlined green, changed ones purple, and removed
        ones as dashed grey boxes where they were; options as :func:`amp_graph.inspect.draw`."""
        notes = (
            f"+{self.count('added')} added, -{self.count('removed')} removed, "
            f"~{self.count('changed')} changed"
        )
        view = build_view(
            self.items,
            title=f"{self.after} vs {self.before}: {notes}",
            types=self.types,
            collapse=collapse_modules,
            focus=focus,
            max_nodes=max_nodes,
        )
        return finish(view, renderer, path)


def _dtype(node: fx.Node) -> str:
    amp = node.meta["amp"]
    if amp.role is Role.OP and amp.compute_dtype is not None:
        return short(amp.compute_dtype)
    return short(amp.out_dtype)


def _target(node: fx.Node) -> str:
    return f"{node.op}:{getattr(node.target, '__name__', node.target)}"


def _removed_detail(node: fx.Node, after: dict[str, fx.Node]) -> str:
    amp = node.meta["amp"]
    if amp.role is not Role.CAST:
        return "not in the new graph" + (
            " (a parameter read twice, e.g. tied weights)" if amp.role is Role.PARAM else ""
        )
    source, target = node.args[0], node.args[1]
    twin = next(
        (
            n
            for n in after.values()
            if n.meta["amp"].role is Role.CAST
            and n.args[0].name == source.name
            and n.args[1] == target
        ),
        None,
    )
    if twin is not None:
        feeds = ", ".join(twin.meta["amp"].cast_for)
        return f"the same cast as '{twin.name}', which now feeds {feeds}"
    if source.meta["amp"].out_dtype == target:
        return f"a no-op: '{source.name}' is already {short(target)}"
    if any(u.meta["amp"].role is Role.CAST for u in node.users):
        return "folded into the cast that follows it (lossless chain)"
    consumers = [after[u.name] for u in users_through_reads(node) if u.name in after]
    if not consumers:
        return "not in the new graph, nor are its consumers"
    now = ", ".join(f"'{c.name}' now computes in {_dtype(c)}" for c in consumers)
    return f"no longer needed: {now}"


def _changed_detail(old: fx.Node, new: fx.Node) -> str:
    amp = new.meta["amp"]
    parts = []
    if _dtype(old) != _dtype(new):
        if amp.role is Role.OP and amp.rule is not None:
            parts.append(f"{amp.rule}: {amp.detail}")
        else:
            parts.append(amp.detail or "follows its inputs")
    if _target(old) != _target(new):
        callee = op_key_name(new.target) if callable(new.target) else str(new.target)
        parts.append(
            f"the module call became {callee}(...) with its parameters as graph values, "
            "so that they can be cast"
            if old.op == "call_module"
            else f"now {callee}"
        )
    old_inputs = [a.name for a in inputs_behind_reads(old)]
    new_inputs = [a.name for a in inputs_behind_reads(new)]
    if old_inputs != new_inputs:
        fresh = [name for name in new_inputs if name not in old_inputs]
        if fresh:
            parts.append("reads " + ", ".join(fresh))
    if amp.cast_absorbed and not old.meta["amp"].cast_absorbed:
        parts.append(f"widens its input itself (dtype={short(amp.compute_dtype)})")
    return "; ".join(parts)


def diff(before: fx.GraphModule, after: fx.GraphModule | None = None) -> Diff:
    """What changed from ``before`` to ``after``.

    With one argument, ``before`` is the compiled module and it is compared with the graph
    it was captured as (:func:`amp_graph.inspect.before_passes`). Graphs without amp_graph's
    annotations (e.g. ``CompileRecord.original``) are read as written.

    >>> import torch, amp_graph
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    >>> d = amp_graph.inspect.diff(amp_graph.compile(m, example_inputs=(torch.randn(2, 4),)))
    >>> d.count("added"), [r.node for r in d.rows if r.change == "changed"]
    (3, ['linear', 'output'])
    """
    before, after = unwrap(before), unwrap(after)
    if after is None:
        before, after = before_passes(before), before
    old_gm = before if is_annotated(before) else annotate(before)
    new_gm = after if is_annotated(after) else annotate(after)
    # a shared cast's reads are its consumers' gradient routes, not a change of the plan
    old = {n.name: n for n in old_gm.graph.nodes if not is_cast_read(n)}
    new = {n.name: n for n in new_gm.graph.nodes if not is_cast_read(n)}
    index = {name: i for i, name in enumerate(new)}
    anchor, position = {}, -1  # removed nodes are listed after the last node both graphs have
    for name in old:
        position = index.get(name, position)
        anchor[name] = position
    modules = {**node_modules(old_gm), **node_modules(new_gm)}
    keyed = [
        ((i, 0), _row(old.get(name), node, new, modules[name]))
        for i, (name, node) in enumerate(new.items())
    ]
    keyed += [
        ((anchor[name], 1), _row(node, None, new, modules[name]))
        for name, node in old.items()
        if name not in new
    ]
    rows = [row for _, row in sorted(keyed, key=lambda pair: pair[0]) if row is not None]
    unchanged = len(new) - sum(row.change != "removed" for row in rows)
    return Diff(
        title_of(before),
        title_of(after),
        rows,
        unchanged,
        _items(old_gm, new_gm, rows, anchor),
        module_types(new_gm),
    )


def _row(
    old: fx.Node | None, new: fx.Node | None, after: dict[str, fx.Node], module: str
) -> DiffRow | None:
    """The row of one node present in the old graph, the new one, or both (None: unchanged)."""
    node = new if new is not None else old
    amp = node.meta["amp"]

    def row(change: str, before: str, now: str, detail: str) -> DiffRow:
        return DiffRow(change, node.name, amp.op or node.op, module, before, now, detail)

    if old is None:
        return row("added", "-", _dtype(new), amp.detail)
    if new is None:
        return row("removed", _dtype(old), "-", _removed_detail(old, after))
    detail = _changed_detail(old, new)  # empty when nothing changed
    return row("changed", _dtype(old), _dtype(new), detail) if detail else None


def _items(
    old_gm: fx.GraphModule, new_gm: fx.GraphModule, rows: list[DiffRow], anchor: dict[str, int]
) -> list[Item]:
    """The after graph's items with their status, plus the removed ones where they were."""
    status = {row.node: row for row in rows}
    new_items = items_of(new_gm)
    for item in new_items:
        if item.name in status:
            row = status[item.name]
            item.status = row.change
            if row.change == "changed" and row.before != row.after:
                item.note = f"{row.before} \u2192 {row.after}"
    old_items = items_of(old_gm)
    names = {item.name for item in new_items}
    removed = [item for item in old_items if item.name not in names]
    former_users: dict[str, set[str]] = {}
    for item in old_items:
        for name in item.inputs:
            former_users.setdefault(name, set()).add(item.name)
    for item in removed:
        item.status = "removed"
        for user in new_items:  # keep the removed node's old edges to its users
            if user.name in former_users.get(item.name, ()):
                user.inputs = (*user.inputs, item.name)
    merged = [r for r in removed if anchor[r.name] == -1]
    for index, item in enumerate(new_items):
        merged.append(item)
        merged.extend(r for r in removed if anchor[r.name] == index)
    return merged


__all__ = ["Diff", "DiffRow", "diff"]
