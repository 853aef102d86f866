"""amp_graph.inspect.diff: added, removed and changed nodes, as tables and as a drawing."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
import torch
from amp_graph.passes import AMP, Role

import amp_graph
from amp_graph.inspect import before_passes, before_simplification, diff
from amp_graph.inspect.style import STATUS_COLORS
from amp_graph.models import DecoderBlock

SVG_NS = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def block() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return amp_graph.compile(
        DecoderBlock(32, 4), "O1", torch.bfloat16, example_inputs=(torch.randn(2, 8, 32),)
    )


def rows(d, change: str) -> dict:
    return {r.node: r for r in d.rows if r.change == change}


def test_the_passes_add_casts_and_parameters_and_change_dtypes(block):
    d = diff(block)
    casts = {n.name for n in block.graph.nodes if n.meta[AMP].role is Role.CAST}
    params = {n.name for n in block.graph.nodes if n.meta[AMP].role is Role.PARAM}
    assert set(rows(d, "added")) == casts | params
    assert not rows(d, "removed")
    changed = rows(d, "changed")
    assert (changed["attn_q"].before, changed["attn_q"].after) == ("fp32", "bf16")
    assert "allow" in changed["attn_q"].detail and "F.linear" in changed["attn_q"].detail
    assert (changed["view"].before, changed["view"].after) == ("fp32", "bf16")
    assert "ln1" not in changed and "add" not in changed  # fp32 before and after, same inputs
    assert d.unchanged + len(d.rows) - len(rows(d, "added")) == len(
        before_passes(block).graph.nodes
    )


def test_diff_against_the_graph_before_simplification_shows_the_removed_casts(block):
    d = diff(before_simplification(block), block)
    removed = rows(d, "removed")
    assert set(removed) == {"ln1_bf16_1", "ln1_bf16_2"}
    assert len(removed) == block.meta["amp_graph"].stats["casts_removed"]
    assert "the same cast as 'ln1_bf16'" in removed["ln1_bf16_1"].detail
    assert not rows(d, "added")
    assert set(rows(d, "changed")) == {"attn_k", "attn_v"}  # they now read ln1_bf16


def test_one_argument_report_diff_and_the_raw_original_agree(block):
    expected = [(r.change, r.node, r.before, r.after) for r in diff(block).rows]
    assert [
        (r.change, r.node, r.before, r.after) for r in amp_graph.report(block).diff().rows
    ] == expected
    original = block.meta["amp_graph"].original
    assert [(r.change, r.node, r.before, r.after) for r in diff(original, block).rows] == expected


def test_diff_text_is_an_aligned_table(block):
    text = str(diff(block))
    lines = text.splitlines()
    header, rule = lines[0], lines[1]
    columns = [i for i, c in enumerate(rule) if c == "-" and (i == 0 or rule[i - 1] == " ")]
    assert header.split()[:3] == ["node", "op", "module"]
    for line in lines[2:]:
        if not line:
            break
        assert line[0] in "+-~"
        for start in columns[1:]:
            assert line[start - 1] == " "
    assert "added" in lines[-1] and "unchanged" in lines[-1]


def test_diff_html_has_a_row_per_change(block):
    d = diff(block)
    html = d._repr_html_()
    assert html.count("<tr>") == len(d.rows) + 1
    assert STATUS_COLORS["added"] in html and "background:" in html  # dtype badges


def test_diff_drawing_marks_added_changed_and_removed_nodes(block):
    d = diff(before_simplification(block), block)
    svg = d.draw(renderer="networkx")
    root = ET.fromstring(svg.text)
    classes = {
        g.find(f"{SVG_NS}title").text: set(g.get("class").split())
        for g in root.iter(f"{SVG_NS}g")
        if "node" in g.get("class", "").split()
    }
    assert {t for t, c in classes.items() if "removed" in c} == {"ln1_bf16_1", "ln1_bf16_2"}
    assert {t for t, c in classes.items() if "changed" in c} == {"attn_k", "attn_v"}
    edges = {
        g.find(f"{SVG_NS}title").text for g in root.iter(f"{SVG_NS}g") if g.get("class") == "edge"
    }
    assert "ln1_bf16_1->attn_k" in edges  # where the removed cast used to go
    for group in root.iter(f"{SVG_NS}g"):
        if "removed" in group.get("class", "").split():
            assert any(el.get("stroke-dasharray") for el in group.iter())
    full = ET.fromstring(diff(block).draw(renderer="networkx").text)
    added = [g for g in full.iter(f"{SVG_NS}g") if "added" in g.get("class", "").split()]
    assert len(added) == diff(block).count("added")
