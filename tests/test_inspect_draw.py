"""amp_graph.inspect.draw: the SVG is parsed and checked for colours, casts, clusters and
regions; the fallback renderer runs everywhere, graphviz where `dot` is installed."""

from __future__ import annotations

import ast
import logging
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from amp_graph.passes import AMP, Role
from amp_graph.passes.meta import inputs_behind_reads

import amp_graph
from amp_graph.demo.models import GPT, DecoderBlock
from amp_graph.inspect import SVG, draw
from amp_graph.inspect import render as render_module
from amp_graph.inspect.modules import node_modules
from amp_graph.inspect.style import CAST_FILL, FILL, STATUS_COLORS

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
    assert FILL["bf16"] in nodes["linear"]["fills"] and "bf16" in nodes["linear"]["classes"]
    assert FILL["fp32"] in nodes["layer_norm"]["fills"] and "fp32" in nodes["layer_norm"]["classes"]
    assert FILL["fp32"] in nodes["model_attn_q_weight"]["fills"]  # the parameter stays fp32
    assert "param" in nodes["model_attn_q_weight"]["classes"]
    assert FILL["bf16"] in nodes["view"]["fills"]  # follows its bf16 input
    casts = {n.name for n in block.graph.nodes if n.meta[AMP].role is Role.CAST}
    drawn_casts = {title for title, node in nodes.items() if "cast" in node["classes"]}
    assert drawn_casts == casts and len(casts) == amp_graph.report(block).casts_kept
    for title in casts:
        assert nodes[title]["fills"] == [CAST_FILL] and nodes[title]["shapes"] == ["polygon"]
    assert nodes["layer_norm_bf16"]["strokes"] == [render_module.STROKE["bf16"]]  # target dtype


def test_labels_show_op_shape_and_dtype(block):
    nodes = parse(draw(block, renderer="networkx"))
    assert "aten.linear \u00b7 allow" in nodes["linear"]["text"]
    assert "[2, 8, 32] bf16" in nodes["linear"]["text"]
    assert "aten.layer_norm \u00b7 deny" in nodes["layer_norm"]["text"]
    assert "cast fp32 \u2192 bf16 [2, 8, 32]" in nodes["layer_norm_bf16"]["text"]  # input's shape
    assert "parameter [32, 32] fp32" in nodes["model_attn_q_weight"]["text"]
    assert "cast fp32 \u2192 bf16 [32, 32]" in nodes["model_attn_q_weight_bf16"]["text"]
    assert "[2, 8, 32] fp32" in nodes["x"]["text"]


def test_fp16_and_integer_values_have_their_own_colours():
    model = GPT(vocab=32, block=8, dim=16, heads=2, layers=1)
    compiled = amp_graph.compile(
        model, "O1", torch.float16, example_inputs=(torch.zeros(2, 8, dtype=torch.long),)
    )
    nodes = parse(draw(compiled, renderer="networkx"))
    assert FILL["int"] in nodes["idx"]["fills"] and "int" in nodes["idx"]["classes"]
    assert FILL["int"] in nodes["arange"]["fills"]  # the positions
    modules = node_modules(compiled.graph_module)
    [head] = [  # the head's linear
        n.name
        for n in compiled.graph.nodes
        if modules[n.name] == "head" and n.meta[AMP].role is Role.OP
    ]
    assert FILL["fp16"] in nodes[head]["fills"] and "aten.linear" in nodes[head]["text"]
    assert "fp16" in nodes["model_blocks_0_fc_weight_fp16"]["classes"]


def test_edges_follow_the_graph(block):
    svg = draw(block, renderer="networkx")
    edges = set(groups(svg, "edge"))
    assert "layer_norm->layer_norm_bf16" in edges and "layer_norm_bf16->linear" in edges
    assert "model_attn_q_weight->model_attn_q_weight_bf16" in edges and "x->add" in edges
    drawn = set(parse(svg))
    # a consumer's read of a shared cast is drawn as the edge from the cast
    expected = {
        f"{a.name}->{n.name}"
        for n in block.graph.nodes
        for a in inputs_behind_reads(n)
        if n.name in drawn and a.name in drawn
    }
    assert edges == expected


def test_modules_are_clusters_holding_their_parameters_and_casts(block):
    svg = draw(block, renderer="networkx")
    clusters = set(groups(svg, "cluster"))
    assert {"cluster_attn", "cluster_attn.q", "cluster_fc"} <= clusters
    assert not any("_empty_nn_module_stack" in c for c in clusters)
    dot = draw(block, renderer="networkx").dot
    q_cluster = dot.split('subgraph "cluster_attn.q"')[1].split("}")[0]
    for name in ("linear", "model_attn_q_weight", "model_attn_q_bias", "model_attn_q_weight_bf16"):
        assert f'"{name}" [' in q_cluster
    assert '"layer_norm_bf16" [' not in q_cluster  # it belongs to ln1, where its input is


