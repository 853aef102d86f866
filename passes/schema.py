"""What an aten op does to its arguments, read from its schema (never from a list of names).

``OpOverload._schema`` says which arguments an op writes (``Tensor(a!) self``: in-place ops,
``out=`` variants, ``embedding_renorm_``), which outputs alias an input (``Tensor(a) self ->
Tensor(a)``: views, ``split``, ``to`` when nothing changes) and whether it returns tensors
at all (``sym_size``, ``_assert_scalar``). The passes use these facts to keep casts off
anything that is written in place or viewed, and to know when a cast goes stale.

The other calls of a captured graph (``operator.getitem``, SymInt arithmetic,
``torch._C._set_grad_enabled``, the ``x.to(dtype)`` casts insert_casts adds) write nothing;
their output is taken to alias their first input, which only ever makes a cast go stale
sooner, never later.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.fx as fx


def overload(node: fx.Node) -> torch._ops.OpOverload | None:
    """The node's aten (or other registered) op overload, if it calls one."""
    target = node.target
    is_op = node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
    return target if is_op else None


@functools.lru_cache(maxsize=4096)
def _written_positions(op: torch._ops.OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument the op writes into."""
    return tuple(
        (i, arg.name)
        for i, arg in enumerate(op._schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    )


@functools.lru_cache(maxsize=4096)
def _aliased_positions(op: torch._ops.OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument some output of the op may alias: the input of a
    view, or the argument an in-place op writes and returns."""
    out_sets: set[str] = set()
    for ret in op._schema.returns:
        if ret.alias_info is not None:
            out_sets |= set(ret.alias_info.before_set)
    return tuple(
        (i, arg.name)
        for i, arg in enumerate(op._schema.arguments)
        if arg.alias_info is not None and set(arg.alias_info.before_set) & out_sets
    )


@functools.lru_cache(maxsize=4096)
def returns_tensor(op: torch._ops.OpOverload) -> bool:
    """Whether any output of the op is a tensor (or a list of them)."""
    for ret in op._schema.returns:
        kind = ret.type
        if isinstance(kind, torch._C.OptionalType):
            kind = kind.getElementType()
        if isinstance(kind, torch._C.ListType):
            kind = kind.getElementType()
        if isinstance(kind, torch._C.TensorType):
            return True
    return False


def _argument(node: fx.Node, position: int, name: str) -> Any:
    if position < len(node.args):
        return node.args[position]
    return node.kwargs.get(name)


def _nodes_in(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, lambda n: found.append(n) or n)
    return found


def _nodes_at(node: fx.Node, positions: tuple[tuple[int, str], ...]) -> list[fx.Node]:
    """The graph values passed at these schema positions (an argument may be a list)."""
    return [
        value
        for position, name in positions
        for value in _nodes_in(_argument(node, position, name))
    ]


def is_mutating(node: fx.Node) -> bool:
    """The node is an aten op that writes into one of its arguments."""
    op = overload(node)
    return op is not None and bool(_written_positions(op))


def written_inputs(node: fx.Node) -> list[fx.Node]:
    """The graph values the node writes into."""
    op = overload(node)
    return _nodes_at(node, _written_positions(op)) if op is not None else []


def viewed_inputs(node: fx.Node) -> list[fx.Node]:
    """The graph values the node's output may be a view of (shares storage with)."""
    op = overload(node)
    if op is not None:
        return _nodes_at(node, _aliased_positions(op))
    if node.op in ("call_function", "call_method", "call_module"):
        # Not an aten op: torch does not say, so assume the output may alias the first
        # tensor argument (views, indexing, getitem). Over-approximating aliases only ever
        # makes a cast go stale sooner, never later.
        first = next(iter(node.all_input_nodes), None)
        return [first] if first is not None else []
    return []


class StorageVersions:
    """Which values share storage, and how often each storage has been written so far.

    Feed it the nodes in graph order (:meth:`visit`); a cast of ``value`` taken when
    ``version(value)`` was ``v`` still holds while ``version(value) == v``.
    """

    def __init__(self) -> None:
        self._root: dict[fx.Node, fx.Node] = {}
        self._writes: dict[fx.Node, int] = {}

    def root(self, node: fx.Node) -> fx.Node:
        return self._root.get(node, node)

    def version(self, node: fx.Node) -> int:
        return self._writes.get(self.root(node), 0)

    def alias(self, node: fx.Node, other: fx.Node) -> None:
        """``node`` holds ``other``'s storage (two graph attributes of one tensor): a write
        into either is a write into both. Call it before :meth:`visit` of ``node``."""
        self._root[node] = self.root(other)

    def visit(self, node: fx.Node) -> None:
        if node not in self._root:  # else alias() named its storage
            viewed = viewed_inputs(node)
            self._root[node] = self.root(viewed[0]) if viewed else node
        for value in written_inputs(node):
            root = self.root(value)
            self._writes[root] = self._writes.get(root, 0) + 1


def written_storage(graph: fx.Graph) -> set[fx.Node]:
    """The storage roots (graph inputs, parameters, op outputs) written anywhere in ``graph``."""
    versions = StorageVersions()
    for node in graph.nodes:
        versions.visit(node)
    return {root for root, count in versions._writes.items() if count}


def is_view(node: fx.Node) -> bool:
    """An aten op whose output aliases an input without writing it (``view``, ``split``)."""
    op = overload(node)
    return op is not None and bool(_aliased_positions(op)) and not _written_positions(op)


__all__ = [
    "StorageVersions",
    "is_mutating",
    "is_view",
    "overload",
    "returns_tensor",
    "viewed_inputs",
    "written_inputs",
    "written_storage",
]
