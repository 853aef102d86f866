"""Views to SVG: with graphviz's ``dot`` where it is installed, else with our own writer.

Both produce the same document structure, graphviz's: a ``<g class="graph">`` holding
``<g class="cluster">``, ``<g class="edge">`` and ``<g class="node ...">`` groups, each
with a ``<title>`` (the node's name) and shapes whose ``fill`` is the node's colour. Node
groups carry their :attr:`Box.css_class` (``"node cast bf16"``), so a drawing can be
checked, or restyled, the same way whichever renderer drew it.

The python ``graphviz`` package and pygraphviz drive the same ``dot`` program, so ``dot``
on the PATH is what decides; it is run as a subprocess.
"""

from __future__ import annotations

import functools
import logging
import shutil
import subprocess
from html import escape

from .layout import CAST_TIP, CLUSTER_HEAD, FONT_SIZE, LINE_H, PAD_Y, Lane, Rect, layout
from .style import (
    CAST_FILL,
    CLUSTER_COLOR,
    DTYPE_CLASSES,
    EDGE_COLOR,
    FILL,
    STATUS_COLORS,
    STROKE,
)
from .view import Box, View

log = logging.getLogger(__name__)

RENDERERS = ("auto", "graphviz", "networkx")
FONT = "Helvetica,Arial,sans-serif"
LEGEND_H = 44


@functools.cache
def _announce(renderer: str) -> None:
    """Say once per process which renderer draws."""
    if renderer == "graphviz":
        log.info("amp_graph.draw: laying out with graphviz (%s)", shutil.which("dot"))
    else:
        log.warning(
            "amp_graph.draw: graphviz's `dot` is not installed; using the built-in "
            "networkx layout (install graphviz for tidier drawings of large graphs)"
        )


def choose_renderer(requested: str = "auto") -> str:
    """``"graphviz"`` if requested or available, else ``"networkx"``; logs the choice once."""
    if requested not in RENDERERS:
        raise ValueError(f"renderer is one of {RENDERERS}; got {requested!r}")
    if requested == "graphviz" and shutil.which("dot") is None:
        raise RuntimeError("renderer='graphviz' needs graphviz's `dot` program on the PATH")
    renderer = (
        requested if requested != "auto" else ("graphviz" if shutil.which("dot") else "networkx")
    )
    _announce(renderer)
    return renderer


def style_of(box: Box) -> tuple[str, str, float, str]:
    """(fill, stroke, stroke width, dash) of a box."""
    fill, stroke, width, dash = FILL[box.dtype], STROKE[box.dtype], 1.0, ""
    if box.kind == "cast":
        fill, width = CAST_FILL, 2.0
    if box.kind == "ghost":
        fill, dash = "#ffffff", "4,3"
    if box.status:
        stroke, width = STATUS_COLORS[box.status], 3.0
    if box.status == "removed":
        fill, dash = "#f8f9fa", "5,3"
    return fill, stroke, width, dash


# ---- graphviz -----------------------------------------------------------------------


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _dot_node(box: Box) -> str:
    fill, stroke, width, dash = style_of(box)
    lines = "".join(f"<BR/>{escape(line)}" for line in box.lines)
    label = f"<<B>{escape(box.title)}</B>{lines}>"
    shape = {"cast": "hexagon", "module": "box3d"}.get(box.kind, "box")
    styles = ["filled"] + (["rounded"] if shape == "box" else []) + (["dashed"] if dash else [])
    fontcolor = "#868e96" if box.kind == "ghost" or box.status == "removed" else "#212529"
    attrs = {
        "label": label,
        "shape": shape,
        "style": _quote(",".join(styles)),
        "fillcolor": _quote(fill),
        "color": _quote(stroke),
        "penwidth": str(width),
        "fontcolor": _quote(fontcolor),
        "class": _quote(box.css_class),
        "tooltip": _quote(box.tooltip or box.title),
    }
    if shape == "hexagon":
        attrs["margin"] = '"0,0"'  # graphviz pads polygons generously
    return f"{_quote(box.key)} [" + ", ".join(f"{k}={v}" for k, v in attrs.items()) + "];"


def _legend_dot() -> str:
    cells = (
        "".join(f'<TD BGCOLOR="{FILL[c]}" COLOR="{STROKE[c]}">{c}</TD>' for c in DTYPE_CLASSES)
        + f'<TD BGCOLOR="{CAST_FILL}">cast</TD>'
    )
    return (
        '"amp_graph_legend" [shape=plaintext, class="legend", label=<<TABLE BORDER="0" '
        f'CELLBORDER="1" CELLSPACING="3"><TR>{cells}</TR></TABLE>>];'
    )


