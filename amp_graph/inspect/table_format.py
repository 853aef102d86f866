"""Tables as aligned text (terminals) and as HTML (notebooks), with dtype badges."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from html import escape

from .style import CAST_FILL, FILL, STROKE

COLUMNS = ("node", "op", "module", "rule", "decided by", "compute", "out", "casts in")
"""The columns of :class:`~amp_graph.inspect.report.Report`'s table."""

UNKNOWN_BYTES = "unknown (symbolic or unknown sizes)"
"""How a byte count reads when the graph's sizes are symbolic (one graph serving several
input sizes) or no example value reached the tensor."""

Cell = str | int | float | None
CELL_STYLE = "padding:2px 8px;border-bottom:1px solid #e9ecef;text-align:{align};white-space:nowrap"
TABLE_STYLE = (
    "border-collapse:collapse;font-family:ui-monospace,SFMono-Regular,Menlo,monospace;"
    "font-size:12px;margin:4px 0"
)


def fmt(value: Cell) -> str:
    """Numbers with thousands separators, None as "-"."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.3g}"
    return str(value)


def bytes_text(value: int | None) -> str:
    """``1,234`` or :data:`UNKNOWN_BYTES`."""
    return UNKNOWN_BYTES if value is None else f"{value:,}"


def _numeric(value: Cell) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Cell]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned.

    >>> print(text_table(["module", "casts"], [["attn", 6], ["fc", 12]]))
    module  casts
    ------  -----
    attn        6
    fc         12
    """
    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [
        bool(rows) and all(_numeric(r[i]) or r[i] is None for r in rows)
        for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def badge(text: str, dtype_class: str | None = None, cast: bool = False) -> str:
    """A dtype as a small coloured label (``fp32`` blue, ``bf16`` red, ...)."""
    if cast:
        fill, stroke = CAST_FILL, "#b08900"
    elif dtype_class in FILL:
        fill, stroke = FILL[dtype_class], STROKE[dtype_class]
    else:
        return escape(text)
    return (
        f'<span style="background:{fill};border:1px solid {stroke};border-radius:3px;'
        f'padding:0 4px">{escape(text)}</span>'
    )


def html_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[Cell]],
    render: Callable[[int, Cell], str] | None = None,
    row_style: Callable[[int], str] | None = None,
) -> str:
    """An HTML table; ``render(column, value)`` returns a cell's inner HTML (escaped text
    by default), ``row_style(row_index)`` extra CSS for a row."""
    numeric = [
        bool(rows) and all(_numeric(r[i]) or r[i] is None for r in rows)
        for i in range(len(headers))
    ]
    head = "".join(
        f'<th style="{CELL_STYLE.format(align="right" if num else "left")};'
        f'border-bottom:2px solid #adb5bd">{escape(h)}</th>'
        for h, num in zip(headers, numeric, strict=True)
    )
    body = []
    for index, row in enumerate(rows):
        cells = "".join(
            f'<td style="{CELL_STYLE.format(align="right" if num else "left")}">'
            f"{render(i, value) if render else escape(fmt(value))}</td>"
            for i, (value, num) in enumerate(zip(row, numeric, strict=True))
        )
        style = row_style(index) if row_style else ""
        body.append(f'<tr style="{style}">{cells}</tr>' if style else f"<tr>{cells}</tr>")
    return (
        f'<table style="{TABLE_STYLE}"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table>"
    )


__all__ = ["UNKNOWN_BYTES", "badge", "bytes_text", "fmt", "html_table", "text_table"]
