"""Pass fp8_linears: linear layers as float8 scaled matmuls (the rewrite of the fp8 policy).

On an aten-level graph (``torch.export`` non-strict, pre-dispatch) it matches, with ``P`` a
2-D ``nn.Parameter`` read by a ``get_attr`` node::

    aten.linear(x, P, b)              ->  fp8 linear(x, P, b)
    aten.matmul / aten.mm(x, P)       ->  fp8 linear(x, P.t())
    aten.matmul(P, x), x >= 2-D       ->  fp8 linear(x.mT, P).mT
    aten.addmm(b, x, P), b 1-D        ->  fp8 linear(x, P.t(), b)      (beta = alpha = 1)

decides each with :func:`amp_graph.policy.fp8_filters.decide` (dims, the user's module filter, the
opt-in auto-filter or the device's cost model, which reads the tokens from the input's example
value, an explicit fp32 override), and rewrites the eligible ones into five nodes::

    x_scale = amp_graph.fp8_scale(x, float8_e4m3fn, recipe)
    x_e4m3  = amp_graph.fp8_quantize(x, x_scale, float8_e4m3fn)
    w_scale, w_e4m3                           # the same for the weight
    out     = amp_graph.fp8_linear(x, W, x_e4m3, x_scale, w_e4m3, w_scale, b, recipe)

A value feeding several fp8 linears (the input of q, k and v) is quantized once, where
:mod:`passes.sharing` allows: a value written in place (or through a view) between two fp8
linears, or read on both sides of a grad-mode change, is quantized again. The ops and
their backward are :mod:`amp_graph.ops.fp8_ops`; this pass only names them (``torch.ops``).

Reads: ``meta["amp"]`` when classify ran (the node's rule and module path: an explicit
fp32 override outranks fp8), else ``meta["nn_module_stack"]``; ``meta["val"]`` of the
inputs. Writes: new nodes with ``meta["amp"]`` (role OP, rule FOLLOW: nothing is cast
around them; source ``"fp8"``; the decision's reason as ``detail``), ``meta["val"]`` when
the inputs have one, ``meta["nn_module_stack"]`` copied; on linears it keeps, the reason
is appended to ``meta["amp"].detail`` (or a record is created).

Invariants: parameters are read as they are (never copied or cast: the float32 weight is
quantized directly and its gradient arrives in float32); the user's module is not touched;
the graph is changed in place and linted; like every pass it leaves the recompile to its
driver (``run_passes``), so a caller running it alone calls ``gm.recompile()`` before the module
runs the new graph.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from amp_graph.ops import fp8_ops  # noqa: F401 (registers the torch.ops.amp_graph.fp8_* the pass writes)
from amp_graph.policy import Rule
from amp_graph.policy.fp8_filters import LinearFacts, decide
from amp_graph.policy.fp8_recipe import E4M3, Fp8Config

from .classify import is_model_parameter, normalize_module_path
from .meta import AMP, FP8_OF, UNKNOWN, VAL, AmpInfo, Role, size_hint
from .result import PassResult
from .sharing import CastSharing, ShareKey

log = logging.getLogger(__name__)

aten = torch.ops.aten
SOURCE = "fp8"


@dataclass(frozen=True)
class Match:
    """A linear-like node: ``out = x @ W.T + bias``, W (N, K) derived from a parameter."""

    x: fx.Node
    param: fx.Node  # the get_attr of the 2-D parameter
    bias: Any  # an fx.Node or None
    param_is_k_by_n: bool  # the parameter is (K, N): W = P.t()
    param_first: bool  # P @ x: x and the result are transposed


def _parameter(gm: fx.GraphModule, node: Any) -> torch.Tensor | None:
    """The 2-D parameter a ``get_attr`` node reads, or a graph input dynamo lifted a
    parameter to (its example value), else None (buffers are not weights)."""
    if isinstance(node, fx.Node) and node.op == "placeholder" and is_model_parameter(node):
        value = node.meta.get(VAL, node.meta.get("example_value"))
        return value if isinstance(value, torch.Tensor) and value.dim() == 2 else None
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    value = gm
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, nn.Parameter) and value.dim() == 2 else None


def _rank(node: Any) -> int | None:
    val = node.meta.get(VAL) if isinstance(node, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else None


# One matcher per op: (gm, node) -> Match | None. None means "not linear-like".
def _match_linear(gm: fx.GraphModule, node: fx.Node) -> Match | None:
    x, weight, bias = (*node.args, node.kwargs.get("bias"))[:3]
    if _parameter(gm, weight) is None:
        return None
    return Match(x, weight, bias, param_is_k_by_n=False, param_first=False)


def _match_matmul(gm: fx.GraphModule, node: fx.Node) -> Match | None:
    a, b = node.args[:2]
    if _parameter(gm, b) is not None:  # x @ P
        return Match(a, b, None, param_is_k_by_n=True, param_first=False)
    if _parameter(gm, a) is not None:  # P @ x = (x.mT @ P.T).mT
        rank = _rank(b)
        if rank == 1:
            return Match(b, a, None, param_is_k_by_n=False, param_first=False)
        if rank is not None and rank >= 2:
            return Match(b, a, None, param_is_k_by_n=False, param_first=True)
    return None


def _match_addmm(gm: fx.GraphModule, node: fx.Node) -> Match | None:
    bias, x, p = node.args[:3]
    scaled = len(node.args) > 3 or any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha"))
    if scaled or _parameter(gm, p) is None or _rank(bias) != 1:
        return None
    return Match(x, p, bias, param_is_k_by_n=True, param_first=False)


MATCHERS: dict[Any, Callable[[fx.GraphModule, fx.Node], Match | None]] = {
    aten.linear.default: _match_linear,  # nn.Linear, F.linear
    aten.matmul.default: _match_matmul,  # x @ self.w, self.w @ x
    aten.mm.default: _match_matmul,
    aten.addmm.default: _match_addmm,  # torch.addmm(b, x, self.w)
}


def _module_path(node: fx.Node) -> str:
    amp = node.meta.get(AMP)
    if amp is not None:
        return amp.module_path
    stack = node.meta.get("nn_module_stack") or {}
    return normalize_module_path(list(stack.values())[-1][0]) if stack else ""


def _facts(gm: fx.GraphModule, node: fx.Node, match: Match, root: nn.Module | None) -> LinearFacts:
    shape = _parameter(gm, match.param).shape
    n, k = (shape[1], shape[0]) if match.param_is_k_by_n else (shape[0], shape[1])
    path = _module_path(node)
    module = None
    if root is not None:
        try:
            module = root.get_submodule(path)
        except AttributeError:
            module = None
    amp: AmpInfo | None = node.meta.get(AMP)
    return LinearFacts(
        op=f"aten.{node.target._opname}",  # type: ignore[union-attr]
        path=path,
        module=module,
        in_features=int(k),
        out_features=int(n),
        policy_rule=amp.rule if amp is not None else None,
        policy_source=amp.source if amp is not None else "",
        tokens=_tokens(match.x, match.param_first),
    )


def _tokens(x: Any, transposed: bool) -> int | None:
    """The rows of the product's input (every dim but the contraction dim, K: the last, or
    for ``P @ x`` the one before it), from its example value; a symbolic size counts as its
    hint (the size it was captured with); None where the value or a hint is missing."""
    value = x.meta.get(VAL) if isinstance(x, fx.Node) else None
    contraction_from_end = 2 if transposed else 1
    if not isinstance(value, torch.Tensor) or value.dim() < contraction_from_end:
        return None
    contraction = value.dim() - contraction_from_end
    rows = 1
    for size in (s for i, s in enumerate(value.shape) if i != contraction):
        hint = size_hint(size)
        if hint is None:
            return None
        rows *= hint
    return rows


def _fake_value(target: Any, args: tuple) -> Any:
    """The op's fake output from its inputs' ``meta["val"]``; None when one is missing."""
    missing = False

    def val(node: fx.Node) -> Any:
        nonlocal missing
        value = node.meta.get(VAL)
        missing = missing or value is None
        return value

    values = pytree.tree_map_only(fx.Node, val, args)
    mode = None if missing else torch._guards.detect_fake_mode(pytree.tree_leaves(values))
    if mode is None:
        return None
    with mode:
        return target(*values)


class _Rewriter:
    """Inserts the fp8 nodes for one graph, quantizing each value once per sharing key
    (:mod:`passes.sharing`): the caller walks ``sharing`` along the graph."""

    def __init__(self, gm: fx.GraphModule, recipe: str) -> None:
        self.graph = gm.graph
        self.recipe = recipe
        self.sharing = CastSharing(gm)
        self.quantized: dict[ShareKey, tuple[fx.Node, fx.Node]] = {}

    def node(self, target: Any, args: tuple, name: str, like: fx.Node, op: str, detail: str):
        new = self.graph.create_node("call_function", target, args, name=name)
        for key in ("nn_module_stack", "stack_trace"):
            if key in like.meta:
                new.meta[key] = like.meta[key]
        value = _fake_value(target, args)
        if value is not None:
            new.meta[VAL] = value
        new.meta[AMP] = AmpInfo(
            role=Role.OP,
            op=op,
            aten=f"{target.namespace}.{target._opname}",
            module_path=_module_path(like),
            rule=Rule.FOLLOW,  # the fp8 ops take their inputs as they are: no casts
            source=SOURCE,
            detail=detail,
            out_dtype=value.dtype if value is not None else UNKNOWN,
            exact=value is not None,
        )
        return new

    def quantize(self, value: fx.Node, like: fx.Node) -> tuple[fx.Node, fx.Node]:
        """The (scale, float8) nodes of ``value`` read at ``like``: a new pair unless an
        earlier one may be shared (same sharing key)."""
        key = self.sharing.key(value)
        if key not in self.quantized:
            ops = torch.ops.amp_graph
            scale = self.node(
                ops.fp8_scale.default,
                (value, E4M3, self.recipe),
                f"{value.name}_scale",
                like,
                "fp8 scale",
                f"{self.recipe} scale of '{value.name}' for float8_e4m3fn (448 / amax)",
            )
            cast = self.node(
                ops.fp8_quantize.default,
                (value, scale, E4M3),
                f"{value.name}_e4m3",
                like,
                "fp8 quantize",
                f"'{value.name}' times its scale, saturated to float8_e4m3fn",
            )
            self.quantized[key] = (scale, cast)
        return self.quantized[key]

    def rewrite(self, node: fx.Node, match: Match, reason: str) -> None:
        view = "a transpose for the fp8 linear (a view, no copy)"
        with self.graph.inserting_before(node):
            x, weight = match.x, match.param
            if match.param_first:
                x = self.node(aten.transpose.int, (x, -2, -1), f"{x.name}_mT", node, "mT", view)
            if match.param_is_k_by_n:
                weight = self.node(aten.t.default, (weight,), f"{weight.name}_t", node, "t", view)
            x_scale, x_e4m3 = self.quantize(x, node)
            w_scale, w_e4m3 = self.quantize(weight, node)
            args = (x, weight, x_e4m3, x_scale, w_e4m3, w_scale, match.bias, self.recipe)
            out = self.node(
                torch.ops.amp_graph.fp8_linear.default,
                args,
                f"{node.name}_fp8",
                node,
                "fp8 linear",
                reason,
            )
            out.meta[FP8_OF] = node.name  # what a node override names
            if match.param_first:
                out = self.node(
                    aten.transpose.int, (out, -2, -1), f"{out.name}_mT", node, "mT", view
                )
        node.replace_all_uses_with(out)
        self.graph.erase_node(node)


def _record_kept(node: fx.Node, facts: LinearFacts, reason: str) -> None:
    amp: AmpInfo | None = node.meta.get(AMP)
    if amp is None:
        node.meta[AMP] = AmpInfo(
            role=Role.OP, op=facts.op, module_path=facts.path, source=SOURCE, detail=reason
        )
    elif reason not in amp.detail:
        node.meta[AMP] = replace(amp, detail=f"{amp.detail}; {reason}" if amp.detail else reason)


def fp8_linears(
    gm: fx.GraphModule, config: Fp8Config | None = None, root: nn.Module | None = None
) -> PassResult:
    """Rewrite the eligible linear-like nodes of ``gm`` into fp8 linears, in place.

    Args:
        gm: an aten-level graph whose parameters are ``get_attr`` nodes.
        config: recipe and filters (default: tensorwise, no filters).
        root: the user's model, whose ``named_modules`` paths the graph's module paths
            are; the module filter receives its submodules. Required with a module filter.

    Returns:
        ``PassResult(gm, modified, {"fp8_linears": converted, "fp8_kept": kept})``.

    Example::

        >>> import torch, amp_graph
        >>> from amp_graph.passes.fp8_linears import fp8_linears
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 10))
        >>> gm = torch.export.export(model, (torch.randn(4, 32),), strict=False).module()
        >>> fp8_linears(gm, root=model).stats
        {'fp8_linears': 1, 'fp8_kept': 1}
    """
    config = Fp8Config() if config is None else config
    if config.module_filter is not None and root is None:
        raise ValueError(
            "fp8_linears: a module_filter is called with each layer's module; pass the "
            "user's model as root= so that the graph's module paths can be resolved"
        )
    rewriter = _Rewriter(gm, config.recipe)
    stats: Counter[str] = Counter({"fp8_linears": 0, "fp8_kept": 0})
    kept_because: Counter[str] = Counter()
    for node in list(gm.graph.nodes):
        matcher = MATCHERS.get(node.target) if node.op == "call_function" else None
        match = matcher(gm, node) if matcher is not None else None
        if match is None:  # (a linear-like node writes and views nothing: no visit needed)
            rewriter.sharing.visit(node)
            continue
        facts = _facts(gm, node, match, root)
        decision = decide(facts, config)
        if decision.fp8:
            rewriter.rewrite(node, match, decision.reason)
            stats["fp8_linears"] += 1
        else:
            _record_kept(node, facts, decision.reason)
            stats["fp8_kept"] += 1
            kept_because[decision.reason] += 1
    if kept_because and not stats["fp8_linears"]:
        # fp8 is chosen for speed alone: a policy that converts nothing must say so
        log.warning(
            "amp_graph: the fp8 policy converted none of this graph's %d linear-like ops, which "
            "run at the policy's other dtypes: %s. amp_graph.report(compiled).fp8_gemms gives "
            "each layer's reason (amp_graph.explain(compiled, '<node name>') one node's), and "
            "Fp8Config (module_filter, auto_filter, cost_model) sets the choice.",
            stats["fp8_kept"],
            "; ".join(f"{n} x {why}" for why, n in kept_because.most_common(3)),
        )
    if stats["fp8_linears"]:
        gm.graph.lint()  # the driver recompiles
    return PassResult(gm, modified=stats["fp8_linears"] > 0, stats=dict(stats))
