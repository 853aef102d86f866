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
from amp_graph.capture.capture_error import CaptureError
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
    """A kept call (:func:`is_function_call`) of a user's ``torch.library.custom_op``, whose
    autograd formula :func:`autocast_op` carries over."""
    op = _kept_op(node)
    return op is not None and op_definition(op._schema.name) is not None


def is_library_op_call(node: fx.Node) -> bool:
    """A kept call of an op defined with ``torch.library.Library``: its autograd is the
    dispatcher's (an Autograd kernel, or torch's fallback that differentiates the kernel's
    own ops), which no formula of :func:`autocast_op` can stand for."""
    op = _kept_op(node)
    return op is not None and op_definition(op._schema.name) is None


def _kept_op(node: fx.Node) -> torch._ops.OpOverload | None:
    """The user's op a kept call calls, else None."""
    if is_function_call(node) and isinstance(node.target.function, CustomOpFunction):
        return node.target.function.op
    return None


def custom_ops_as_autocast_ops(gm: fx.GraphModule) -> int:
    """Rewrite each kept ``torch.library.custom_op`` call of ``gm`` into a call of its
    :func:`autocast_op`, with the same inputs. Returns how many nodes it rewrote (``gm`` is
    recompiled if any). Calls of ``torch.library.Library`` ops stay kept calls
    (:func:`is_library_op_call`).

    Guarantee: ``gm`` computes the same values; a compiler that traces it records each call
    as one opaque op that enters its autocast state when it runs."""
    return _rewritten(gm, [n for n in gm.graph.nodes if is_custom_op_call(n)])


def library_ops_as_autocast_ops(gm: fx.GraphModule, owner: str) -> int:
    """Rewrite each kept call of a ``torch.library.Library`` op in ``gm`` into a call of its
    :func:`autocast_op` (without an autograd formula), where no gradient flows through it:
    grad mode is off, or none of its tensor inputs requires a gradient (``meta["val"]``).
    Returns how many nodes it rewrote.

    Raises :class:`CaptureError` for a call a gradient flows through: its autograd is the
    dispatcher's (the op's Autograd kernel, or torch's fallback that differentiates the ops
    its kernel calls), which an op handed to AOTAutograd cannot carry.

    Guarantee: as :func:`custom_ops_as_autocast_ops`, for the calls it rewrites."""
    calls = [n for n in gm.graph.nodes if is_library_op_call(n)]
    for node in calls:
        if torch.is_grad_enabled() and any(
            getattr(arg.meta.get("val"), "requires_grad", False) for arg in node.all_input_nodes
        ):
            name = node.target.function.op._schema.name
            raise CaptureError(
                f"amp_graph could not compile {owner}: a gradient flows through the op {name} "
                f"(node {node.name}), defined with torch.library.Library. Its autograd is the "
                "dispatcher's (its Autograd kernel, or torch's fallback that differentiates "
                "the ops its kernel calls), which a compiler tracing the graph (AOTAutograd) "
                "cannot run under torch.autocast: its kernel would compute in float32 or "
                "fail on mixed dtypes. Define the op with torch.library.custom_op and "
                "register_autograd (amp_graph compiles it under autocast), or use the "
                "backend with inner='eager', or amp_graph.compile (which runs the op between "
                "compiled pieces)."
            )
    return _rewritten(gm, calls)


def _rewritten(gm: fx.GraphModule, calls: list[fx.Node]) -> int:
    for node in calls:
        call: FunctionCall = node.target
        leaves = list(call.leaves)
        for position, value in zip(call.tensor_positions, node.args, strict=True):
            leaves[position] = value
        args, kwargs = pytree.tree_unflatten(leaves, call.spec)
        node.target = autocast_op(call.function.op, call.autocast)
        node.args, node.kwargs = tuple(args), dict(kwargs)
    if calls:
        gm.recompile()
    return len(calls)


__all__ = [
    "NAMESPACE",
    "autocast_op",
    "custom_ops_as_autocast_ops",
    "is_custom_op_call",
    "is_library_op_call",
    "library_ops_as_autocast_ops",
]
