"""amp_graph.inspect.draw: the SVG is parsed and checked for colours, casts, clusters and
regions; the fallback renderer runs everywhere, graphviz where `dot` is installed."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch
from amp_graph.passes import AMP, Role

import amp_graph
from amp_graph.inspect import SVG, draw
from amp_graph.inspect import render as render_module
from amp_graph.inspect.style import CAST_FILL, FILL, STATUS_COLORS
from amp_graph.models import GPT, DecoderBlock

SVG_NS = "{http://www.w3.org/2000/svg}"
HAS_DOT = shutil.which("dot") is not None


def parse(svg: SVG) -> dict[str, dict]:
    """title -> {"classes", "fills", "shapes", "text"} for every <g class="node ...">."""
    root = ET.fromstring(svg.text)
    nodes = {}
    for group in root.iter(f"{SVG_NS}g"):
        classes = group.get("class", "").split()
        if "node" not in classes:
            continue
        title = group.find(f"{SVG_NS}title").text
        shapes = [
            el
            for el in group.iter()
            if el.tag in (f"{SVG_NS}polygon", f"{SVG_NS}rect", f"{SVG_NS}path", f"{SVG_NS}ellipse")
        ]
        nodes[title] = {
            "classes": set(classes) - {"node"},
            "fills": [el.get("fill") for el in shapes if el.get("fill") not in (None, "none")],
            "strokes": [el.get("stroke") for el in shapes],
            "shapes": [el.tag.removeprefix(SVG_NS) for el in shapes],
            "text": " ".join(t.text or "" for t in group.iter(f"{SVG_NS}text")),
        }
    return nodes


def groups(svg: SVG, kind: str) -> list[str]:
    root = ET.fromstring(svg.text)
    return [
        g.find(f"{SVG_NS}title").text
        for g in root.iter(f"{SVG_NS}g")
        if kind in g.get("class", "").split()
    ]


@pytest.fixture(scope="module")
def block() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return amp_graph.compile(
        DecoderBlock(32, 4), "O1", torch.bfloat16, example_inputs=(torch.randn(2, 8, 32),)
    )


def test_nodes_are_coloured_by_compute_dtype_and_casts_are_gold_hexagons(block):
    nodes = parse(draw(block, renderer="networkx"))
    assert FILL["bf16"] in nodes["attn_q"]["fills"] and "bf16" in nodes["attn_q"]["classes"]
    assert FILL["fp32"] in nodes["ln1"]["fills"] and "fp32" in nodes["ln1"]["classes"]
    assert FILL["fp32"] in nodes["attn_q_weight"]["fills"]  # the parameter itself stays fp32
    assert FILL["bf16"] in nodes["view"]["fills"]  # follows its bf16 input
    casts = {n.name for n in block.graph.nodes if n.meta[AMP].role is Role.CAST}
    drawn_casts = {title for title, node in nodes.items() if "cast" in node["classes"]}
    assert drawn_casts == casts and len(casts) == amp_graph.report(block).casts_kept
    for title in casts:
        assert nodes[title]["fills"] == [CAST_FILL] and nodes[title]["shapes"] == ["polygon"]
    assert nodes["ln1_bf16"]["strokes"] == [render_module.STROKE["bf16"]]  # border: target dtype


def test_labels_show_op_shape_and_dtype(block):
    nodes = parse(draw(block, renderer="networkx"))
    assert "nn.Linear" in nodes["attn_q"]["text"] and "allow" in nodes["attn_q"]["text"]
    assert "[2, 8, 32] bf16" in nodes["attn_q"]["text"]
    assert "cast fp32 \u2192 bf16 [2, 8, 32]" in nodes["ln1_bf16"]["text"]  # its input's shape
    assert "[2, 8, 32] fp32" in nodes["x"]["text"]


def test_fp16_and_integer_values_have_their_own_colours():
    model = GPT(vocab=32, block=8, dim=16, heads=2, layers=1)
    compiled = amp_graph.compile(
        model, "O1", torch.float16, example_inputs=(torch.zeros(2, 8, dtype=torch.long),)
    )
    nodes = parse(draw(compiled, renderer="networkx"))
    assert FILL["int"] in nodes["idx"]["fills"] and "int" in nodes["idx"]["classes"]
    assert FILL["fp16"] in nodes["head"]["fills"]
    assert "fp16" in nodes["blocks_0_fc_weight_fp16"]["classes"]


def test_edges_follow_the_graph(block):
    svg = draw(block, renderer="networkx")
    edges = set(groups(svg, "edge"))
    assert "ln1->ln1_bf16" in edges and "ln1_bf16->attn_q" in edges and "x->add" in edges
    drawn = set(parse(svg))
    expected = {
        f"{a.name}->{n.name}"
        for n in block.graph.nodes
        for a in n.all_input_nodes
        if n.name in drawn and a.name in drawn
    }
    assert edges == expected


def test_modules_are_clusters_and_non_tensor_nodes_are_left_out(block):
    svg = draw(block, renderer="networkx")
    assert {"cluster_attn", "cluster_attn.q", "cluster_fc"} <= set(groups(svg, "cluster"))
    nodes = parse(svg)
    assert "getattr_1" not in nodes and "floordiv" not in nodes  # x.shape arithmetic
    assert "non-tensor" in svg.text
    assert "getattr_1" in parse(draw(block, renderer="networkx", bookkeeping=True))


def test_collapsed_modules_fold_into_one_box_and_keep_boundary_casts(block):
    nodes = parse(draw(block, renderer="networkx", collapse_modules=True))
    assert {"module:attn", "module:fc", "module:out"} <= set(nodes)
    assert "attn_q" not in nodes and "attn_q_weight_bf16" not in nodes  # inside attn
    assert "cast" in nodes["ln1_bf16"]["classes"]  # ln1 -> attn crosses a module boundary
    assert "13 ops: 13 bf16" in nodes["module:attn"]["text"]
    assert FILL["bf16"] in nodes["module:attn"]["fills"]


def test_collapse_depth_folds_nested_modules():
    model = GPT(vocab=32, block=8, dim=16, heads=2, layers=2)
    compiled = amp_graph.compile(model, example_inputs=(torch.zeros(2, 8, dtype=torch.long),))
    full = parse(draw(compiled, renderer="networkx"))
    folded = parse(draw(compiled, renderer="networkx", collapse_modules=2))
    assert {"module:blocks.0", "module:blocks.1"} <= set(folded)
    assert "DecoderBlock" in folded["module:blocks.0"]["text"]
    assert len(folded) < len(full) / 4


def test_focus_on_a_node_draws_its_neighbourhood(block):
    nodes = parse(draw(block, renderer="networkx", focus="gelu", max_nodes=5))
    drawn = {t for t, n in nodes.items() if "ghost" not in n["classes"]}
    ghosts = {t for t, n in nodes.items() if "ghost" in n["classes"]}
    assert len(drawn) == 5 and {"gelu", "fc", "out"} <= drawn
    assert ghosts and not ghosts & drawn


def test_focus_on_a_module_draws_that_module(block):
    nodes = parse(draw(block, renderer="networkx", focus="attn.q"))
    drawn = {t for t, n in nodes.items() if "ghost" not in n["classes"]}
    assert drawn == {
        "attn_q",
        "attn_q_weight",
        "attn_q_bias",
        "attn_q_weight_bf16",
        "attn_q_bias_bf16",
    }
    assert "ln1_bf16" in nodes and "ghost" in nodes["ln1_bf16"]["classes"]


def test_bad_options_say_what_is_wrong(block):
    with pytest.raises(KeyError, match="Did you mean 'attn'"):
        draw(block, focus="atn")
    with pytest.raises(ValueError, match="collapse_modules"):
        draw(block, collapse_modules=0)
    with pytest.raises(ValueError, match="max_nodes"):
        draw(block, max_nodes=0)
    with pytest.raises(ValueError, match="renderer"):
        draw(block, renderer="matplotlib")


def test_svg_object_displays_and_saves(block, tmp_path):
    svg = draw(block, renderer="networkx", path=tmp_path / "block.svg")
    assert svg._repr_svg_() == svg.text == str(svg)
    assert (tmp_path / "block.svg").read_text() == svg.text
    assert svg.save(tmp_path / "block.dot").read_text().startswith("digraph")
    assert "boxes" in repr(svg) and "networkx" in repr(svg)


def test_the_captured_graph_draws_as_written(block):
    original = block.meta["amp_graph"].original
    nodes = parse(draw(original, renderer="networkx"))
    assert not any("cast" in n["classes"] for n in nodes.values())
    assert FILL["fp32"] in nodes["attn_q"]["fills"]
    assert all(AMP not in n.meta for n in original.graph.nodes)  # not annotated in place


def test_drawing_leaves_the_compiled_module_as_it_was(block):
    code, names = block.code, [n.name for n in block.graph.nodes]
    draw(block, renderer="networkx", collapse_modules=True)
    assert block.code == code and [n.name for n in block.graph.nodes] == names


def test_the_renderer_choice_is_logged_once(block, caplog, monkeypatch):
    monkeypatch.setattr(render_module.shutil, "which", lambda name: None)
    render_module._announce.cache_clear()
    with caplog.at_level(logging.INFO, logger="amp_graph.inspect.render"):
        assert draw(block).renderer == "networkx"
        draw(block, max_nodes=3)
    messages = [r.getMessage() for r in caplog.records if r.name == "amp_graph.inspect.render"]
    assert len(messages) == 1 and "networkx" in messages[0]
    with pytest.raises(RuntimeError, match="dot"):
        draw(block, renderer="graphviz")


def test_dot_source_describes_the_same_drawing(block):
    dot = draw(block, renderer="networkx").dot
    assert dot.startswith("digraph amp_graph {") and dot.rstrip().endswith("}")
    assert 'subgraph "cluster_attn"' in dot and 'subgraph "cluster_attn.q"' in dot
    assert '"ln1_bf16" [' in dot and "shape=hexagon" in dot and f'fillcolor="{CAST_FILL}"' in dot
    assert '"ln1" -> "ln1_bf16";' in dot


@pytest.mark.skipif(not HAS_DOT, reason="graphviz's `dot` is not installed")
def test_graphviz_draws_the_same_classes_and_colours(block):
    svg = draw(block, renderer="graphviz", collapse_modules=False)
    assert svg.renderer == "graphviz"
    nodes = parse(svg)
    fallback = parse(draw(block, renderer="networkx"))
    assert set(nodes) - {"amp_graph_legend"} == set(fallback)
    assert set(groups(svg, "cluster")) == set(groups(draw(block, renderer="networkx"), "cluster"))
    for title, node in fallback.items():
        assert nodes[title]["classes"] == node["classes"]
        assert node["fills"][-1] in nodes[title]["fills"]
    assert "cast" in nodes["ln1_bf16"]["classes"] and CAST_FILL in nodes["ln1_bf16"]["fills"]


def test_status_colours_are_distinct():
    assert len(set(STATUS_COLORS.values())) == 3


def test_large_graphs_draw_quickly():
    model = GPT(vocab=32, block=8, dim=16, heads=2, layers=6)
    compiled = amp_graph.compile(model, example_inputs=(torch.zeros(1, 8, dtype=torch.long),))
    svg = draw(compiled, renderer="networkx")
    assert len(parse(svg)) > 250
    ET.fromstring(svg.text)


def test_the_core_imports_no_plotting_or_layout_library():
    code = (
        "import sys, torch, amp_graph\n"
        "m = torch.nn.Sequential(torch.nn.Linear(2, 2))\n"
        "amp_graph.report(amp_graph.compile(m, example_inputs=(torch.randn(1, 2),)))\n"
        "bad = [m for m in ('networkx', 'matplotlib', 'graphviz', 'pygraphviz', 'IPython')\n"
        "       if m in sys.modules]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_dot_failure_is_reported(monkeypatch):
    monkeypatch.setattr(render_module.shutil, "which", lambda name: "/bin/false")
    with pytest.raises(RuntimeError, match="dot -Tsvg failed"):
        render_module.graphviz_svg("digraph {}")
