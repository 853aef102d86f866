"""insert_casts: materialize the plan as cast nodes.

For every node with a ``compute_dtype``, each floating tensor input whose dtype differs
gets a cast right before the node, one per (consumer, input) as torch.autocast does at
every call; ``simplify_casts`` then removes the redundant ones. Graph inputs planned for
an entry cast (policy ``cast_inputs``) are cast once, right after the placeholder.

A cast is ``x.to(dtype)``: every value's dtype is known (its fake value), so only the
values that need one are cast.

Reads: ``meta["amp"]`` (compute_dtype, out_dtype, role). Writes: cast nodes with
``meta["amp"]`` of role ``CAST`` (``out_dtype``, ``cast_for``) and no ``meta["val"]``
(reports read the shape from the cast's input). Guarantees: after this pass,
every castable input of every planned node has the planned dtype; integer, bool and
float64 values are never cast; the model's own casts and in-place ops are untouched.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from .meta import AMP, AmpInfo, Role, cast_fact, is_castable, short, tensor_facts
from .result import PassResult


def make_cast(graph: fx.Graph, value: fx.Node, dtype: torch.dtype, consumer: str) -> fx.Node:
    """Create a cast node of ``value`` to ``dtype`` at the graph's insertion point."""
    source: AmpInfo = value.meta[AMP]
    if not isinstance(source.out_dtype, torch.dtype):
        raise TypeError(
            f"insert_casts: {value.name!r} holds {short(source.out_dtype)}, not one tensor; "
            "captured graphs pick a structure's tensors with getitem before any op reads them"
        )
    name = f"{value.name}_{short(dtype)}"
    node = graph.create_node("call_method", "to", (value, dtype), name=name)
    node.meta[AMP] = AmpInfo.inserted_cast(
        f"inserted: {value.name} ({short(source.out_dtype)}) to {short(dtype)}",
        consumer,
        module_path=source.module_path,
        out_dtype=cast_fact(source.out_dtype, dtype),
        exact=source.exact,
    )
    return node


def _needs_cast(value: fx.Node, dtype: torch.dtype) -> bool:
    """Some tensor of the value is floating (float64 aside) and of another dtype."""
    facts = tensor_facts(value.meta[AMP].out_dtype)
    return any(is_castable(fact) and fact != dtype for fact in facts)


def insert_casts(gm: fx.GraphModule) -> PassResult:
    """Insert one cast per (consumer, input) that the plan requires.

    >>> import torch, amp_graph
    >>> from amp_graph.capture import capture_module
    >>> from amp_graph.passes.assign_dtypes import assign_dtypes
    >>> from amp_graph.passes.classify import classify
    >>> gm = capture_module(torch.nn.Linear(2, 2), (torch.randn(1, 2),), {}, device_type="cpu",
    ...                     autocast_dtype=torch.float16).graph_module
    >>> _ = classify(gm, amp_graph.Policy.preset("O1"))
    >>> _ = assign_dtypes(gm, torch.float16)
    >>> insert_casts(gm).stats
    {'casts_inserted': 3}
    """
    graph = gm.graph
    inserted = 0
    for node in list(graph.nodes):
        amp: AmpInfo = node.meta[AMP]
        dtype = amp.compute_dtype
        if dtype is None:
            continue
        if node.op == "placeholder":
            users = list(node.users)
            with graph.inserting_after(node):
                entry = make_cast(graph, node, dtype, "every use (entry cast)")
            for user in users:
                user.replace_input_with(node, entry)
            entry.meta[AMP].cast_for = tuple(u.name for u in users)
            inserted += 1
            continue
        if amp.role is not Role.OP:
            continue
        casts: dict[fx.Node, fx.Node] = {}

        def cast_input(
            value: fx.Node,
            node: fx.Node = node,
            dtype: torch.dtype = dtype,
            casts: dict[fx.Node, fx.Node] = casts,
        ) -> fx.Node:
            if value not in casts:
                if not _needs_cast(value, dtype):
                    return value
                with graph.inserting_before(node):
                    casts[value] = make_cast(graph, value, dtype, node.name)
            return casts[value]

        node.args = map_arg(node.args, cast_input)
        node.kwargs = map_arg(node.kwargs, cast_input)
        inserted += len(casts)
    return PassResult(gm, modified=bool(inserted), stats={"casts_inserted": inserted})
