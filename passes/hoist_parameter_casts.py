"""Pass hoist_parameter_casts: a parameter cast once per training step, not per micro-batch.

With gradient accumulation the captured ``build`` runs once per micro-batch, and so would
its casts of parameters (torch.autocast casts them again in every micro-batch too). This
pass takes them out of the graph: they become the items of one new input,
``low_precision_weights``, which :class:`amp_graph.Graph`'s step graph computes once.

Reads: inserted cast nodes (``role=CAST``, either form) of ``get_attr`` parameters and buffers
(``role=PARAM``), except those of FSDP2 units' parameters (``meta["amp_graph.fsdp_unit"]``: a shard
until the unit's pre-forward hook runs). Writes: ``getitem`` nodes in their place with
``role=PARAM``; removes the casts and the parameter reads left unused. Guarantees: every
consumer receives the same value as before (the same cast of the same parameter, made
earlier), and autograd still flows through each cast into the float32 ``.grad`` of its
parameter. A cast is hoisted only where :mod:`passes.sharing` lets one cast made before
the graph serve it in every micro-batch: a parameter or buffer the graph writes in place
(directly or through a view) anywhere, and a cast inside a ``no_grad`` block, stay where
they are.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from amp_graph.policy import Rule

from .meta import AMP, FSDP_UNIT, AmpInfo, Role, is_dtype_cast, short
from .result import PassResult
from .sharing import CastSharing, key_before_graph, written_values


def _is_parameter_cast(node: fx.Node) -> bool:
    """An inserted cast of a ``get_attr`` parameter or buffer, outside any FSDP2 unit (its
    parameter is a shard outside the unit's region: it is cast there)."""
    return (
        is_dtype_cast(node)
        and isinstance(node.args[0], fx.Node)
        and node.args[0].op == "get_attr"
        and node.args[0].meta[AMP].role is Role.PARAM
        and FSDP_UNIT not in node.args[0].meta
    )


def hoistable_parameter_casts(gm: fx.GraphModule) -> list[fx.Node]:
    """The parameter casts that one cast made before the graph, and read by every run of
    it, may replace: the sharing rule of :mod:`passes.sharing`."""
    written = written_values(gm)
    sharing = CastSharing(gm)
    casts = []
    for node in gm.graph.nodes:
        if _is_parameter_cast(node):
            param = node.args[0]
            if sharing.key(param) == key_before_graph(param, written):
                casts.append(node)
        sharing.visit(node)
    return casts


def hoist_parameter_casts(gm: fx.GraphModule) -> tuple[PassResult, list[tuple[str, torch.dtype]]]:
    """Take the casts of parameters out of ``gm``: they become the items of one new input,
    ``low_precision_weights``, which the step graph computes once for all micro-batches.

    Reads: inserted cast nodes (``role=CAST``, either form) of ``get_attr`` parameters
    (``role=PARAM``). Writes: ``getitem`` nodes in their place, with ``role=PARAM`` (they
    are the low-precision parameters: the build graph casts nothing there). Returns the pass
    result and, in input order, ``(parameter target, dtype)`` of each cast taken out.
    Guarantees: every consumer receives the same value as before (the same cast of the same
    parameter, made earlier); autograd still flows through each cast into the float32
    ``.grad`` of its parameter; casts of what the graph writes in place, and casts made
    under ``no_grad``, are left in place (:func:`hoistable_parameter_casts`).
    """
    casts = hoistable_parameter_casts(gm)
    if not casts:
        return PassResult(gm, modified=False, stats={"casts_hoisted": 0}), []
    last_input = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last_input):
        weights = gm.graph.placeholder("low_precision_weights")
    weights.meta[AMP] = AmpInfo(
        role=Role.INPUT,
        op="input",
        rule=Rule.FOLLOW,
        source="step",
        detail="the parameters cast once per step, for every micro-batch",
    )
    hoisted = []
    for i, cast in enumerate(casts):
        with gm.graph.inserting_before(cast):
            item = gm.graph.call_function(operator.getitem, (weights, i))
        target, dtype = cast.args[0].target, cast.args[1]
        item.meta = {k: v for k, v in cast.meta.items() if k != AMP}  # nn_module_stack and the like
        item.meta[AMP] = AmpInfo.fixed(
            Role.PARAM,
            "getitem",
            f"{target} cast to {short(dtype)} once per step by the step graph",
            module_path=cast.meta[AMP].module_path,
            out_dtype=dtype,
            exact=True,
        )
        cast.replace_all_uses_with(item)
        hoisted.append((target, dtype))
        name = cast.name
        gm.graph.erase_node(cast)
        item.name = name  # the cast's name (model_fc_weight_bf16) reads better; it is free now
    for node in list(gm.graph.nodes):  # parameters now read by the step graph alone
        if node.op == "get_attr" and node.meta[AMP].role is Role.PARAM and not node.users:
            gm.graph.erase_node(node)
    return PassResult(gm, modified=True, stats={"casts_hoisted": len(hoisted)}), hoisted


__all__ = ["hoist_parameter_casts", "hoistable_parameter_casts"]
