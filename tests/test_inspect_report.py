"""Reports and explanations: aligned text in terminals, HTML in notebooks."""

from __future__ import annotations

import pytest
import torch

import amp_graph
from amp_graph.demo.models import GPT, DecoderBlock
from amp_graph.inspect.html import OPEN_ROWS
from amp_graph.inspect.report import Explanation
from amp_graph.inspect.style import FILL


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
    assert repr(report) == f"<Report of {len(report.rows)} nodes: policy O1, bf16; casts kept 14>"


def test_long_reports_fold_their_node_table():
    model = GPT(vocab=32, block=8, dim=16, heads=2, layers=2)
    report = amp_graph.report(
        amp_graph.compile(model, example_inputs=(torch.zeros(1, 8, dtype=torch.long),))
    )
    assert len(report.rows) > OPEN_ROWS
    html = report._repr_html_()
    assert "<details>" in html and "<details open>" not in html
    assert html.index("kept") < html.index("<details>")  # totals stay visible


def test_report_rows_name_aten_ops_and_file_parameters_under_their_module(block):
    report = amp_graph.report(block)
    q = report.row("linear")  # attn.q's linear: export names the aten op
    assert (q.op, q.module, q.rule, q.compute, q.out) == (
        "aten.linear",
        "attn.q",
        "allow",
        "bf16",
        "bf16",
    )
    assert q.casts_in == ["layer_norm_bf16", "model_attn_q_weight_bf16", "model_attn_q_bias_bf16"]
    weight = report.row("model_attn_q_weight")  # a get_attr of self.model.attn.q.weight
    assert (weight.op, weight.role, weight.module, weight.out) == (
        "get_attr",
        "param",
        "attn.q",
        "fp32",
    )
    assert report.row("model_attn_q_weight_bf16").module == "attn.q"  # its cast, too
    assert report.row("layer_norm_bf16").module == "ln1"  # a cast belongs where its input does
    assert report.row("x").module == "" and report.row("add").module == ""  # the block's own
    assert report.row("scaled_dot_product_attention").module == "attn"


def test_explain_is_a_string_with_one_sentence_per_line(block):
    text = amp_graph.explain(block, "layer_norm")
    assert isinstance(text, str) and isinstance(text, Explanation)
    lines = text.splitlines()
    assert lines[0] == "'layer_norm' (aten.layer_norm in module 'ln1') returns fp32."
    assert lines[1].startswith("Its rule is deny")
    assert any(line.startswith("Its output is cast by 'layer_norm_bf16'") for line in lines)
    html = text._repr_html_()
    assert "<b>" in html and f"background:{FILL['fp32']}" in html
    cast = amp_graph.explain(block, "layer_norm_bf16")
    assert cast.splitlines()[0].startswith("'layer_norm_bf16' is a cast amp_graph inserted")
    weight = amp_graph.explain(block, "model_attn_q_weight")
    assert (
        weight.splitlines()[0]
        == "'model_attn_q_weight' (get_attr in module 'attn.q') returns fp32."
    )


def test_explain_says_which_nodes_an_override_can_change(block):
    gelu = amp_graph.explain(block, "gelu")
    assert "decided by the default level" in gelu
    assert "To change it: Policy.override(nodes={'gelu': 'fp32'})" in gelu
    view = amp_graph.explain(block, "view")  # a view of attn.q's output: fixed
    assert "fixed by what it is" in view and "To change it" not in view
    # what it says holds: a node override leaves the view as it was
    policy = amp_graph.Policy.preset("O1").override(nodes={"view": "fp32", "gelu": "fp32"})
    overridden = amp_graph.report(
        amp_graph.compile(DecoderBlock(32, 4), policy, example_inputs=(torch.randn(2, 8, 32),))
    )
    assert overridden.row("view") == amp_graph.report(block).row("view")
    assert overridden.row("gelu").compute == "fp32"


def test_explain_of_a_module_path_lists_its_ops(block):
    with pytest.raises(
        KeyError, match=r"'attn\.q' is a module, not a node.*its ops are 'linear'\."
    ):
        amp_graph.explain(block, "attn.q")
    with pytest.raises(KeyError, match=r"'ln1' is a module.*'layer_norm'"):
        amp_graph.explain(block, "ln1")
    with pytest.raises(KeyError, match=r"no node named 'lienar'.*Did you mean 'linear'"):
        amp_graph.explain(block, "lienar")


def test_explain_prints_unquoted_in_ipython(block):
    class Printer:
        def __init__(self) -> None:
            self.out = ""

        def text(self, value: str) -> None:
            self.out += value

    printer = Printer()
    text = amp_graph.explain(block, "linear")
    text._repr_pretty_(printer, False)
    assert printer.out == str(text)


def test_report_views_of_the_compiled_module(block):
    report = amp_graph.report(block)
    # the kept casts: the captured graph reads the parameters already (get_attr)
    assert report.diff().count("added") == report.casts_kept == 14
    assert report.dataflow(depth=1).total.forward_casts == 14
    assert report.draw(renderer="networkx", collapse_modules=True).nodes < 20
    detached = amp_graph.report(block)
    detached.graph_module = None
    with pytest.raises(ValueError, match=r"amp_graph\.report"):
        detached.diff()


def test_docstring_examples_run():
    import doctest
    import importlib

    for name in (
        "",
        ".module_flow",
        ".pass_diff",
        ".drawing",
        ".modules",
        ".numerics",
        ".report",
        ".stages",
        ".table_format",
    ):
        module = importlib.import_module(f"amp_graph.inspect{name}")
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, f"amp_graph.inspect{name}: {result}"


def test_the_tools_need_a_captured_graph_and_show_the_last_calls():
    compiled = amp_graph.compile(DecoderBlock(32, 4), "O1", torch.bfloat16)
    for tool in (amp_graph.report, amp_graph.inspect.dataflow, amp_graph.inspect.diff):
        with pytest.raises(RuntimeError, match=r"not been captured yet.*example_inputs"):
            tool(compiled)
    compiled(torch.randn(2, 8, 32))
    compiled(torch.randn(2, 8, 32, dtype=torch.bfloat16))  # a new dtype: a second graph
    first, second = compiled.graph_modules
    assert amp_graph.report(compiled).graph_module is second
    assert amp_graph.report(first).row("x").out == "fp32"
    assert amp_graph.report(compiled).row("x").out == "bf16"
    assert amp_graph.report(compiled).row("x").casts_out == ["x_fp32"]  # up for ln1 (deny)
    assert not amp_graph.report(first).row("x").casts_out
