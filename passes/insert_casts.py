"""Pass 4, insert_casts: materialize the plan as cast nodes.

For every node with a ``compute_dtype``, each floating tensor input whose dtype differs
gets a cast right before the node, one per (consumer, input) as torch.autocast does at
every call; ``simplify_casts`` then removes the redundant ones. Graph inputs planned for
an entry cast (policy ``cast_inputs``) are cast once, right after the placeholder.

A cast of a value whose dtype is known is ``x.to(dtype)``. A cast of a value whose dtype
is ``UNKNOWN`` (no example inputs reached it) is ``cast_if_castable(x, dtype)``, which
applies torch.autocast's eligibility test at run time, so the graph is right for any
input dtype.

Reads: ``meta["amp"]`` (compute_dtype, out_dtype, role). Writes: cast nodes with
``meta["amp"]`` of role ``CAST`` (``out_dtype``, ``cast_for``, ``conditional``) and
no ``meta["val"]`` (reports read the shape from the cast's input). Guarantees: after this pass,
every castable input of every planned node has the planned dtype; integer, bool and
float64 values are never cast; the model's own casts and in-place ops are untouched.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from .meta import (
    AMP,
    CASTABLE,
    UNKNOWN,
    AmpInfo,
    Role,
    cast_fact,
    is_castable,
    short,
    tensor_facts,
)
from .result import PassResult


def cast_if_castable(x: Any, dtype: torch.dtype) -> Any:
    """torch.autocast's cast: floating tensors except float64 go to ``dtype``; others pass."""
    if isinstance(x, fx.Proxy):  # re-traced (e.g. unpickling a GraphModule): stay one node
        return x.tracer.create_proxy("call_function", cast_if_castable, (x, dtype), {})
    if isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return x.to(dtype)
    return x


def cast_tree(value: Any, dtype: torch.dtype) -> Any:
    """:func:`cast_if_castable` on every tensor of a tuple, list or dict (an RNN's ``(h, c)``
    state, an op's several outputs), keeping the structure."""
    if isinstance(value, fx.Proxy):  # re-traced (e.g. unpickling a GraphModule): stay one node
        return value.tracer.create_proxy("call_function", cast_tree, (value, dtype), {})
    if isinstance(value, (tuple, list)):
        return type(value)(cast_tree(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_tree(v, dtype) for k, v in value.items()}
    return cast_if_castable(value, dtype)


def widest_castable_dtype(low: torch.dtype, *values: Any) -> torch.dtype:
    """torch.autocast's ``promote`` at run time: float32 if any floating input (float64
    aside) is not ``low``, else ``low``. For promote ops whose input dtypes were unknown."""
    for value in values:
        if isinstance(value, torch.Tensor) and value.dtype in CASTABLE and value.dtype != low:
            return torch.float32
    return low


# Generated code names globals after the function's module: `amp_graph.cast_if_castable`
# reads better in printed graphs, and amp_graph exports it there.
cast_if_castable.__module__ = "amp_graph"
cast_tree.__module__ = "amp_graph"
widest_castable_dtype.__module__ = "amp_graph"


def is_cast_node(node: fx.Node) -> bool:
    amp = node.meta.get(AMP)
    return amp is not None and amp.role is Role.CAST


def make_cast(graph: fx.Graph, value: fx.Node, dtype: torch.dtype, consumer: str) -> fx.Node:
    """Create a cast node of ``value`` to ``dtype`` at the graph's insertion point."""
    source: AmpInfo = value.meta[AMP]
    structured = isinstance(source.out_dtype, (tuple, list, dict))
    conditional = source.out_dtype is UNKNOWN
    name = f"{value.name}_{short(dtype)}"
    if structured:  # each tensor of the tuple, as autocast casts each argument
        node = graph.create_node("call_function", cast_tree, (value, dtype), name=name)
    elif conditional:
        node = graph.create_node("call_function", cast_if_castable, (value, dtype), name=name)
    else:
        node = graph.create_node("call_method", "to", (value, dtype), name=name)
    node.meta[AMP] = AmpInfo.inserted_cast(
        f"inserted: {value.name} ({short(source.out_dtype)}) to {short(dtype)}",
        consumer,
        module_path=source.module_path,
        out_dtype=cast_fact(source.out_dtype, dtype),
        exact=source.exact,
        conditional=conditional or structured,
    )
    return node


def _needs_cast(value: fx.Node, dtype: torch.dtype) -> bool:
    """Some tensor of the value (a structure's, element by element) may not be ``dtype``."""
    return any(
        fact is UNKNOWN or (is_castable(fact) and fact != dtype)
        for fact in tensor_facts(value.meta[AMP].out_dtype)
    )


def _insert_runtime_promote(graph: fx.Graph, node: fx.Node, low: torch.dtype) -> int:
    """``widest = widest_castable_dtype(low, a, b)``, then each input cast to ``widest``."""
    inputs = [v for v in node.all_input_nodes if _needs_cast(v, torch.float32)]
    if not inputs:
        return 0
    with graph.inserting_before(node):
        widest = graph.call_function(widest_castable_dtype, (low, *inputs))
        widest.meta[AMP] = AmpInfo.fixed(
            Role.OTHER,
            "widest_castable_dtype",
            f"the dtype {node.name!r} computes in: its input dtypes were unknown when compiled",
            module_path=node.meta[AMP].module_path,
        )
        casts = {}
        for value in inputs:
            cast = graph.call_function(
                cast_if_castable, (value, widest), name=f"{value.name}_promoted"
            )
            cast.meta[AMP] = AmpInfo.inserted_cast(
                f"inserted: {value.name} to the widest floating input dtype of {node.name}",
                node.name,
                module_path=value.meta[AMP].module_path,
                out_dtype=UNKNOWN,
                conditional=True,
            )
            casts[value] = cast
    node.args = map_arg(node.args, lambda v: casts.get(v, v))
    node.kwargs = map_arg(node.kwargs, lambda v: casts.get(v, v))
    return len(casts)


def insert_casts(gm: fx.GraphModule) -> PassResult:
    """Insert one cast per (consumer, input) that the plan requires.

    >>> import torch, amp_graph
    >>> from amp_graph.capture import capture_module
    >>> from amp_graph.passes import classify, assign_dtypes
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
        if amp.runtime_promote is not None:
            inserted += _insert_runtime_promote(graph, node, amp.runtime_promote)
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
