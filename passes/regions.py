"""inline_regions (run on a captured graph before the passes): the model's own
``torch.autocast`` and ``torch.no_grad`` regions, made flat and recorded on the nodes they
enclose.

``torch.export`` records a ``with torch.autocast(...)`` block of the model as a
``wrap_with_autocast`` higher-order op over a submodule, and a ``with torch.no_grad()``
block as ``wrap_with_set_grad_enabled``; tracing with ``make_fx`` (the backend) records the
same blocks as flat ``_enter_autocast`` / ``_exit_autocast`` markers. This pass turns all of
them into one representation the other passes can read:

* every node inside an autocast block gets ``meta["amp_graph.autocast_region"]``, an
  :class:`AutocastRegion` (device type, dtype, enabled) of the innermost block; the block
  itself disappears, so at run time no autocast state is entered: classify decides those
  nodes by torch.autocast's semantics (nothing is cast inside ``enabled=False``; a nested
  block computes in its own dtype) and the casts are explicit in the graph;
* a grad-mode block becomes its body between ``torch._C._set_grad_enabled(flag)`` and a
  call that restores the mode read on entry, so its semantics are kept exactly.

It also drops ``aten._assert_tensor_metadata`` nodes: they assert the dtypes seen at
capture, which the AMP passes change on purpose.

Reads: higher-order-op submodules and markers. Writes: ``meta["amp_graph.autocast_region"]``;
removes the region ops, their submodules and the dtype assertions. Guarantees: every other
node computes what it computed before, in the same order.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .meta import REGION
from .result import PassResult


@dataclass(frozen=True)
class AutocastRegion:
    """A ``torch.autocast`` block of the model's code: its device type, dtype and flag."""

    device_type: str
    dtype: torch.dtype
    enabled: bool

    def __str__(self) -> str:
        state = "enabled" if self.enabled else "enabled=False"
        return f"torch.autocast({self.device_type!r}, {self.dtype}, {state})"


def _hop(name: str) -> object | None:
    return getattr(torch.ops.higher_order, name, None)


_AUTOCAST_HOP = _hop("wrap_with_autocast")
_GRAD_HOP = _hop("wrap_with_set_grad_enabled")
_ENTER = getattr(torch.amp.autocast_mode, "_enter_autocast", None)
_EXIT = getattr(torch.amp.autocast_mode, "_exit_autocast", None)
_DTYPE_ASSERT = "aten::_assert_tensor_metadata"


