"""Where does low precision break? A per-node report against a float32 shadow run.

>>> import torch, amp_graph
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
>>> compiled = amp_graph.compile(model, "O3", dtype=torch.float16)
>>> report = amp_graph.numerics(compiled, torch.randn(2, 4))
>>> report.first_nonfinite is None
True
>>> len(report.rows) > 0 and report.output_error < 1e-2
True

:func:`numerics` runs the compiled graph and a float32 shadow of the same graph
(:mod:`amp_graph.accuracy.shadow`) and returns a :class:`NumericsReport`: one row per node with its
dtype, max |x|, zero/subnormal fractions, non-finite count and relative error against
float32, and for each fp8 quantization the share of its input's nonzero values it flushes
to zero; ``first_nonfinite`` and ``worst(k)`` name nodes and modules; ``plot()`` draws the
error along the graph. ``backward=True`` adds each gradient's underflow and overflow at
the loss scale.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from html import escape
from typing import Any

import torch

from amp_graph.accuracy.autopolicy_search import FLUSH_TOL
from amp_graph.accuracy.shadow import (
    Measure,
    NumericsRow,
    ParamMeasure,
    ShadowResult,
    scale_text,
    shadow_run,
)
from amp_graph.passes.meta import short

from .drawing import SVG
from .html import OPEN_ROWS
from .modules import node_modules
from .style import DTYPE_COLORS
from .table_format import badge, html_table, text_table

HEADERS = (
    "#",
    "node",
    "module",
    "op",
    "dtype",
    "max |x|",
    "fp32 max |x|",
    "zeros",
    "subnormal",
    "underflow",
    "non-finite",
    "rel. error",
)
UNDERFLOW_FINDING = 0.01  # a node with more of its values underflowing is named in findings()
GRAD_HEADERS = ("grad dtype", "grad underflow", "grad non-finite", "grad rel. error")


def _pct(value: float) -> str:
    return "0" if value == 0 else f"{100 * value:.1f}%"


def _dtype(dtype: torch.dtype | None) -> str:
    return "-" if dtype is None else short(dtype)


def _cells(row: NumericsRow, grads: bool) -> list[str]:
    f = row.forward
    cells = [
        str(row.index),
        row.node,
        row.module or "-",
        row.op,
        _dtype(f.dtype),
        f"{f.max_abs:.3g}",
        f"{f.shadow_max_abs:.3g}",
        _pct(f.zeros),
        _pct(f.subnormals),
        _pct(f.underflow),
        str(f.nonfinite),
        f"{f.rel_error:.3g}",
    ]
    if grads:
        g = row.grad
        cells += (
            ["-"] * 4
            if g is None
            else [_dtype(g.dtype), _pct(g.underflow), str(g.new_nonfinite), f"{g.rel_error:.3g}"]
        )
    return cells


@dataclass
class NumericsReport:
    """The measurements of one run: ``rows`` in graph order (inserted casts included),
    ``params`` (``backward=True``), ``outputs`` (the model's floating outputs).

    ``print(report)`` shows the findings and the table; notebooks show it as HTML.
    """

    rows: list[NumericsRow]
    params: list[ParamMeasure]
    outputs: list[Measure]
    policy: str
    dtype: torch.dtype
    scale: float | None
    loss: float | None = None
    shadow_loss: float | None = None
    result: ShadowResult | None = field(default=None, repr=False, compare=False)

    # ---- findings ----------------------------------------------------------------------

    @property
    def first_nonfinite(self) -> NumericsRow | None:
        """The first node, in graph order, with an inf or nan where float32 has a finite
        value (a ``-inf`` attention mask is not a finding), or None."""
        return next((r for r in self.rows if r.forward.new_nonfinite), None)

    @property
    def first_nonfinite_grad(self) -> NumericsRow | None:
        """``backward=True``: the first node, in backward order, whose output gradient has
        an inf or nan where float32's is finite, or None."""
        hits = [r for r in self.rows if r.grad is not None and r.grad.new_nonfinite]
        return hits[-1] if hits else None

    def worst(self, k: int = 5, *, grad: bool = False) -> list[NumericsRow]:
        """The ``k`` nodes furthest from float32 (relative error of the value, or with
        ``grad=True`` of the gradient at their output), worst first."""
        if grad:
            rows = [r for r in self.rows if r.grad is not None]
            return sorted(rows, key=lambda r: -r.grad.rel_error)[:k]  # type: ignore[union-attr]
        rows = [r for r in self.rows if r.role != "input"]
        return sorted(rows, key=lambda r: -r.forward.rel_error)[:k]

    def row(self, node: str) -> NumericsRow:
        for row in self.rows:
            if row.node == node:
                return row
        raise KeyError(f"no node {node!r} in this numerics report")

    @property
    def output_error(self) -> float:
        """The largest relative error of the model's outputs against float32."""
        return max((o.rel_error for o in self.outputs), default=0.0)

    def grad_underflow_by_module(self) -> dict[str, float]:
        """``backward=True``: per module, the fraction of its parameters' gradient
        elements that underflow (zero or subnormal in the low dtype at the loss scale,
        nonzero in float32)."""
        lost: dict[str, float] = defaultdict(float)
        size: dict[str, int] = defaultdict(int)
        for p in self.params:
            lost[p.module] += p.grad.underflow * p.grad.numel
            size[p.module] += p.grad.numel
        return {m: lost[m] / size[m] for m in size if size[m]}

    def findings(self) -> list[str]:
        """The report in sentences: what broke first, what drifted most, the gradients."""
        low = short(self.dtype)
        lines = [
            f"policy {self.policy}, low dtype {low}: {len(self.rows)} nodes measured; "
            f"output relative error {self.output_error:.3g} against float32"
        ]
        first = self.first_nonfinite
        if first is None:
            lines.append("no node produced inf/nan where float32 is finite")
        else:
            where = f" in module '{first.module}'" if first.module else ""
            lines.append(
                f"first non-finite: '{first.node}' ({first.op}{where}, "
                f"{_dtype(first.dtype)}): {first.forward.new_nonfinite} of "
                f"{first.forward.numel} values; float32 max |x| "
                f"{first.forward.shadow_max_abs:.3g}"
                + _range_note(first.forward.shadow_max_abs, first.dtype)
            )
        worst = ", ".join(f"'{r.node}' {r.rel_error:.3g}" for r in self.worst(3))
        lines.append(f"furthest from float32: {worst}")
        flushed = sorted(
            (r for r in self.rows if r.forward.underflow > UNDERFLOW_FINDING),
            key=lambda r: -r.forward.underflow,
        )
        if flushed:
            lines.append(
                "underflow (zero or subnormal here, nonzero in float32): "
                + ", ".join(
                    f"'{r.node}' {_pct(r.forward.underflow)} ({_dtype(r.dtype)})"
                    for r in flushed[:3]
                )
            )
        lines.extend(self._flush_findings())
        if self.scale is not None:
            lines.append(
                f"loss {self.loss or 0.0:.3g} (float32 {self.shadow_loss or 0.0:.3g}), "
                f"gradients at loss scale {scale_text(self.scale)}"
            )
            underflow = self.grad_underflow_by_module()
            if not any(underflow.values()):
                lines.append(f"at scale {scale_text(self.scale)}, no parameter gradient underflows")
            for module, fraction in sorted(underflow.items(), key=lambda kv: -kv[1]):
                if fraction > 0:
                    name = module or "<root>"
                    lines.append(
                        f"at scale {scale_text(self.scale)}, {_pct(fraction)} of '{name}' "
                        f"grads underflow ({low})"
                    )
            overflow = [p.name for p in self.params if p.grad.nonfinite]
            if overflow:
                lines.append(
                    f"at scale {scale_text(self.scale)}, gradients overflow (inf/nan) in "
                    f"{len(overflow)} parameters: {', '.join(overflow[:5])}"
                    + (" ..." if len(overflow) > 5 else "")
                )
            grad_first = self.first_nonfinite_grad
            if grad_first is not None:
                lines.append(f"first non-finite gradient (backward order): '{grad_first.node}'")
        return lines

    def _flush_findings(self) -> list[str]:
        """The fp8 quantizations that flush more than autopolicy's ``flush_tol`` of their
        input's nonzero values to zero (a scale set by one outlier), worst first."""
        flushing = sorted(
            (r for r in self.rows if (r.flushed or 0.0) > FLUSH_TOL),
            key=lambda r: -(r.flushed or 0.0),
        )
        return [
            f"fp8 underflow: '{r.node}' flushes {_pct(r.flushed or 0.0)} of the nonzero values "
            f"of '{r.inputs[0] if r.inputs else '?'}' to zero (one outlier sets the scale; "
            f"autopolicy's flush_tol is {_pct(FLUSH_TOL)})"
            for r in flushing[:3]
        ]

    # ---- views -------------------------------------------------------------------------

    def table(self) -> list[list[str]]:
        grads = self.scale is not None
        headers = list(HEADERS) + (list(GRAD_HEADERS) if grads else [])
        return [headers] + [_cells(r, grads) for r in self.rows]

    def __str__(self) -> str:
        headers, *rows = self.table()
        return "\n".join([*self.findings(), "", text_table(headers, rows)])

    def __repr__(self) -> str:
        first = self.first_nonfinite
        found = f"first non-finite '{first.node}'" if first else "all finite"
        return (
            f"<NumericsReport of {len(self.rows)} nodes: {self.policy}, {short(self.dtype)}; "
            f"{found}; output error {self.output_error:.3g}>"
        )

    def _repr_html_(self) -> str:
        return numerics_html(self)

    def plot(self, width: int = 720, height: int = 340) -> SVG:
        """Relative error against float32 along the graph (log scale), one dot per node
        coloured by its dtype, non-finite nodes as red crosses on the top edge, the first of
        them labelled with its module; modules as shaded bands, named under the axis; a
        legend of the marks."""
        return error_plot(self, width, height)


def _range_note(shadow_max: float, dtype: torch.dtype | None) -> str:
    if dtype is None or not dtype.is_floating_point:
        return ""
    limit = torch.finfo(dtype).max
    return f" > {short(dtype)} max {limit:.6g}" if shadow_max > limit else ""


# ---- HTML and the plot -------------------------------------------------------------------


def _severity(row: NumericsRow) -> str:
    if row.forward.new_nonfinite:
        return "background:#ffd6d6"
    if row.role == "cast":
        return "background:#fff8db"
    return ""


def numerics_html(report: NumericsReport) -> str:
    findings = "<br>".join(escape(line) for line in report.findings())
    headers, *rows = report.table()
    dtype_columns = {i for i, h in enumerate(headers) if h in ("dtype", "grad dtype")}

    def render(column: int, value: object) -> str:
        text = str(value)
        return badge(text, text) if column in dtype_columns else escape(text)

    table = html_table(headers, rows, render, lambda i: _severity(report.rows[i]))
    state = " open" if len(rows) <= OPEN_ROWS else ""
    return (
        "<div style='font-family:sans-serif;font-size:13px'>"
        f"<b>amp_graph numerics</b><br>{findings}"
        f"<details{state}><summary>per-node table ({len(rows)} nodes)</summary>{table}"
        "</details></div>"
    )


def module_bands(modules: list[str], limit: int = 24) -> list[tuple[int, int, str]]:
    """Runs of consecutive rows in one module, ``(first, last, path)``: at the deepest module
    depth that gives at most ``limit`` runs (so that the labels fit under the axis).

    >>> module_bands(["a.0.x", "a.0.y", "a.1.x", "head"], limit=3)
    [(0, 1, 'a.0'), (2, 2, 'a.1'), (3, 3, 'head')]
    """
    deepest = max((m.count(".") + 1 for m in modules if m), default=1)
    chosen: list[tuple[int, int, str]] = []
    for depth in range(1, deepest + 1):
        runs: list[tuple[int, int, str]] = []
        for i, module in enumerate(modules):
            path = ".".join(module.split(".")[:depth]) if module else "<root>"
            if runs and runs[-1][2] == path:
                runs[-1] = (runs[-1][0], i, path)
            else:
                runs.append((i, i, path))
        if len(runs) > limit and chosen:
            break
        chosen = runs
    return chosen


def error_plot(report: NumericsReport, width: int, height: int) -> SVG:
    """See :meth:`NumericsReport.plot`."""
    rows = [r for r in report.rows if r.role != "input"]
    pad_left, pad_bottom, pad_top, pad_right = 58, 96, 34, 10
    plot_w, plot_h = width - pad_left - pad_right, height - pad_bottom - pad_top
    finite = [r.rel_error for r in rows if math.isfinite(r.rel_error) and r.rel_error > 0]
    low = math.floor(math.log10(min(finite))) if finite else -8
    high = max(math.ceil(math.log10(max(finite))) if finite else 0, low + 1)
    bottom = pad_top + plot_h

    def x_of(i: int) -> float:
        return pad_left + plot_w * (i + 0.5) / max(len(rows), 1)

    def y_of(error: float) -> float:
        exponent = math.log10(error) if error > 0 else low
        return pad_top + plot_h * (high - exponent) / (high - low)

    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        "font-family='sans-serif' font-size='10'>",
    ]
    # module bands: alternate shading, a label under the axis per band
    for k, (first, last, path) in enumerate(module_bands([r.module for r in rows])):
        x0 = pad_left + plot_w * first / max(len(rows), 1)
        x1 = pad_left + plot_w * (last + 1) / max(len(rows), 1)
        if k % 2:
            parts.append(
                f"<rect class='band' x='{x0:.1f}' y='{pad_top}' width='{x1 - x0:.1f}' "
                f"height='{plot_h}' fill='#f4f5f7'/>"
            )
        mid = (x0 + x1) / 2
        parts.append(
            f"<text class='module' x='{mid:.1f}' y='{bottom + 12}' text-anchor='end' "
            f"transform='rotate(-40 {mid:.1f} {bottom + 12})'>{escape(path)}</text>"
        )
    parts.append(
        f"<rect x='{pad_left}' y='{pad_top}' width='{plot_w}' height='{plot_h}' "
        "fill='none' stroke='#999'/>"
    )
    for exponent in range(low, high + 1):
        y = y_of(10.0**exponent)
        parts.append(
            f"<line x1='{pad_left}' x2='{pad_left + plot_w}' y1='{y:.1f}' y2='{y:.1f}' "
            "stroke='#e5e5e5'/>"
            f"<text x='{pad_left - 4}' y='{y + 3:.1f}' text-anchor='end'>1e{exponent}</text>"
        )
    first_bad: tuple[float, NumericsRow] | None = None
    for i, row in enumerate(rows):
        x = x_of(i)
        where = f"{row.module or '-'}, {_dtype(row.dtype)}"
        title = escape(f"{row.node} ({where}): {row.rel_error:.3g}")
        if row.forward.new_nonfinite or not math.isfinite(row.rel_error):
            first_bad = first_bad or (x, row)
            parts.append(_cross(x, pad_top, title))
            continue
        color = DTYPE_COLORS.get(_dtype(row.dtype), DTYPE_COLORS["?"])
        parts.append(
            f"<circle cx='{x:.1f}' cy='{y_of(row.rel_error):.1f}' r='2.5' fill='{color}'>"
            f"<title>{title}</title></circle>"
        )
    if first_bad is not None:
        x, row = first_bad
        anchor = "start" if x < pad_left + plot_w / 2 else "end"
        parts.append(
            f"<text class='first-nonfinite' x='{x + (6 if anchor == 'start' else -6):.1f}' "
            f"y='{pad_top + 14}' text-anchor='{anchor}' fill='#d62728'>first non-finite: "
            f"{escape(row.node)} ({escape(row.module or '<root>')})</text>"
        )
    y_mid = pad_top + plot_h / 2
    parts.append(
        f"<text x='12' y='{y_mid:.1f}' text-anchor='middle' transform='rotate(-90 12 "
        f"{y_mid:.1f})'>relative error against float32 (log)</text>"
    )
    parts.append(
        f"<text x='{pad_left + plot_w / 2}' y='{height - 6}' text-anchor='middle'>nodes in "
        f"graph order ({len(rows)}), grouped by module</text>"
    )
    kinds = {_dtype(r.dtype) for r in rows}
    named = [k for k in DTYPE_COLORS if k in kinds and k != "?"]
    parts.append(_legend(named + (["other"] if kinds - set(named) else []), pad_left))
    parts.append("</svg>")
    return SVG("".join(parts), renderer="plot", dot="", nodes=len(rows))