def test_non_tensor_nodes_are_left_out():
    # A second input size captures with symbolic sizes: sym_size nodes feed the views.
    compiled = amp_graph.compile(DecoderBlock(32, 4), "O1", torch.bfloat16)
    compiled(torch.randn(2, 8, 32))
    compiled(torch.randn(3, 5, 32))
    sizes = [n.name for n in compiled.graph.nodes if "sym_size" in str(n.target)]
    assert sizes
    svg = draw(compiled, renderer="networkx")
    assert not set(sizes) & set(parse(svg)) and "non-tensor" in svg.text
    assert not any("_empty_nn_module_stack" in c for c in groups(svg, "cluster"))
    assert set(sizes) <= set(parse(draw(compiled, renderer="networkx", bookkeeping=True)))


def test_collapsed_modules_fold_into_one_box_and_keep_boundary_casts(block):
    nodes = parse(draw(block, renderer="networkx", collapse_modules=True))
    assert {"module:attn", "module:fc", "module:out"} <= set(nodes)
    assert "linear" not in nodes and "model_attn_q_weight_bf16" not in nodes  # inside attn
    assert "cast" in nodes["layer_norm_bf16"]["classes"]  # ln1 -> attn crosses a boundary
    assert "13 ops: 13 bf16" in nodes["module:attn"]["text"]  # 4 linears, views, attention
    assert "8 casts inside" in nodes["module:attn"]["text"]  # q, k, v, proj: weight and bias
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
    assert len(drawn) == 5 and {"gelu", "linear_4", "linear_5"} <= drawn  # fc, gelu, out
    assert ghosts and not ghosts & drawn


def test_focus_on_a_module_draws_that_module(block):
    nodes = parse(draw(block, renderer="networkx", focus="attn.q"))
    drawn = {t for t, n in nodes.items() if "ghost" not in n["classes"]}
    assert drawn == {
        "linear",
        "model_attn_q_weight",
        "model_attn_q_bias",
        "model_attn_q_weight_bf16",
        "model_attn_q_bias_bf16",
    }
    assert "layer_norm_bf16" in nodes and "ghost" in nodes["layer_norm_bf16"]["classes"]


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
    assert FILL["fp32"] in nodes["linear"]["fills"] and "aten.linear" in nodes["linear"]["text"]
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
    assert '"layer_norm_bf16" [' in dot and "shape=hexagon" in dot
    assert f'fillcolor="{CAST_FILL}"' in dot
    assert '"layer_norm" -> "layer_norm_bf16";' in dot


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
    cast = nodes["layer_norm_bf16"]
    assert "cast" in cast["classes"] and CAST_FILL in cast["fills"]


def test_status_colours_are_distinct():
    assert len(set(STATUS_COLORS.values())) == 3


def test_large_graphs_draw_quickly():
    model = GPT(vocab=32, block=8, dim=16, heads=2, layers=6)
    compiled = amp_graph.compile(model, example_inputs=(torch.zeros(1, 8, dtype=torch.long),))
    svg = draw(compiled, renderer="networkx")
    assert len(parse(svg)) > 250
    ET.fromstring(svg.text)


PLOTTING = ("networkx", "matplotlib", "graphviz", "pygraphviz", "IPython")


def test_the_core_imports_no_plotting_or_layout_library():
    # torch.export itself imports networkx (its partitioner): count only what amp_graph adds.
    code = (
        "import sys, torch\n"
        "m = torch.nn.Sequential(torch.nn.Linear(2, 2))\n"
        "torch.export.export(m, (torch.randn(1, 2),), strict=False)\n"
        "before = set(sys.modules)\n"
        "import amp_graph\n"
        "amp_graph.report(amp_graph.compile(m, example_inputs=(torch.randn(1, 2),)))\n"
        f"print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in {PLOTTING}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    # and no module below inspection names one in an import, lazy imports included
    root = Path(amp_graph.__file__).parent
    for path in [*root.rglob("*.py"), *(root.parent / "passes").rglob("*.py")]:
        if "inspect" in path.relative_to(root.parent).parts or path.name in (
            "cli.py",
            "digits_demo.py",
        ):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            # networkx's max-flow is the cast placement's solver there, not a layout
            allowed = {"networkx"} if path.name == "cast_cut.py" else set()
            assert not [n for n in names if n.split(".")[0] in set(PLOTTING) - allowed], path


def test_dot_failure_is_reported(monkeypatch):
    monkeypatch.setattr(render_module.shutil, "which", lambda name: "/bin/false")
    with pytest.raises(RuntimeError, match="dot -Tsvg failed"):
        render_module.graphviz_svg("digraph {}")
