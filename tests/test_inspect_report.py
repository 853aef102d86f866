"""Reports and explanations: aligned text in terminals, HTML in notebooks."""

from __future__ import annotations

import pytest
import torch

import amp_graph
from amp_graph.inspect.html import OPEN_ROWS
from amp_graph.inspect.style import FILL
from amp_graph.models import GPT, DecoderBlock
from amp_graph.report import Explanation


@pytest.fixture(scope="module")
def block() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return amp_graph.compile(
        DecoderBlock(32, 4), "O1", torch.bfloat16, example_inputs=(torch.randn(2, 8, 32),)
    )


def test_report_text_columns_line_up(block):
    lines = str(amp_graph.report(block)).splitlines()
    rule = lines[1]
    starts = [i for i, c in enumerate(rule) if c == "-" and (i == 0 or rule[i - 1] == " ")]
    for line in lines[2:]:
        if not line:
            break
        assert all(line[s - 1] == " " for s in starts[1:] if s < len(line))


def test_report_html_has_badges_cast_rows_and_totals(block):
    report = amp_graph.report(block)
    html = report._repr_html_()
    assert html.count("<tr") == len(report.rows) + 1
    assert f"background:{FILL['bf16']}" in html and f"background:{FILL['fp32']}" in html
    assert html.count("background:#fff8db") == report.casts_kept  # cast rows
    assert "<details open>" in html and "kept <b>14</b>" in html


def test_long_reports_fold_their_node_table():
    model = GPT(vocab=32, block=8, dim=16, heads=2, layers=2)
    report = amp_graph.report(
        amp_graph.compile(model, example_inputs=(torch.zeros(1, 8, dtype=torch.long),))
    )
    assert len(report.rows) > OPEN_ROWS
    html = report._repr_html_()
    assert "<details>" in html and "<details open>" not in html
    assert html.index("kept") < html.index("<details>")  # totals stay visible


def test_explain_is_a_string_with_one_sentence_per_line(block):
    text = amp_graph.explain(block, "ln1")
    assert isinstance(text, str) and isinstance(text, Explanation)
    lines = text.splitlines()
    assert lines[0] == "'ln1' (nn.LayerNorm in module 'ln1') returns fp32."
    assert lines[1].startswith("Its rule is deny")
    assert any(line.startswith("Its output is cast by 'ln1_bf16'") for line in lines)
    html = text._repr_html_()
    assert "<b>" in html and f"background:{FILL['fp32']}" in html
    cast = amp_graph.explain(block, "ln1_bf16")
    assert cast.splitlines()[0].startswith("'ln1_bf16' is a cast amp_graph inserted")


def test_explain_prints_unquoted_in_ipython(block):
    class Printer:
        def __init__(self) -> None:
            self.out = ""

        def text(self, value: str) -> None:
            self.out += value

    printer = Printer()
    text = amp_graph.explain(block, "attn_q")
    text._repr_pretty_(printer, False)
    assert printer.out == str(text)


def test_report_views_of_the_compiled_module(block):
    report = amp_graph.report(block)
    # the kept casts, and the weight and bias of q, k, v, proj, fc and out as graph values
    assert report.diff().count("added") == report.casts_kept + 12
    assert report.dataflow(depth=1).total.forward_casts == 14
    assert report.draw(renderer="networkx", collapse_modules=True).nodes < 20
    detached = amp_graph.report(block)
    detached.graph_module = None
    with pytest.raises(ValueError, match=r"amp_graph\.report"):
        detached.diff()


def test_docstring_examples_run():
    import doctest
    import importlib

    for name in ("", ".dataflow", ".diff", ".draw", ".stages", ".tables"):
        module = importlib.import_module(f"amp_graph.inspect{name}")
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, f"amp_graph.inspect{name}: {result}"
