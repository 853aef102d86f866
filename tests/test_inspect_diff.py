"""amp_graph.inspect.diff: added, removed and changed nodes, as tables and as a drawing."""

from __future__ import annotations

import dataclasses
import xml.etree.ElementTree as ET

import pytest
import torch
from amp_graph.passes import AMP, UNKNOWN, Role

import amp_graph
from amp_graph.demo.models import DecoderBlock, NanoAttention
from amp_graph.inspect import before_passes, before_simplification, diff
from amp_graph.inspect.style import STATUS_COLORS

SVG_NS = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def block() -> torch.fx.GraphModule:
    """O1 with the casts kept for backward: the diffs below show what simplification did
    alone (recompute_casts, a later pass, would also change every weight cast's target)."""
    torch.manual_seed(0)
    keeping = dataclasses.replace(amp_graph.Policy.preset("O1"), recompute_casts=False)
    return amp_graph.compile(
        DecoderBlock(32, 4), keeping, torch.bfloat16, example_inputs=(torch.randn(2, 8, 32),)
    )


def test_recomputed_casts_show_as_changed_against_the_graph_before_simplification():
    torch.manual_seed(0)
    recompute_all = dataclasses.replace(amp_graph.Policy.preset("O1"), recompute_casts=True)
    compiled = amp_graph.compile(
        DecoderBlock(32, 4), recompute_all, torch.bfloat16, example_inputs=(torch.randn(2, 8, 32),)
    )
    changed = rows(diff(before_simplification(compiled), compiled), "changed")
    recomputed = amp_graph.report(compiled).casts_recomputed
    assert recomputed > 0 and len(changed) == recomputed + 2  # and the k, v linears


def rows(d, change: str) -> dict:
    return {r.node: r for r in d.rows if r.change == change}


def test_the_passes_add_casts_and_change_dtypes(block):
    d = diff(block)
    casts = {n.name for n in block.graph.nodes if n.meta[AMP].role is Role.CAST}
    assert set(rows(d, "added")) == casts  # parameters are read by the captured graph already
    assert not rows(d, "removed")
    changed = rows(d, "changed")
    q = changed["linear"]  # attn.q
    assert (q.op, q.module, q.before, q.after) == ("aten.linear", "attn.q", "fp32", "bf16")
    assert (
        "allow" in q.detail and "aten::linear" in q.detail and "reads layer_norm_bf16" in q.detail
    )
    assert (changed["view"].before, changed["view"].after) == ("fp32", "bf16")
    assert rows(d, "added")["model_attn_q_weight_bf16"].module == "attn.q"
    # fp32 before and after with the same inputs: the layer norm and the residual add
    assert "layer_norm" not in changed and "add" not in changed
    assert d.unchanged + len(d.rows) - len(rows(d, "added")) == len(
        before_passes(block).graph.nodes
    )


def test_diff_against_the_graph_before_simplification_shows_the_removed_casts(block):
    d = diff(before_simplification(block), block)
    removed = rows(d, "removed")
    assert set(removed) == {"layer_norm_bf16_1", "layer_norm_bf16_2"}
    assert len(removed) == block.meta["amp_graph"].stats["casts_removed"]
    assert "the same cast as 'layer_norm_bf16'" in removed["layer_norm_bf16_1"].detail
    assert not rows(d, "added")
    changed = rows(d, "changed")  # the k and v linears now read layer_norm_bf16
    assert set(changed) == {"linear_1", "linear_2"}
    assert [changed[n].module for n in ("linear_1", "linear_2")] == ["attn.k", "attn.v"]


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
    assert {t for t, c in classes.items() if "removed" in c} == {
        "layer_norm_bf16_1",
        "layer_norm_bf16_2",
    }
    assert {t for t, c in classes.items() if "changed" in c} == {"linear_1", "linear_2"}
    edges = {
        g.find(f"{SVG_NS}title").text for g in root.iter(f"{SVG_NS}g") if g.get("class") == "edge"
    }
    assert "layer_norm_bf16_1->linear_1" in edges  # where the removed cast used to go
    for group in root.iter(f"{SVG_NS}g"):
        if "removed" in group.get("class", "").split():
            assert any(el.get("stroke-dasharray") for el in group.iter())
    full = ET.fromstring(diff(block).draw(renderer="networkx").text)
    added = [g for g in full.iter(f"{SVG_NS}g") if "added" in g.get("class", "").split()]
    assert len(added) == diff(block).count("added")


def test_diff_of_two_policies_says_why_casts_went(block):
    policy = block.meta["amp_graph"].policy.override(modules={"attn": "fp32"})
    model = block.model  # the same parameters
    kept_fp32 = amp_graph.compile(model, policy, example_inputs=(torch.randn(2, 8, 32),))
    d = diff(block, kept_fp32)
    attn_ops = {
        n.name
        for n in kept_fp32.graph.nodes
        if n.meta[AMP].role is Role.OP and n.meta[AMP].module_path.startswith("attn")
    }
    assert set(rows(d, "changed")) == attn_ops and len(attn_ops) == 13
    assert all(r.before == "bf16" and r.after == "fp32" for r in rows(d, "changed").values())
    removed = rows(d, "removed")  # ln1's cast to bf16 and the q, k, v, proj weights' casts
    assert set(removed) == {"layer_norm_bf16"} | {
        f"model_attn_{m}_{p}_bf16" for m in ("q", "k", "v", "proj") for p in ("weight", "bias")
    }
    assert removed["model_attn_q_weight_bf16"].detail == (
        "no longer needed: 'linear' now computes in fp32"
    )
    assert not rows(d, "added")


class _ReadsItsDtype(torch.nn.Module):
    """``w.to(q.dtype)``: capture under O1 writes bf16 into the graph, so the graph read
    without its casts multiplies an fp32 ``q`` by a bf16 ``w`` and does not type-check."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(4, 4)
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        return torch.bmm(q[None], self.w.to(q.dtype)[None])[0].relu()


def test_a_graph_that_does_not_type_check_as_written_leaves_those_dtypes_unproven(caplog):
    compiled = amp_graph.compile(
        _ReadsItsDtype(), "O1", torch.bfloat16, example_inputs=(torch.randn(4, 4),)
    )
    with caplog.at_level("INFO", logger="amp_graph.inspect.stages"):
        as_written = before_passes(compiled)
    dtypes = {n.name: n.meta[AMP].out_dtype for n in as_written.graph.nodes}
    assert dtypes["linear"] == torch.float32 and dtypes["to"] == torch.bfloat16
    assert dtypes["bmm"] is UNKNOWN and dtypes["relu"] is UNKNOWN
    assert "node 'bmm' (aten.bmm.default)" in caplog.text
    assert rows(diff(compiled), "changed")["bmm"].before == "?"


def test_two_identical_compiles_diff_empty_and_absorbed_casts_show_once():
    """A node that widens its input itself (softmax's dtype=) is a change against the
    capture, never between two compiles that both made it so."""
    torch.manual_seed(0)
    model, x = NanoAttention(), torch.randn(2, 8, 32)
    first, second = (
        amp_graph.compile(model, "O2", torch.bfloat16, example_inputs=(x,)) for _ in range(2)
    )
    absorbed = [n.name for n in first.graph.nodes if n.meta[AMP].cast_absorbed]
    assert absorbed  # the case: softmax widens its input itself
    same = diff(first, second)
    assert same.rows == [] and same.unchanged == len(second.graph.nodes)
    against_capture = rows(diff(first), "changed")
    for name in absorbed:
        assert "widens its input itself" in against_capture[name].detail
