"""simplify_casts: remove the casts that change nothing, as a table of rules.

Each rule looks at one node and returns the node that should replace it, or ``None`` for
"no match". The driver applies the table in one walk over the graph, then drops the casts
left unused: that is the fixpoint, since a rule reads only the node and its inputs, which
the walk has settled before it reaches the node, and a replacement changes only the
node's users, which come after it (the tests run the pass again on its result and find
nothing). Only casts amp_graph
inserted are touched: the model's own casts are kept as written. A chain is folded only
when the inner cast is lossless; ``fp32 -> fp16 -> fp32`` rounds, so it stays.

Reads: ``meta["amp"]`` (role, out_dtype). Writes: removes nodes, rewires
uses, and keeps ``cast_for`` of the surviving casts complete. Guarantees: every value each
node receives is bit-for-bit what it received before the pass, with the same autograd
history; in particular two casts are merged, and a chain's outer cast made to read the
chain's origin, only where :mod:`passes.sharing` allows (no write into the origin's storage
between the two reads, the same grad mode); a chain folds to its origin itself only if
nothing in the graph writes the origin (its users would then read it later, uncopied).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from .meta import AMP, Role, has_cast_role, is_lossless
from .result import PassResult
from .sharing import CastSharing, ShareKey, written_values

CastRule = Callable[[fx.Node, "_Context"], fx.Node | None]  # not the policy's Rule


class _Context:
    """Lookups the rules share: the GraphModule, the first cast per (sharing key, dtype),
    and where the walk stands for :mod:`passes.sharing`."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.first_cast: dict[tuple[ShareKey, torch.dtype, bool], fx.Node] = {}
        self.first_attr: dict[int, fx.Node] = {}
        self.sharing = CastSharing(gm)
        self.read_at: dict[fx.Node, ShareKey] = {}  # cast -> the sharing key of its read
        self._written: set[fx.Node] | None = None

    def written(self) -> set[fx.Node]:
        """The values whose storage the graph writes somewhere (computed once, on demand)."""
        if self._written is None:
            self._written = written_values(self.gm)
        return self._written

    def visit(self, node: fx.Node) -> None:
        """Step past a node no rule replaced."""
        if has_cast_role(node):
            self.read_at[node] = self.sharing.key(_source(node))
        self.sharing.visit(node)


def _source(cast: fx.Node) -> fx.Node:
    return cast.args[0]


def _target(cast: fx.Node) -> torch.dtype:
    return cast.args[1]


def _known(node: fx.Node) -> torch.dtype | None:
    fact = node.meta[AMP].out_dtype
    return fact if isinstance(fact, torch.dtype) else None


def cast_to_own_dtype(node: fx.Node, ctx: _Context) -> fx.Node | None:
    """x.to(d) where x is already d  ->  x"""
    if has_cast_role(node) and _known(_source(node)) == _target(node):
        return _source(node)
    return None


def fold_lossless_chain(node: fx.Node, ctx: _Context) -> fx.Node | None:
    """x.to(a).to(b)  ->  x.to(b), when x -> a is lossless; and -> x when b is x's dtype;
    only where passes.sharing lets x read here stand for x read by the inner cast"""
    if not (has_cast_role(node) and has_cast_role(_source(node))):
        return None
    inner = _source(node)
    origin, origin_dtype = _source(inner), _known(_source(inner))
    if origin_dtype is None or not is_lossless(origin_dtype, _target(inner)):
        return None
    if ctx.read_at.get(inner) != ctx.sharing.key(origin):  # x written since, or grad mode
        return None
    if origin_dtype == _target(node):
        # the users would read x itself, later: only if nothing ever writes x's storage
        return None if origin in ctx.written() else origin
    node.replace_input_with(inner, origin)
    return None  # rewired in place; the cast itself stays


def one_cast_per_value(node: fx.Node, ctx: _Context) -> fx.Node | None:
    """x.to(d) ... x.to(d)  ->  the first x.to(d) (e.g. Q, K and V projections share one),
    when passes.sharing allows: not across a write into x's storage (the first cast holds
    the old values) nor across a grad-mode change; else this one starts a new group"""
    if not has_cast_role(node):
        return None
    key = (ctx.sharing.key(_source(node)), _target(node))
    first = ctx.first_cast.setdefault(key, node)
    if first is node:
        return None
    first.meta[AMP].cast_for += node.meta[AMP].cast_for
    return first


def one_node_per_parameter(node: fx.Node, ctx: _Context) -> fx.Node | None:
    """get_attr a.weight, get_attr b.weight of one tensor (tied weights)  ->  the first"""
    if node.op != "get_attr" or node.meta[AMP].role is not Role.PARAM:
        return None
    tensor = operator.attrgetter(node.target)(ctx.gm)
    if not isinstance(tensor, torch.Tensor):
        return None
    first = ctx.first_attr.setdefault(id(tensor), node)
    return None if first is node else first


CAST_RULES: tuple[CastRule, ...] = (
    one_node_per_parameter,
    cast_to_own_dtype,
    fold_lossless_chain,
    one_cast_per_value,
)


def _remove_dead_casts(graph: fx.Graph) -> None:
    for node in reversed(list(graph.nodes)):
        unused_attr = node.op == "get_attr" and node.meta[AMP].role is Role.PARAM  # never inputs
        if not node.users and (has_cast_role(node) or unused_attr):
            graph.erase_node(node)


def simplify_casts(gm: fx.GraphModule) -> PassResult:
    """Apply :data:`CAST_RULES` in one walk (their fixpoint, see the module docstring), then drop
    unused casts.

    ``stats["casts_removed"]`` counts the casts that are gone.
    """
    graph = gm.graph
    before = sum(has_cast_role(n) for n in graph.nodes)
    ctx = _Context(gm)
    for node in list(graph.nodes):
        for rule in CAST_RULES:
            replacement = rule(node, ctx)
            if replacement is not None and replacement is not node:
                node.replace_all_uses_with(replacement)
                graph.erase_node(node)
                break
        else:
            ctx.visit(node)
    _remove_dead_casts(graph)
    after = sum(has_cast_role(n) for n in graph.nodes)
    return PassResult(gm, modified=before != after, stats={"casts_removed": before - after})
