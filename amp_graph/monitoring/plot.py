"""The monitor's heatmap: one statistic per probe (or module) and logging step, as SVG.

As NVIDIA's fp8 analysis tools draw it: a row per measured tensor, labelled with its node (or
module), role and dtype, a column per logging step, the colour on a log scale with a legend
that gives its range; a zero is grey, a cell of inf/NaN elements black (a black bar where
only some are), and a step with no value for that row is left blank.
Plain SVG: no plotting library.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from .history import History

ROW_HEIGHT = 14
CELL_WIDTH = 18
LABEL_WIDTH = 300
TOP = 46
LEGEND_HEIGHT = 64
ZERO_COLOUR = "#e9ecef"
NONFINITE_COLOUR = "#212529"  # a cell with inf/NaN elements: never a zero's grey


class Heatmap:
    """An SVG drawing: Jupyter shows it; ``str()`` and ``.text`` are the document."""

    def __init__(self, text: str, rows: list[str], steps: list[int]) -> None:
        self.text, self.rows, self.steps = text, rows, steps

    def _repr_svg_(self) -> str:
        return self.text

    def __str__(self) -> str:
        return self.text

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.text)


def _colour(fraction: float) -> str:
    """From pale yellow (0) to dark red (1), the "YlOrRd" ramp in five stops."""
    stops = [(255, 255, 204), (254, 217, 118), (253, 141, 60), (227, 26, 28), (128, 0, 38)]
    position = min(max(fraction, 0.0), 1.0) * (len(stops) - 1)
    low = min(int(position), len(stops) - 2)
    t = position - low
    r, g, b = (round(a + (c - a) * t) for a, c in zip(stops[low], stops[low + 1], strict=True))
    return f"#{r:02x}{g:02x}{b:02x}"


def matrix(
    history: History, stat: str, by: str
) -> tuple[list[str], list[int], list[list[float | None]]]:
    """``(row labels, steps, values[row][step])``. ``by="node"``: a row per probe (node and
    role); ``by="module"``: a row per (module, role), fractions weighted by elements, ``amax``
    the largest, ``nonfinite`` summed."""
    if by not in ("node", "module"):
        raise ValueError(f"plot by= is 'node' or 'module'; got {by!r}")
    if stat not in history.stats:
        raise ValueError(f"the monitor has no statistic {stat!r}; it has {list(history.stats)}")
    steps = history.steps
    cells: dict[str, dict[int, tuple[float, int]]] = {}
    for row in history:
        label = _label(row, by)
        value, numel = row[stat], row["numel"]
        old = cells.setdefault(label, {}).get(row["step"])
        if old is not None:  # several probes in one module and role
            if stat == "amax":
                value = max(value, old[0])
            elif stat == "nonfinite":
                value += old[0]
            else:
                value = (value * numel + old[0] * old[1]) / (numel + old[1])
            numel += old[1]
        cells[label][row["step"]] = (value, numel)
    labels = list(cells)
    values = [[cells[label].get(s, (None, 0))[0] for s in steps] for label in labels]
    return labels, steps, values


def _label(row: dict, by: str) -> str:
    where = row["node"] if by == "node" else (row["module"] or "<root>")
    label = f"{where} · {row['role']} ({row['dtype']}"
    return label + (f" in {row['run_dtype']})" if row["run_dtype"] != row["dtype"] else ")")


def nonfinite_cells(history: History, by: str) -> dict[tuple[str, int], str]:
    """``(row label, step) -> "all" | "some"``: the cells whose measured elements were all, or
    partly, inf or NaN (their statistics describe the finite elements alone, if any). Empty
    where the monitor does not count non-finite values."""
    if "nonfinite" not in history.stats:
        return {}
    counts: dict[tuple[str, int], list[int]] = {}
    for row in history:
        total = counts.setdefault((_label(row, by), row["step"]), [0, 0])
        total[0] += int(row["nonfinite"])
        total[1] += int(row["numel"])
    return {cell: "all" if bad >= numel else "some" for cell, (bad, numel) in counts.items() if bad}


def heatmap(history: History, stat: str = "underflow", by: str = "node") -> Heatmap:
    """Draw ``stat`` for every row of ``history`` over its steps (see the module). Rows come
    in the history's order: the order a step computes their values, forward then backward.
    A cell whose elements were all inf/NaN is black, one with some has a black bar: without
    the mark, a statistic of no finite element would draw as a zero."""
    labels, steps, values = matrix(history, stat, by)
    marks = nonfinite_cells(history, by)
    positive = [v for row in values for v in row if v]
    low = min(positive) if positive else 1.0
    high = max(positive) if positive else 1.0
    span = math.log10(high) - math.log10(low)

    def fill(value: float | None, mark: str | None) -> str:
        if value is None:
            return "none"
        if mark == "all":
            return NONFINITE_COLOUR
        if value == 0:
            return ZERO_COLOUR
        return _colour(0.5 if span == 0 else (math.log10(value) - math.log10(low)) / span)

    width = LABEL_WIDTH + CELL_WIDTH * max(len(steps), 1) + 20
    height = TOP + ROW_HEIGHT * len(labels) + LEGEND_HEIGHT
    unit = (
        "fraction of elements"
        if stat not in ("amax", "nonfinite")
        else ("largest finite |x|" if stat == "amax" else "inf and NaN elements")
    )
    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        "font-family='sans-serif' font-size='10'>",
        f"<text x='4' y='14' font-size='12' font-weight='bold'>{html.escape(stat)} per "
        f"{'probe' if by == 'node' else 'module'} and logging step ({html.escape(unit)})</text>",
        f"<text x='{LABEL_WIDTH}' y='{TOP - 8}'>logging step →</text>",
        f"<text x='4' y='{TOP - 8}'>{'node' if by == 'node' else 'module'} · role (dtype)</text>",
    ]
    for j, step in enumerate(steps):
        if j % max(1, len(steps) // 12) == 0:
            x = LABEL_WIDTH + j * CELL_WIDTH
            out.append(f"<text x='{x}' y='{TOP - 20}'>{step}</text>")
    for i, label in enumerate(labels):
        y = TOP + i * ROW_HEIGHT
        out.append(f"<text x='4' y='{y + 10}'>{html.escape(label)}</text>")
        for j, value in enumerate(values[i]):
            x = LABEL_WIDTH + j * CELL_WIDTH
            mark = marks.get((label, steps[j]))
            title = "no value" if value is None else f"{value:.4g}"
            title += {"all": " (every element inf/NaN)", "some": " (some inf/NaN)"}.get(mark, "")
            out.append(
                f"<rect x='{x}' y='{y}' width='{CELL_WIDTH - 1}' height='{ROW_HEIGHT - 1}' "
                f"fill='{fill(value, mark)}' stroke='#dee2e6'><title>{html.escape(label)}, step "
                f"{steps[j]}: {html.escape(title)}</title></rect>"
            )
            if mark == "some":
                out.append(
                    f"<rect x='{x}' y='{y + ROW_HEIGHT - 5}' width='{CELL_WIDTH - 1}' "
                    f"height='4' fill='{NONFINITE_COLOUR}'/>"
                )
    y = TOP + ROW_HEIGHT * len(labels) + 16
    out.append(f"<text x='4' y='{y + 9}'>legend (log scale):</text>")
    for k in range(20):
        out.append(
            f"<rect x='{110 + k * 8}' y='{y}' width='8' height='10' fill='{_colour(k / 19)}'/>"
        )
    out.append(f"<text x='110' y='{y + 22}'>{low:.3g}</text>")
    out.append(f"<text x='{110 + 20 * 8}' y='{y + 22}' text-anchor='end'>{high:.3g}</text>")
    out.append(
        f"<rect x='290' y='{y}' width='10' height='10' fill='{ZERO_COLOUR}' stroke='#adb5bd'/>"
        f"<text x='304' y='{y + 9}'>0</text>"
        f"<rect x='330' y='{y}' width='10' height='10' fill='none' stroke='#adb5bd'/>"
        f"<text x='344' y='{y + 9}'>not measured that step</text>"
    )
    if marks:
        out.append(
            f"<rect x='290' y='{y + 14}' width='10' height='10' fill='{NONFINITE_COLOUR}'/>"
            f"<text x='304' y='{y + 23}'>every element inf/NaN</text>"
            f"<rect x='430' y='{y + 14}' width='10' height='10' fill='{ZERO_COLOUR}' "
            f"stroke='#adb5bd'/><rect x='430' y='{y + 20}' width='10' height='4' "
            f"fill='{NONFINITE_COLOUR}'/><text x='444' y='{y + 23}'>some inf/NaN</text>"
        )
    out.append("</svg>")
    return Heatmap("\n".join(out), labels, steps)
