"""HTML for notebooks and files: the report, explanations, and a standalone page."""

from __future__ import annotations

import re
from html import escape
from typing import TYPE_CHECKING

from .style import DTYPE_CLASSES, STROKE
from .tables import COLUMNS, badge, bytes_text, html_table

if TYPE_CHECKING:
    from .report import Report

OPEN_ROWS = 60
"""Reports with more nodes than this show their per-node table folded (``<details>``)."""

_DTYPE_WORD = re.compile(r"\b(fp32|fp16|bf16)\b")


def with_badges(text: str) -> str:
    """Escape ``text`` and turn the dtype words in it into coloured badges."""
    return _DTYPE_WORD.sub(lambda m: badge(m.group(1), m.group(1)), escape(text))


def report_summary_html(report: Report) -> str:
    """The report's totals: policy, ops per output dtype, casts and bytes."""
    per_dtype = " ".join(f"{badge(k, k)}&nbsp;{v}" for k, v in sorted(report.ops_by_dtype.items()))
    proven = "" if report.exact else " (dtypes not proven)"
    return (
        '<div style="font-family:sans-serif;font-size:13px;margin-bottom:4px">'
        f"<b>amp_graph report</b>: policy <b>{escape(report.policy)}</b>, low dtype "
        f"{badge(report.dtype, report.dtype)}{proven}<br>ops by output dtype: {per_dtype}<br>"
        f"casts inserted {report.casts_inserted}, removed by simplification "
        f"{report.casts_removed}, kept <b>{report.casts_kept}</b>; bytes cast per call: "
        f"{bytes_text(report.cast_bytes)}</div>"
    )


def report_html(report: Report) -> str:
    """The report as a notebook shows it: totals, then the per-node table (folded when
    long); dtypes as badges, inserted casts on a gold background."""
    headers = COLUMNS
    rows = [r.cells() for r in report.rows]

    def render(column: int, value: object) -> str:
        text = str(value)
        return badge(text, text) if column in (5, 6) else escape(text)

    def row_style(index: int) -> str:
        return "background:#fff8db" if report.rows[index].role == "cast" else ""

    table = html_table(headers, rows, render, row_style)
    state = " open" if len(rows) <= OPEN_ROWS else ""
    return (
        f"<div>{report_summary_html(report)}<details{state}><summary>per-node table "
        f"({len(rows)} nodes)</summary>{table}</details></div>"
    )


def explanation_html(text: str) -> str:
    """An explanation (one sentence per line) as a boxed paragraph with dtype badges."""
    first, *rest = text.splitlines() or [""]
    body = "".join(f"<div>{with_badges(line)}</div>" for line in rest)
    return (
        f'<div style="border-left:4px solid {STROKE["fp32"]};padding:4px 10px;'
        f'font-family:sans-serif;font-size:13px;line-height:1.5">'
        f"<div><b>{with_badges(first)}</b></div>{body}</div>"
    )


def legend_html() -> str:
    """The drawing's colour key, for pages that show drawings."""
    items = " ".join(badge(c, c) for c in DTYPE_CLASSES) + " " + badge("cast", cast=True)
    return f'<p style="font-family:sans-serif;font-size:12px">{items}</p>'


def page(title: str, sections: list[tuple[str, str]]) -> str:
    """A standalone HTML document: ``sections`` are (heading, inner HTML) pairs."""
    body = "".join(f"<h2>{escape(heading)}</h2>\n{inner}\n" for heading, inner in sections)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{escape(title)}</title>\n<style>body{{font-family:sans-serif;margin:24px;"
        "color:#212529}} h2{font-size:16px;margin-top:28px} svg{max-width:100%;height:auto}"
        f'</style>\n</head>\n<body>\n<h1 style="font-size:20px">{escape(title)}</h1>\n'
        f"{body}</body>\n</html>\n"
    )


__all__ = [
    "explanation_html",
    "legend_html",
    "page",
    "report_html",
    "report_summary_html",
    "with_badges",
]
