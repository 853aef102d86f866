"""Copies of a GraphModule that share its modules and tensors (one job: copy a graph).

What every edit-a-copy needs (the compile's record of the graph before the passes, the
backend's hand-off to inductor, ``autopolicy``'s trials, the monitor's instrumented
graphs): the nodes copied with their names and ``meta``, the parameters, buffers and
submodules not copied but shared, so that the copy reads the model the original reads.
"""

from __future__ import annotations

import torch.fx as fx


def copy_graph(gm: fx.GraphModule) -> fx.Graph:
    """A copy of ``gm``'s graph, owned by no module yet (nodes keep names and meta)."""
    graph = fx.Graph(owning_module=None)
    graph.output(graph.graph_copy(gm.graph, {}))
    return graph


def graph_module_over(gm: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule running ``graph`` over ``gm``'s own children and tensors: every child
    is shared (fx's constructor would rebuild the modules on an attribute path from the
    parts the graph reads; a step graph's code reads the build's modules by name)."""
    copied = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    copied.meta.update(getattr(gm, "meta", {}))
    for name, child in gm.named_children():
        copied.add_module(name, child)
    return copied


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph, sharing its submodules and tensors."""
    return graph_module_over(gm, copy_graph(gm))


__all__ = ["copy_graph", "copy_graph_module", "graph_module_over"]
