"""Seeing the transformed graph: drawings, diffs and data-flow summaries.

>>> import torch, amp_graph
>>> from amp_graph import inspect
>>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
>>> c = amp_graph.compile(m, "O1", example_inputs=(torch.randn(2, 4),))
>>> svg = inspect.draw(c, renderer="networkx")  # in Jupyter: shown as the drawing
>>> print(inspect.diff(c).summary())
Sequential: before the passes -> Sequential: O1, bf16: 3 added, 0 removed, 2 changed, 4 unchanged

This package sits at the edge of amp_graph: the compiler never imports it, and it imports
no plotting library (drawings are SVG written here, laid out by graphviz's ``dot`` when it
is installed and by a networkx-based layout otherwise).

* :func:`draw` - the compiled graph as an :class:`SVG`, coloured by dtype, casts
  highlighted; modules as clusters or collapsed; a region with ``focus``/``max_nodes``.
* :func:`diff` - what the passes added, removed and changed, as a table and a drawing.
* :func:`dataflow` - per module: ops per dtype, and bytes cast forward and backward.
* :func:`before_passes`, :func:`before_simplification` - the graph at earlier stages.
"""

from .drawing import SVG, draw
from .module_flow import Conversion, DataFlow, ModuleFlow, dataflow
from .pass_diff import Diff, DiffRow, diff
from .stages import before_passes, before_simplification

__all__ = [
    "SVG",
    "Conversion",
    "DataFlow",
    "Diff",
    "DiffRow",
    "ModuleFlow",
    "before_passes",
    "before_simplification",
    "dataflow",
    "diff",
    "draw",
]
