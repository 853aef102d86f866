"""One rule for sharing a cast: when may several reads of a value read one cast of it?

Three passes make one cast serve several readers: ``simplify_casts`` (one ``x.to(d)`` for
the Q, K and V projections), ``fp8_linears`` (one float8 quantization of a value for every
fp8 linear reading it) and ``hoist_parameter_casts`` (a parameter cast once before the
graph, for every micro-batch). They all ask :class:`CastSharing`, which says:

    A cast of ``value`` made at point A may stand in for the cast a reader at point B
    would make iff, between A and B,

    1. nothing writes ``value``'s storage: no in-place op, ``out=`` argument or other
       write (as the op's schema says, :mod:`passes.schema`) into ``value``, into a view
       of it, or into anything ``value`` is a view of; two graph attributes holding one
       storage (tied weights) are one storage;
    2. the grad mode is the same at A and at B (``torch.no_grad()`` blocks, flattened by
       ``inline_regions`` into ``torch._C._set_grad_enabled`` calls). A cast made under
       ``no_grad`` has no autograd history: a reader that needs gradients would lose them.
       The converse (a cast made with gradients, read inside ``no_grad``) would be sound,
       but one rule that reads the same both ways is easier to trust; it costs a cast
       only where a value is read both inside and outside such a block.

Each read gets a :data:`ShareKey` (the value, its storage's write count so far, the grad
mode); reads with equal keys may share one cast, reads with different keys may not.

Guarantee: a reader given a shared cast receives, bit for bit, the values of the cast it
would have made itself, recorded by autograd exactly when its own cast would have been
(the readers' gradients meet at the one cast and sum in its dtype, as they do at
torch.autocast's cached weight casts; for an activation's cast, ``shared_cast_gradients``,
under ``Policy.cast_gradients_per_consumer``, routes each reader's gradient to the source
on its own, as autocast's cast per reader does).

Not seen: writes the graph does not show (a hook, a custom op without a schema that
says so), and graph inputs that alias each other (``torch.export`` assumes they do not).
"""

from __future__ import annotations

import operator
from collections.abc import Hashable
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from .meta import Marker
from .schema import StorageVersions

ShareKey = tuple[fx.Node, int, Hashable]
"""(value, how often its storage has been written so far, grad mode): see the module."""


# A grad mode known only by name (meta.Marker, equal to itself alone): the one the graph is
# called in, or one the walk cannot read.
ENTRY: Hashable = Marker("ENTRY")
"""The grad mode the graph is called in (a cast made before the graph runs is made in it)."""

_SET_GRAD = torch._C._set_grad_enabled
_READ_GRAD = torch.is_grad_enabled
# Calls that change the grad mode in a way we do not follow: nothing is shared across them.
_OPAQUE_GRAD = tuple(
    f
    for f in (
        getattr(torch.autograd.grad_mode, "_enter_inference_mode", None),
        getattr(torch.autograd.grad_mode, "_exit_inference_mode", None),
    )
    if f is not None
)


def _storage_id(tensor: torch.Tensor) -> Hashable:
    """One id per storage a graph attribute holds; the tensor itself where torch cannot say
    (a storage without data, a tensor subclass without storage)."""
    if isinstance(tensor, FakeTensor):  # no data (a meta model planned on fake tensors)
        return ("tensor", id(tensor))
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        pointer = 0
    return ("storage", pointer) if pointer else ("tensor", id(tensor))


class CastSharing:
    """Walks a graph in order and gives each read its :data:`ShareKey`.

    Ask :meth:`key` for a reader's inputs before :meth:`visit` of that reader; visit every
    node of the graph in order (nodes a pass inserts need not be visited unless they write
    into or view something read later).
    """

    def __init__(self, gm: fx.GraphModule) -> None:
        self._gm = gm
        self._versions = StorageVersions()
        self._mode: Hashable = ENTRY
        self._read_modes: dict[fx.Node, Hashable] = {}  # torch.is_grad_enabled() nodes
        self._attrs: dict[Hashable, fx.Node] = {}  # storage id -> first get_attr of it

    def key(self, value: fx.Node) -> ShareKey:
        """The key of a read of ``value`` at the current point of the walk."""
        return (value, self._versions.version(value), self._mode)

    def root(self, value: fx.Node) -> fx.Node:
        """The node whose storage ``value`` holds: itself, what it views, a tied attribute."""
        return self._versions.root(value)

    def visit(self, node: fx.Node) -> None:
        """Step past ``node``: record what it views, writes, and does to the grad mode."""
        if node.op == "get_attr":
            self._alias_attribute(node)
        self._versions.visit(node)
        if node.op == "call_function":
            self._follow_grad_mode(node)

    def _alias_attribute(self, node: fx.Node) -> None:
        """Tied weights: a second ``get_attr`` of one storage shares the first one's root."""
        try:
            value = operator.attrgetter(node.target)(self._gm)
        except AttributeError:
            return
        if isinstance(value, torch.Tensor):
            first = self._attrs.setdefault(_storage_id(value), node)
            if first is not node:
                self._versions.alias(node, first)

    def _follow_grad_mode(self, node: fx.Node) -> None:
        if node.target is _READ_GRAD:
            self._read_modes[node] = self._mode
        elif node.target is _SET_GRAD:
            self._mode = self._mode_set_by(node.args[0] if node.args else None)
        elif node.target in _OPAQUE_GRAD:
            self._mode = Marker(f"after {node.name}")  # equal to no other mode

    def _mode_set_by(self, flag: Any) -> Hashable:
        """``_set_grad_enabled(True/False)``, or the mode an ``is_grad_enabled()`` read
        (how ``inline_regions`` restores the mode at the end of a block)."""
        if isinstance(flag, bool):
            return flag
        if isinstance(flag, fx.Node) and flag in self._read_modes:
            return self._read_modes[flag]
        return Marker(f"set by {flag}")  # unknown: equal to no other mode


def written_values(gm: fx.GraphModule) -> set[fx.Node]:
    """The values whose storage ``gm`` writes somewhere (directly, through a view, or
    through another attribute of the same storage)."""
    sharing = CastSharing(gm)
    for node in gm.graph.nodes:
        sharing.visit(node)
    return {node for node in gm.graph.nodes if sharing.key(node)[1]}


def key_before_graph(value: fx.Node, written: set[fx.Node]) -> ShareKey | None:
    """The key of a cast of ``value`` made once before a graph that runs several times (the
    micro-batches of a step): as if read at the graph's start, in the mode it is called in.
    None when the graph writes ``value``'s storage (``written``, from
    :func:`written_values`): every run after the first would read a stale cast."""
    return None if value in written else (value, 0, ENTRY)


__all__ = ["ENTRY", "CastSharing", "ShareKey", "key_before_graph", "written_values"]