def _cross(x: float, y: float, title: str) -> str:
    return (
        f"<g stroke='#d62728' stroke-width='2'><title>{title}</title>"
        f"<line x1='{x - 4:.1f}' y1='{y - 4}' x2='{x + 4:.1f}' y2='{y + 4}'/>"
        f"<line x1='{x - 4:.1f}' y1='{y + 4}' x2='{x + 4:.1f}' y2='{y - 4}'/></g>"
    )


def _legend(dtypes: list[str], left: float) -> str:
    """One dot per dtype drawn, and the cross: what each mark means."""
    items, x = [], left
    for name in dtypes:
        color = DTYPE_COLORS.get(name, DTYPE_COLORS["?"])
        items.append(
            f"<circle cx='{x + 4}' cy='14' r='3' fill='{color}'/>"
            f"<text x='{x + 10}' y='17'>{escape(name)}</text>"
        )
        x += 16 + 7 * len(name)
    items.append(
        _cross(x + 4, 14, "non-finite")
        + f"<text x='{x + 12}' y='17'>inf/nan where float32 is finite</text>"
    )
    return f"<g class='legend'>{''.join(items)}</g>"


# ---- the entry point ---------------------------------------------------------------------


def numerics(
    compiled: Any,
    *inputs: Any,
    backward: bool = False,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    scale: float | None = None,
    **kwargs: Any,
) -> NumericsReport:
    """Run ``compiled`` on ``inputs`` next to a float32 shadow and measure every node.

    Args:
        compiled: what :func:`amp_graph.compile` returned (or a GraphModule it rewrote).
        inputs / kwargs: the forward's arguments, as for a call.
        backward: also back-propagate ``loss_fn(output)`` (the output itself when it is a
            scalar), scaled by ``scale``, and measure every gradient: per node (at its
            output) and per parameter (underflow and overflow at that scale).
        scale: the loss scale; default 2**16 for float16 (``GradScaler``'s initial scale),
            else 1.

    Nothing about the model changes: parameters, buffers, ``.grad`` and the RNG state are
    the same afterwards. The cost is about one extra float32 forward (and backward), plus a
    few reductions per node.
    """
    result = shadow_run(compiled, inputs, kwargs, backward=backward, loss_fn=loss_fn, scale=scale)
    return report_of(result)


def report_of(result: ShadowResult) -> NumericsReport:
    """A :class:`NumericsReport` over a :func:`amp_graph.accuracy.shadow.shadow_run` result."""
    record = result.graph_module.meta.get("amp_graph")
    policy = record.policy.name if record is not None else "?"
    modules = node_modules(result.graph_module)  # casts and parameters filed as elsewhere
    for row in result.nodes:
        row.module = modules[row.node]
    return NumericsReport(
        rows=result.nodes,
        params=result.params,
        outputs=result.outputs,
        policy=policy,
        dtype=result.dtype,
        scale=result.scale,
        loss=result.loss,
        shadow_loss=result.shadow_loss,
        result=result,
    )