def to_dot(view: View) -> str:
    """The view as a graphviz DOT program (``draw(...).dot``)."""
    label = escape(view.title) + "".join(f"<BR/>{escape(n)}" for n in view.notes)
    lines = [
        "digraph amp_graph {",
        f'  graph [rankdir=TB, fontname="{FONT}", fontsize=12, nodesep=0.2, ranksep=0.3, '
        f"labelloc=t, label=<{label}>];",
        f'  node [fontname="{FONT}", fontsize={FONT_SIZE}, margin="0.1,0.04"];',
        f'  edge [color="{EDGE_COLOR}", arrowsize=0.6];',
        "  " + _legend_dot(),
    ]
    inside: dict[str, list[str]] = {}
    for box in view.boxes.values():
        inside.setdefault(box.cluster, []).append(_dot_node(box))
    subclusters: dict[str, list[str]] = {}
    for path in view.clusters:
        subclusters.setdefault(view.parent(path), []).append(path)

    def emit(path: str, indent: str) -> None:
        for child in subclusters.get(path, []):
            lines.append(f"{indent}subgraph {_quote('cluster_' + child)} {{")
            lines.append(
                f'{indent}  label={_quote(view.clusters[child])}; style="rounded,dashed"; '
                f'color="{CLUSTER_COLOR}"; fontcolor="#495057"; fontsize=10;'
            )
            emit(child, indent + "  ")
            lines.append(f"{indent}}}")
        lines.extend(indent + node for node in inside.get(path, []))

    emit("", "  ")
    lines.extend(f"  {_quote(a)} -> {_quote(b)};" for a, b in view.edges)
    lines.append("}")
    return "\n".join(lines) + "\n"