def _is_dtype_assert(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target._schema.name == _DTYPE_ASSERT


def _region_of(args: tuple) -> AutocastRegion:
    device_type, dtype, enabled = args[0], args[1], args[2]
    if dtype is None:  # autocast's default for the device
        dtype = torch.get_autocast_dtype(device_type)
    return AutocastRegion(device_type, dtype, bool(enabled))


def autocast_marker(node: fx.Node) -> AutocastRegion | str | None:
    """For a flat ``_enter_autocast`` marker its region, ``"exit"`` for an
    ``_exit_autocast`` marker, else None (what a tracer records before export wraps the
    block in a higher-order op)."""
    if node.op != "call_function":
        return None
    if node.target is _ENTER:
        return _region_of(node.args)
    return "exit" if node.target is _EXIT else None


def _inline(gm: fx.GraphModule, node: fx.Node, body: fx.GraphModule, operands: tuple) -> list:
    """Copy ``body``'s nodes before ``node``; return the copied nodes and the outputs."""
    env: dict[fx.Node, object] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    for placeholder, operand in zip(placeholders, operands, strict=True):
        env[placeholder] = operand
    copied: list[fx.Node] = []
    outputs: object = ()
    with gm.graph.inserting_before(node):
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                outputs = fx.node.map_arg(inner.args[0], lambda n: env[n])
                continue
            if inner.op == "get_attr":  # a nested region's submodule
                target = _unique_attr(gm, inner.target)
                setattr(gm, target, operator.attrgetter(inner.target)(body))
                new = gm.graph.get_attr(target)
            else:
                new = gm.graph.node_copy(inner, lambda n: env[n])
            new.meta = dict(inner.meta)
            env[inner] = new
            copied.append(new)
    return [copied, outputs]


def _unique_attr(gm: fx.GraphModule, name: str) -> str:
    base, i = name.replace(".", "_"), 0
    candidate = base
    while hasattr(gm, candidate):
        i += 1
        candidate = f"{base}_{i}"
    return candidate


def _replace_tuple_output(node: fx.Node, outputs: object) -> None:
    """Users of a region op read its outputs by ``getitem``: point them at the values."""
    values = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(values[user.args[1]])
            user.graph.erase_node(user)
        else:  # used whole: rebuild the tuple
            with node.graph.inserting_before(user):
                packed = node.graph.call_function(tuple, (list(values),))
            user.replace_input_with(node, packed)


def _tag(nodes: list[fx.Node], region: AutocastRegion) -> None:
    for node in nodes:
        node.meta.setdefault(REGION, region)  # an inner region tagged its nodes first


def _inline_autocast(gm: fx.GraphModule, node: fx.Node) -> None:
    region = _region_of(node.args)
    body = operator.attrgetter(node.args[4].target)(gm)
    copied, outputs = _inline(gm, node, body, node.args[5:])
    _tag(copied, region)
    _replace_tuple_output(node, outputs)
    _erase_with_submodule(gm, node, 4)


def _inline_grad_mode(gm: fx.GraphModule, node: fx.Node) -> None:
    enabled, submodule = node.args[0], node.args[1]
    body = operator.attrgetter(submodule.target)(gm)
    with gm.graph.inserting_before(node):
        previous = gm.graph.call_function(torch.is_grad_enabled, ())
        gm.graph.call_function(torch._C._set_grad_enabled, (enabled,))
    copied, outputs = _inline(gm, node, body, node.args[2:])
    with gm.graph.inserting_before(node):
        gm.graph.call_function(torch._C._set_grad_enabled, (previous,))
    region = node.meta.get(REGION)
    if region is not None:
        _tag(copied, region)
    _replace_tuple_output(node, outputs)
    _erase_with_submodule(gm, node, 1)


def _erase_with_submodule(gm: fx.GraphModule, node: fx.Node, position: int) -> None:
    getter = node.args[position]
    gm.graph.erase_node(node)
    if not getter.users:
        target = getter.target
        gm.graph.erase_node(getter)
        if not any(n.op == "get_attr" and n.target == target for n in gm.graph.nodes):
            gm.delete_submodule(target)


def _tag_markers(gm: fx.GraphModule) -> int:
    """Flat ``_enter_autocast`` ... ``_exit_autocast`` markers: tag what lies between."""
    stack: list[AutocastRegion] = []
    markers = []
    for node in gm.graph.nodes:
        marker = autocast_marker(node)
        if isinstance(marker, AutocastRegion):
            stack.append(marker)
            markers.append(node)
        elif marker == "exit":
            stack.pop()
            markers.append(node)
        elif stack:
            node.meta.setdefault(REGION, stack[-1])
    for node in reversed(markers):  # exits first: they use their enter marker
        gm.graph.erase_node(node)
    return len(markers) // 2


def inline_regions(gm: fx.GraphModule) -> PassResult:
    """Flatten autocast and grad-mode regions (see the module docstring); in place."""
    regions = 0
    changed = True
    while changed:  # an inlined body may hold nested regions
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            if _AUTOCAST_HOP is not None and node.target is _AUTOCAST_HOP:
                _inline_autocast(gm, node)
                regions += 1
                changed = True
            elif _GRAD_HOP is not None and node.target is _GRAD_HOP:
                _inline_grad_mode(gm, node)
                changed = True
    regions += _tag_markers(gm)
    asserts = [n for n in gm.graph.nodes if _is_dtype_assert(n)]
    for node in asserts:
        gm.graph.erase_node(node)
    modified = bool(regions or asserts) or changed
    return PassResult(gm, modified=modified, stats={"autocast_regions": regions})


def region_left(gm: fx.GraphModule) -> fx.Node | None:
    """A node :func:`inline_regions` would still change (a region, a marker, a dtype
    assert), or None when the graph is flat."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        hop = node.target is not None and node.target in (_AUTOCAST_HOP, _GRAD_HOP)
        if hop or autocast_marker(node) is not None or _is_dtype_assert(node):
            return node
    return None


__all__ = ["REGION", "AutocastRegion", "autocast_marker", "inline_regions", "region_left"]
