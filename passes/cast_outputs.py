"""cast_outputs: return the graph's low-precision outputs in float32 (``Policy.output_dtype``).

A loss the user computes on a compiled model's outputs, outside the graph and outside any
torch.autocast (``loss_fn(fast(x), y)``), runs in the dtype the outputs come in. Under
torch.autocast the same loss is written inside the region, and autocast runs
``cross_entropy``, ``mse_loss`` and its other float32-list ops in float32. With
``output_dtype=torch.float32`` the graph returns each float16, bfloat16 or float8 output in
float32, so that such a loss computes in float32 as autocast's does, on the same values: the
upcast is exact, and its gradient is cast back to the output's dtype, as autocast's cast of
the loss's input does. FSDP2's ``MixedPrecisionPolicy(output_dtype=...)`` and Apex O2's
``cast_model_outputs`` do the same for their modules.

Runs after ``insert_casts``, before ``simplify_casts``: an output that an op in the graph also
reads in float32 shares that op's cast wherever :mod:`passes.sharing` allows, so there is
still one cast per (value, dtype).

Reads: ``meta["amp"]`` (``out_dtype``) of the output node's inputs. Writes: one cast node per
low output value (role ``CAST``, ``cast_for`` ``("output",)``), placed before the output node.
Guarantees: every floating-point tensor the graph returns narrower than float32 is returned
in float32, with the same value; float32, float64, integer and bool outputs, and every
other node, are untouched.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from .insert_casts import make_cast
from .meta import AMP, LOW_FLOATS, short
from .result import PassResult


def _is_low_output(node: fx.Node) -> bool:
    out_dtype = node.meta[AMP].out_dtype
    return isinstance(out_dtype, torch.dtype) and out_dtype in LOW_FLOATS


def cast_outputs(gm: fx.GraphModule, dtype: torch.dtype = torch.float32) -> PassResult:
    """Cast every output the graph computes narrower than float32 to ``dtype`` (float32).

    >>> import torch, amp_graph
    >>> from amp_graph.capture import capture_module
    >>> from amp_graph.passes.assign_dtypes import assign_dtypes
    >>> from amp_graph.passes.classify import classify
    >>> from amp_graph.passes.insert_casts import insert_casts
    >>> gm = capture_module(torch.nn.Linear(2, 2), (torch.randn(1, 2),), {}, device_type="cpu",
    ...                     autocast_dtype=torch.bfloat16).graph_module
    >>> _ = classify(gm, amp_graph.Policy.preset("O1"))
    >>> _ = assign_dtypes(gm, torch.bfloat16)
    >>> _ = insert_casts(gm)
    >>> cast_outputs(gm).stats
    {'outputs_cast': 1, 'casts_inserted': 1}
    """
    if dtype != torch.float32:
        raise ValueError(f"cast_outputs returns low outputs in torch.float32; got {dtype!r}")
    graph = gm.graph
    output = graph.output_node()
    casts: dict[fx.Node, fx.Node] = {}  # one cast per value, however often it is returned
    for value in output.all_input_nodes:
        if value not in casts and _is_low_output(value):
            with graph.inserting_before(output):
                cast = make_cast(graph, value, dtype, "output")
            cast.meta[AMP].detail = (
                f"output_dtype: the output {value.name} "
                f"({short(value.meta[AMP].out_dtype)}) returned in {short(dtype)}"
            )
            casts[value] = cast
    if casts:
        output.args = map_arg(output.args, lambda node: casts.get(node, node))
    # counted among the inserted casts too, so that inserted less removed is what is kept
    stats = {"outputs_cast": len(casts), "casts_inserted": len(casts)}
    return PassResult(gm, modified=bool(casts), stats=stats)


__all__ = ["cast_outputs"]
