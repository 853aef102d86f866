"""The graph at other stages of ``compile``, annotated so that it can be drawn and diffed.

``compile`` keeps the captured graph before the passes (``CompileRecord.original``). These
helpers rebuild, from a copy of it, the graph as written (:func:`before_passes`) and the
graph with every planned cast but before ``simplify_casts`` (:func:`before_simplification`).
The compiled module and the recorded original are never modified.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from amp_graph.frontends.compiler import compile_record
from amp_graph.passes import AMP
from amp_graph.passes.assign_dtypes import FakeRunError, assign_dtypes
from amp_graph.passes.classify import classify
from amp_graph.passes.graph_copy import copy_graph_module
from amp_graph.passes.pipeline import amp_passes
from amp_graph.policy import Policy

log = logging.getLogger(__name__)

STAGE = "amp_graph_stage"
"""``gm.meta`` key naming the stage of a graph these helpers built, for drawing titles."""


def is_annotated(gm: fx.GraphModule) -> bool:
    """Whether every node carries ``meta["amp"]`` (a compiled graph, or one of these)."""
    return all(AMP in node.meta for node in gm.graph.nodes)


def annotate(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with ``meta["amp"]`` describing it as written (nothing recast).

    ``classify`` under policy O0 names each op and its module; ``assign_dtypes`` proves
    dtypes and shapes on the placeholders' example values (``meta["val"]``). Read without
    its casts, a graph captured under a policy may not type-check (a dtype the model read
    at capture is written into it): the dtypes from the node that fails on are left
    unproven (``?``), and the log says which node.
    """
    copy = copy_graph_module(gm)
    classify(copy, Policy.preset("O0"))
    try:
        assign_dtypes(copy, torch.bfloat16)  # O0 computes nothing in low precision
    except FakeRunError as error:
        log.info("%s; as written, the dtypes from there on are not proven", error)
    copy.meta[STAGE] = "as written"
    return copy


def _original(compiled: fx.GraphModule) -> fx.GraphModule:
    record = compile_record(compiled)
    if record.original is None:
        raise ValueError(
            "this compiled module kept no copy of its captured graph "
            "(CompileRecord.original is None), so there is nothing to compare it with"
        )
    return record.original


def before_passes(compiled: fx.GraphModule) -> fx.GraphModule:
    """The graph ``compile`` captured, before any pass, with its dtypes as written.

    >>> import torch, amp_graph
    >>> from amp_graph.inspect import before_passes
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    >>> c = amp_graph.compile(m, example_inputs=(torch.randn(2, 4),))
    >>> [n.meta["amp"].out_dtype for n in before_passes(c).graph.nodes if n.name == "linear"]
    [torch.float32]
    """
    gm = annotate(_original(compiled))
    gm.meta[STAGE] = "before the passes"
    return gm


def before_simplification(compiled: fx.GraphModule) -> fx.GraphModule:
    """The graph after ``insert_casts`` and before ``simplify_casts``: one cast per
    (consumer, input), as torch.autocast casts at every call. Diff it with the compiled
    module to see what cast simplification removed."""
    record = compile_record(compiled)
    gm = copy_graph_module(_original(compiled))
    for name, run in amp_passes(record.policy, record.dtype):
        if name == "simplify_casts":
            break
        run(gm)
    gm.recompile()
    gm.meta[STAGE] = "before cast simplification"
    return gm


__all__ = ["STAGE", "annotate", "before_passes", "before_simplification", "is_annotated"]
