"""``draw``: the rewritten graph as an SVG, coloured by dtype, casts highlighted."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.fx as fx

from amp_graph.frontends.compiler import unwrap
from amp_graph.frontends.front_door import COMPILE_META

from .modules import module_types
from .render import render
from .stages import STAGE, annotate, is_annotated
from .view import View, build_view, items_of


@dataclass(frozen=True, repr=False)
class SVG:
    """A drawing. Jupyter shows it (``_repr_svg_``); ``str()`` is the SVG document.

    Attributes:
        text: the SVG document.
        renderer: ``"graphviz"`` or ``"networkx"`` (the fallback layout).
        dot: the graphviz DOT program of the same drawing, to render elsewhere.
        nodes: how many boxes it draws.
    """

    text: str
    renderer: str
    dot: str
    nodes: int

    def _repr_svg_(self) -> str:
        return self.text

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"<SVG drawing: {self.nodes} boxes, {len(self.text):,} bytes, by {self.renderer}>"

    def save(self, path: str | Path) -> Path:
        """Write the SVG to ``path`` (``.dot`` writes the DOT program instead)."""
        path = Path(path)
        path.write_text(self.dot if path.suffix == ".dot" else self.text, encoding="utf-8")
        return path


def title_of(gm: fx.GraphModule) -> str:
    """``"DecoderBlock: O1, bf16"``, or the stage of a graph built by :mod:`.stages`."""
    name = type(gm).__name__
    if STAGE in gm.meta:
        return f"{name}: {gm.meta[STAGE]}"
    record = gm.meta.get(COMPILE_META)
    if record is not None:
        from amp_graph.passes.meta import short

        return f"{name}: {record.policy.name}, {short(record.dtype)}"
    return name


def finish(view: View, renderer: str, path: str | Path | None) -> SVG:
    text, used, dot = render(view, renderer)
    svg = SVG(text, used, dot, len(view.boxes))
    if path is not None:
        svg.save(path)
    return svg


def draw(
    compiled: fx.GraphModule,
    *,
    collapse_modules: bool | int = False,
    focus: str | None = None,
    max_nodes: int | None = None,
    path: str | Path | None = None,
    renderer: str = "auto",
    bookkeeping: bool = False,
) -> SVG:
    """Draw a compiled graph: one box per node, coloured by the dtype it computes in.

    Boxes show the node's name, op (``aten.linear · allow``: the rule, for ops the policy
    casts), shape (symbolic sizes by name) and dtype. Fills: fp32 blue, fp16 orange, bf16
    red, integer green, anything else grey; casts are gold hexagons bordered in their
    target dtype's colour. Modules are drawn as dashed clusters holding their ops, their
    parameters and the casts of those (:func:`~amp_graph.inspect.modules.node_modules`).

    Args:
        compiled: what :func:`amp_graph.compile` returned (its last call's graph), a graph
            of the ``torch.compile`` backend, or any GraphModule (one without amp_graph's
            annotations is drawn as written, e.g. ``CompileRecord.original``).
        collapse_modules: ``True`` folds each top-level module into one box counting its
            ops per dtype and its casts; an int folds the modules that many levels deep
            (``2`` folds ``blocks.0``). Casts crossing a folded module's boundary stay.
        focus: a node name (draws the ``max_nodes`` nodes nearest to it, 25 by default)
            or a module path (draws that module); a name that is both means the node.
            Neighbours of the region are drawn as dashed boxes.
        max_nodes: at most this many nodes (without ``focus``: the first ones).
        path: also write the SVG there (``.dot``: the DOT program).
        renderer: ``"auto"`` (graphviz's ``dot`` if installed, else the built-in networkx
            layout; the choice is logged once), ``"graphviz"`` or ``"networkx"``.
        bookkeeping: also draw the nodes that compute no tensor (``x.shape``, ``d // h``);
            by default they are left out, and the drawing's note says how many.

    >>> import torch, amp_graph
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
    >>> c = amp_graph.compile(m, example_inputs=(torch.randn(2, 4),))
    >>> svg = amp_graph.inspect.draw(c, renderer="networkx")
    >>> 'class="node cast bf16"' in svg.text
    True
    """
    compiled = unwrap(compiled)
    gm = compiled if is_annotated(compiled) else annotate(compiled)
    view = build_view(
        items_of(gm),
        title=title_of(compiled),
        types=module_types(gm),
        collapse=collapse_modules,
        focus=focus,
        max_nodes=max_nodes,
        bookkeeping=bookkeeping,
    )
    return finish(view, renderer, path)


__all__ = ["SVG", "draw"]
