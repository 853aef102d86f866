"""verify: the graph is well formed and its dtypes are the plan's.

Checks, in order:

1. ``graph.lint()``: topological order, defined names, targets that exist;
2. every node carries ``meta["amp"]``;
3. every input of a planned node has the planned dtype (or is not castable: integers,
   bools, float64), so no planned cast is missing;
4. the dtypes the graph really produces, propagated afresh on fake values through the
   rewritten graph, equal the ``out_dtype`` the plan recorded, wherever both are known.

Reads everything, writes nothing. Raises :class:`VerificationError` naming the node.
"""

from __future__ import annotations

import torch.fx as fx
from torch.fx.node import map_arg

from .assign_dtypes import propagate_dtypes
from .meta import AMP, UNKNOWN, Role, behind_reads, is_castable, short, tensor_facts
from .result import PassResult


class VerificationError(AssertionError):
    """The rewritten graph breaks an invariant the passes promise."""


def _comparable(a: object, b: object) -> bool:
    return a is not UNKNOWN and b is not UNKNOWN


def _check_planned_inputs(node: fx.Node) -> None:
    amp = node.meta[AMP]
    if amp.role is not Role.OP or amp.compute_dtype is None:
        return

    def check(value: fx.Node) -> fx.Node:
        read = behind_reads(value)  # a consumer's read of a shared cast: that cast
        for fact in tensor_facts(read.meta[AMP].out_dtype):  # each tensor of a tuple too
            if is_castable(fact) and fact != amp.compute_dtype:
                raise VerificationError(
                    f"node {node.name!r} is planned to compute in {short(amp.compute_dtype)} "
                    f"but input {read.name!r} holds a {short(fact)} tensor: a cast is missing"
                )
        return value

    map_arg((node.args, node.kwargs), check)


def _same(planned: object, actual: object) -> bool:
    if isinstance(planned, (tuple, list)) and isinstance(actual, (tuple, list)):
        return len(planned) == len(actual) and all(
            _same(p, a) for p, a in zip(planned, actual, strict=True)
        )
    return not _comparable(planned, actual) or planned == actual


def verify(gm: fx.GraphModule, propagate: bool = True, planned_inputs: bool = True) -> PassResult:
    """Check the invariants above; return the GraphModule unchanged.

    Before casts are inserted the plan is not yet in the graph: pass ``propagate=False,
    planned_inputs=False`` to check only structure and metadata.
    """
    gm.graph.lint()
    for node in gm.graph.nodes:
        if AMP not in node.meta:
            raise VerificationError(f"node {node.name!r} has no meta['amp']")
    if planned_inputs:
        for node in gm.graph.nodes:
            _check_planned_inputs(node)
    checked = 0
    if propagate:
        actual = propagate_dtypes(gm)
        for node in gm.graph.nodes:
            if node.op == "output":
                continue
            planned = node.meta[AMP].out_dtype
            if not _same(planned, actual[node]):
                raise VerificationError(
                    f"node {node.name!r}: the plan says its output is {short(planned)}, but the "
                    f"rewritten graph produces {short(actual[node])}"
                )
            checked += 1
    return PassResult(gm, modified=False, stats={"dtypes_checked": checked})


__all__ = ["VerificationError", "verify"]
