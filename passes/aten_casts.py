"""Pass aten_casts: every cast amp_graph wrote becomes an aten ``_to_copy`` call.

The passes write their casts as ``x.to(dtype)`` (``call_method``), and recompute_casts as
:func:`amp_graph.ops.recompute_ops.recomputed_cast` (a Python function that asks backward to cast
again). Both are the same conversion as ``torch.ops.aten._to_copy.default(x, dtype=dtype)``,
which is what a program for ``torch.export`` (and AOTInductor and ONNX after it) must hold:
an aten op, not a method call or a Python function. A consumer's
:func:`~amp_graph.ops.cast_reads.cast_read` of a shared cast (a route for its gradient, a
view of the cast forward) reads the cast itself: a program has no backward.

Reads: ``call_method to`` nodes with one dtype argument; calls of ``recomputed_cast`` and
``cast_read``. Writes: the casts' op and arguments (name, meta and users kept); removes the
reads.
Guarantees: every value is computed as before, bit for bit (the cast is the same
conversion; ``to`` returns its input when the dtype already matches, and no cast the passes
insert is of that kind); nothing else in the graph changes.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from amp_graph.ops.recompute_ops import recomputed_cast

from .meta import is_cast_read
from .result import PassResult

TO_COPY = torch.ops.aten._to_copy.default


def cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype an amp_graph cast converts to, or None where ``node`` is not one."""
    if node.op == "call_method" and node.target == "to" and len(node.args) == 2 and not node.kwargs:
        dtype = node.args[1]
        return dtype if isinstance(dtype, torch.dtype) else None
    if node.op == "call_function" and node.target is recomputed_cast:
        return node.args[1]  # type: ignore[return-value]
    if node.op == "call_function" and node.target is TO_COPY and set(node.kwargs) == {"dtype"}:
        return node.kwargs["dtype"]  # type: ignore[return-value]
    return None


def aten_casts(gm: fx.GraphModule) -> PassResult:
    """Rewrite each ``x.to(dtype)`` and ``recomputed_cast(x, dtype, why)`` as
    ``aten._to_copy.default(x, dtype=dtype)``, and each ``cast_read(x, cast)`` as ``cast``."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if is_cast_read(node):
            node.replace_all_uses_with(node.args[1])
            gm.graph.erase_node(node)
            continue
        dtype = cast_dtype(node)
        if dtype is None or node.target is TO_COPY:
            continue
        node.op, node.target = "call_function", TO_COPY
        node.args, node.kwargs = (node.args[0],), {"dtype": dtype}
        rewritten += 1
    return PassResult(gm, bool(rewritten), {"casts_as_aten": rewritten})