def graphviz_svg(dot_source: str) -> str:
    """Run ``dot -Tsvg``; a RuntimeError with dot's message if it fails."""
    dot = shutil.which("dot")
    if dot is None:
        raise RuntimeError("graphviz's `dot` program is not on the PATH")
    done = subprocess.run(
        [dot, "-Tsvg"], input=dot_source.encode(), capture_output=True, timeout=120, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"dot -Tsvg failed: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout.decode()


# ---- the fallback writer ------------------------------------------------------------


def _num(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".")


def _shape(box: Box, r: Rect) -> str:
    fill, stroke, width, dash = style_of(box)
    paint = f'fill="{fill}" stroke="{stroke}" stroke-width="{_num(width)}"'
    if dash:
        paint += f' stroke-dasharray="{dash}"'
    if box.kind == "cast":
        mid = r.y + r.h / 2
        points = [
            (r.x, mid),
            (r.x + CAST_TIP, r.y),
            (r.x + r.w - CAST_TIP, r.y),
            (r.x + r.w, mid),
            (r.x + r.w - CAST_TIP, r.bottom),
            (r.x + CAST_TIP, r.bottom),
        ]
        return f'<polygon {paint} points="{" ".join(f"{_num(x)},{_num(y)}" for x, y in points)}"/>'
    shadow = ""
    if box.kind == "module":  # a second outline behind, like graphviz's box3d
        shadow = (
            f'<rect x="{_num(r.x + 3)}" y="{_num(r.y - 3)}" width="{_num(r.w)}" '
            f'height="{_num(r.h)}" rx="3" fill="{fill}" stroke="{stroke}"/>'
        )
    return shadow + (
        f'<rect {paint} x="{_num(r.x)}" y="{_num(r.y)}" width="{_num(r.w)}" '
        f'height="{_num(r.h)}" rx="4"/>'
    )


def _text(box: Box, r: Rect) -> str:
    color = "#868e96" if box.kind == "ghost" or box.status == "removed" else "#212529"
    y = r.y + PAD_Y + LINE_H - 3
    out = [
        f'<text text-anchor="middle" x="{_num(r.cx)}" y="{_num(y)}" font-weight="bold" '
        f'fill="{color}">{escape(box.title)}</text>'
    ]
    for line in box.lines:
        y += LINE_H
        out.append(
            f'<text text-anchor="middle" x="{_num(r.cx)}" y="{_num(y)}" '
            f'fill="{color}">{escape(line)}</text>'
        )
    return "".join(out)


def _curve(x1: float, y1: float, x2: float, y2: float) -> str:
    """A cubic from (x1, y1) down to (x2, y2), vertical at both ends."""
    bend = max(6.0, (y2 - y1) / 2)
    return f" C{_num(x1)},{_num(y1 + bend)} {_num(x2)},{_num(y2 - bend)} {_num(x2)},{_num(y2)}"


def _edge(a: Rect, b: Rect, lanes: list[Lane]) -> str:
    arrow_len = 7.0
    if b.y >= a.bottom:  # downwards, through the lanes reserved for it
        x, y = a.cx, a.bottom
        path = f"M{_num(x)},{_num(y)}"
        for lane_x, top, bottom in lanes:
            path += _curve(x, y, lane_x, top) + f" L{_num(lane_x)},{_num(bottom)}"
            x, y = lane_x, bottom
        tip_x, tip_y, dx, dy = b.cx, b.y, 0.0, 1.0
        path += _curve(x, y, tip_x, tip_y - arrow_len)
    else:  # drawn above or beside its source: leave and enter on the right
        x1, y1, tip_x, tip_y = a.x + a.w, a.y + a.h / 2, b.x + b.w, b.y + b.h / 2
        bend = 40.0 + abs(tip_y - y1) / 8
        dx, dy = -1.0, 0.0
        path = (
            f"M{_num(x1)},{_num(y1)} C{_num(x1 + bend)},{_num(y1)} "
            f"{_num(tip_x + bend)},{_num(tip_y)} {_num(tip_x + arrow_len)},{_num(tip_y)}"
        )
    base_x, base_y = tip_x - arrow_len * dx, tip_y - arrow_len * dy
    wing = [(base_x - 3.5 * dy, base_y + 3.5 * dx), (base_x + 3.5 * dy, base_y - 3.5 * dx)]
    arrow = " ".join(f"{_num(x)},{_num(y)}" for x, y in [(tip_x, tip_y), *wing, (tip_x, tip_y)])
    return (
        f'<path fill="none" stroke="{EDGE_COLOR}" d="{path}"/>'
        f'<polygon fill="{EDGE_COLOR}" stroke="{EDGE_COLOR}" points="{arrow}"/>'
    )


def _legend(title: str, notes: list[str]) -> tuple[str, float]:
    parts = [f'<text x="8" y="16" font-size="12" font-weight="bold">{escape(title)}</text>']
    x = 8.0
    for name in (*DTYPE_CLASSES, "cast"):
        fill = CAST_FILL if name == "cast" else FILL[name]
        stroke = STROKE["other"] if name == "cast" else STROKE[name]
        parts.append(
            f'<rect x="{_num(x)}" y="24" width="44" height="14" rx="3" fill="{fill}" '
            f'stroke="{stroke}"/><text x="{_num(x + 22)}" y="35" text-anchor="middle">'
            f"{name}</text>"
        )
        x += 50
    if notes:
        text = "; ".join(notes)
        parts.append(f'<text x="{_num(x + 6)}" y="35" fill="#495057">{escape(text)}</text>')
        x += 6 + len(text) * 6.5
    return '<g class="legend">' + "".join(parts) + "</g>", x


def fallback_svg(view: View) -> str:
    """Lay out ``view`` with :func:`layout.layout` and write the SVG."""
    placed = layout(view, top=LEGEND_H)
    legend, legend_w = _legend(view.title, view.notes)
    width, height = max(placed.width, legend_w) + 16, placed.height + 16
    body = [
        f"<title>{escape(view.title)}</title>",
        f'<rect fill="white" stroke="none" x="-8" y="-8" width="{_num(width)}" '
        f'height="{_num(height)}"/>',
        legend,
    ]
    for i, (path, r) in enumerate(sorted(placed.clusters.items(), key=lambda kv: kv[0].count("."))):
        body.append(
            f'<g id="clust{i + 1}" class="cluster"><title>cluster_{escape(path)}</title>'
            f'<rect fill="none" stroke="{CLUSTER_COLOR}" stroke-dasharray="5,3" x="{_num(r.x)}" '
            f'y="{_num(r.y)}" width="{_num(r.w)}" height="{_num(r.h)}" rx="6"/>'
            f'<text x="{_num(r.x + 8)}" y="{_num(r.y + CLUSTER_HEAD - 4)}" font-size="10" '
            f'fill="#495057">{escape(view.clusters[path])}</text></g>'
        )
    for i, (a, b) in enumerate(view.edges):
        path = _edge(placed.boxes[a], placed.boxes[b], placed.routes.get((a, b), []))
        body.append(
            f'<g id="edge{i + 1}" class="edge"><title>{escape(a)}&#45;&gt;{escape(b)}'
            f"</title>{path}</g>"
        )
    for i, (key, box) in enumerate(view.boxes.items()):
        r = placed.boxes[key]
        body.append(
            f'<g id="node{i + 1}" class="node {box.css_class}"><title>{escape(key)}'
            f"</title><desc>{escape(box.tooltip)}</desc>{_shape(box, r)}{_text(box, r)}"
            "</g>"
        )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_num(width)}" height="{_num(height)}" '
        f'viewBox="-8 -8 {_num(width)} {_num(height)}" font-family="{FONT}" '
        f'font-size="{FONT_SIZE}">\n<g id="graph0" class="graph">\n'
        + "\n".join(body)
        + "\n</g>\n</svg>\n"
    )


def render(view: View, renderer: str = "auto") -> tuple[str, str, str]:
    """(svg text, renderer used, DOT source) for a view."""
    chosen = choose_renderer(renderer)
    dot = to_dot(view)
    svg = graphviz_svg(dot) if chosen == "graphviz" else fallback_svg(view)
    return svg, chosen, dot


__all__ = ["RENDERERS", "choose_renderer", "fallback_svg", "graphviz_svg", "render", "to_dot"]
