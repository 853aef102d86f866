"""What an aten op does to its arguments, read from its schema (never from a list of names).

``OpOverload._schema`` says which arguments an op writes (``Tensor(a!) self``: in-place ops,
``out=`` variants, ``embedding_renorm_``), which outputs alias an input (``Tensor(a) self ->
Tensor(a)``: views, ``split``, ``to`` when nothing changes) and whether it returns tensors
at all (``sym_size``, ``_assert_scalar``). The passes use these facts to keep casts off
anything that is written in place or viewed, and to know when a cast goes stale.

For graph nodes that are not aten ops (symbolic traces, dynamo graphs), in-place calls are
recognised by torch's own naming convention and ``inplace=True``/``out=`` arguments, and
views by their dtype rule (``dtype_rules.FIRST_ARG``): the facts torch exposes there.
"""

from __future__ import annotations

import functools
import inspect
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F


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
    """The node writes into one of its arguments (aten schema, else torch's conventions)."""
    op = overload(node)
    if op is not None:
        return bool(_written_positions(op))
    return _conventionally_inplace(node)


def written_inputs(node: fx.Node) -> list[fx.Node]:
    """The graph values the node writes into."""
    op = overload(node)
    if op is not None:
        return _nodes_at(node, _written_positions(op))
    if not _conventionally_inplace(node):
        return []
    out = node.kwargs.get("out")
    if out is not None:
        return _nodes_in(out)
    if node.target is F.embedding:  # max_norm: the weight's rows are renormalized
        weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        return [weight] if isinstance(weight, fx.Node) else []
    first = node.args[0] if node.args else None
    return [first] if isinstance(first, fx.Node) else []


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


_INPLACE_OPERATORS = frozenset(
    {
        operator.iadd,
        operator.isub,
        operator.imul,
        operator.itruediv,
        operator.ifloordiv,
        operator.imatmul,
        operator.ipow,
        operator.imod,
        operator.iand,
        operator.ior,
        operator.ixor,
        operator.ilshift,
        operator.irshift,
        operator.setitem,
    }
)


@functools.lru_cache(maxsize=1024)
def _inplace_position(function: Any) -> int | None:
    """Where a Python function takes ``inplace`` positionally (``F.relu(x, True)``)."""
    try:
        names = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("inplace") if "inplace" in names else None


def _writes_by_argument(node: fx.Node) -> bool:
    """``inplace=True`` by keyword or position, ``out=``, or ``F.embedding(max_norm=...)``,
    which renormalizes the rows it reads in place."""
    if node.kwargs.get("inplace") is True or node.kwargs.get("out") is not None:
        return True
    target = node.target
    if node.op == "call_function" and callable(target):
        position = _inplace_position(target)
        if position is not None and len(node.args) > position and node.args[position] is True:
            return True
        if target is F.embedding:
            max_norm = node.kwargs.get("max_norm", node.args[2] if len(node.args) > 2 else None)
            return max_norm is not None
    return False


def _conventionally_inplace(node: fx.Node) -> bool:
    """Python-level calls: ``x.add_()``, ``x += y``, ``x[i] = y``, ``inplace=True``, ``out=``."""
    if node.op not in ("call_function", "call_method"):
        return False
    target = node.target
    if target in _INPLACE_OPERATORS or _writes_by_argument(node):
        return True
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if name.startswith("__i") and name.endswith("__"):
        return True
    return bool(name) and name.endswith("_") and not name.endswith("__")


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
