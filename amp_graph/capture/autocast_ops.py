"""A kept custom op call as an op that carries its autocast state, for graphs a compiler traces.

A kept ``torch.library.custom_op`` call (:mod:`.custom_ops`) is a :class:`~amp_graph.capture.
autograd_functions.FunctionCall` node: Python that enters the capture's autocast state and
calls the op. Run as it is, the op's body computes as in eager torch.autocast. Traced by
AOTAutograd (torch.compile with inductor or aot_eager), the op is opaque: the trace records
it and drops the autocast around it, so the compiled graph calls it with autocast off and its
body computes in float32 (or fails on mixed bf16/float32 inputs). torch.compile under
torch.autocast does the same.

:func:`custom_ops_as_autocast_ops` therefore rewrites each such node into a call of an op of
amp_graph's own (:func:`autocast_op`), defined once per custom op and autocast state, with
the op's schema. Its kernel enters that autocast state and calls the user's op; its fake is
the kept call's (the body's dtypes, as the capture saw them); its autograd formula is the
user's op's own. The compiled graph keeps it as one opaque node (a fallback kernel in
inductor), so the body runs under autocast at every call, as in eager mode.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from amp_graph.capture.autograd_functions import AutocastState, FunctionCall, is_function_call
from amp_graph.capture.custom_ops import CustomOpFunction, op_definition
from amp_graph.passes.meta import short

NAMESPACE = "amp_graph_autocast"

# amp_graph's ops by name; ops are process-wide (torch.library cannot forget one), so each is
# defined once
_DEFINED: dict[str, torch._ops.OpOverload] = {}


def autocast_op(op: torch._ops.OpOverload, autocast: AutocastState) -> torch._ops.OpOverload:
    """amp_graph's op that calls the user's custom op ``op`` under ``autocast``: the same
    schema and autograd formula, and a fake that gives the dtypes the body computes in. Its
    name says which op and state (``amp_graph_autocast::ns__op_default__cpu_bf16``), the same
    in every process, so that compiled graphs' caches can match it.

    Guarantee: called anywhere (eager, a compiled graph's fallback kernel, a CUDA graph
    replay), its value is ``op``'s under ``autocast``, bit for bit."""
    base = re.sub(r"\W", "_", op._schema.name.replace("::", "__"))
    states = [f"{device}_{short(dtype)}" for device, on, dtype in autocast.states if on]
    name = f"{NAMESPACE}::{base}_{op._overloadname}__{'_'.join(states) or 'off'}"
    if name not in _DEFINED:
        _DEFINED[name] = _define(name, op, autocast)
    return _DEFINED[name]


def _define(name: str, op: torch._ops.OpOverload, autocast: AutocastState) -> torch._ops.OpOverload:
    schema = str(op._schema)
    kept = CustomOpFunction(op)

    def run(*args: Any, **kwargs: Any) -> Any:
        with autocast.entered():
            return op(*args, **kwargs)

    def fake(*args: Any, **kwargs: Any) -> Any:
        with autocast.entered():
            return kept.apply(*args, **kwargs)

    defined = torch.library.custom_op(
        name, run, mutates_args=(), schema=schema[schema.index("(") :]
    )
    defined.register_fake(fake)
    definition = op_definition(op._schema.name)
    if definition is not None and definition._backward_fn is not None:
        defined.register_autograd(
            definition._backward_fn, setup_context=definition._setup_context_fn
        )
    namespace, op_name = name.split("::")
    return getattr(getattr(torch.ops, namespace), op_name).default


def is_custom_op_call(node: fx.Node) -> bool:
    """A kept call (:func:`is_function_call`) of a user's custom op."""
    return is_function_call(node) and isinstance(node.target.function, CustomOpFunction)


def custom_ops_as_autocast_ops(gm: fx.GraphModule) -> int:
    """Rewrite each kept custom op call of ``gm`` into a call of its :func:`autocast_op`,
    with the same inputs. Returns how many nodes it rewrote (``gm`` is recompiled if any).

    Guarantee: ``gm`` computes the same values; a compiler that traces it records each call
    as one opaque op that enters its autocast state when it runs."""
    rewritten = 0
    for node in gm.graph.nodes:
        if not is_custom_op_call(node):
            continue
        call: FunctionCall = node.target
        leaves = list(call.leaves)
        for position, value in zip(call.tensor_positions, node.args, strict=True):
            leaves[position] = value
        args, kwargs = pytree.tree_unflatten(leaves, call.spec)
        node.target = autocast_op(call.function.op, call.autocast)
        node.args, node.kwargs = tuple(args), dict(kwargs)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


__all__ = ["NAMESPACE", "autocast_op", "custom_ops_as_autocast_ops", "is_custom_op_call"]
