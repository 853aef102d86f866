"""HTML for notebooks and files: dtype badges in text, explanations, the legend and a
standalone page. The report's own HTML is in :mod:`amp_graph.inspect.report`."""

from __future__ import annotations

import re
from html import escape

from .style import DTYPE_CLASSES, STROKE
from .table_format import badge

OPEN_ROWS = 60
"""Reports with more nodes than this show their per-node table folded (``<details>``)."""

_DTYPE_WORD = re.compile(r"\b(fp32|fp16|bf16)\b")


def with_badges(text: str) -> str:
    """Escape ``text`` and turn the dtype words in it into coloured badges."""
    return _DTYPE_WORD.sub(lambda m: badge(m.group(1), m.group(1)), escape(text))


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
    "with_badges",
]
