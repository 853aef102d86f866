"""The rewritten graphs' code reads parameters through the ``_modules`` dictionaries
(``passes/attribute_reads.py``): the same graph, the same values, the same live reads of the
model's attributes as fx's ``getattr`` chains, a loud error instead of another value, and
copies and pickles that still run."""

from __future__ import annotations

import copy
import pickle
import types

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from amp_graph.passes import attribute_reads
from amp_graph.passes.attribute_reads import _rewrite_line, read_attributes_directly

import amp_graph
from amp_graph.demo import models


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            'w = getattr(self.blocks, "0").ln1.weight',
            "w = self._modules['blocks']._modules['0']._modules['ln1'].weight",
        ),
        ("b = self.model.head.bias", "b = self._modules['model']._modules['head'].bias"),
        (
            'c = getattr(getattr(self.layers, "1"), "2")',
            "c = getattr(self._modules['layers']._modules['1'], '2')",
        ),
        ("w : torch.Tensor = self.a.w", "w : torch.Tensor = self._modules['a'].w"),
        ("w = self.weight", "w = self.weight"),  # one name: nothing to save
        ("y = self.model.fc(x)", "y = self.model.fc(x)"),  # a call_module
        ("y = torch.ops.aten.mm.default(x, w)", "y = torch.ops.aten.mm.default(x, w)"),
        ('s = getattr(x, "shape")', 's = getattr(x, "shape")'),  # a node's attribute
        ("s = self.a.b[0]", "s = self.a.b[0]"),  # not a pure path
        ("# COUNTER: 3\n", "# COUNTER: 3\n"),
    ],
)
def test_each_line_fx_writes_for_a_dotted_read_and_nothing_else_is_rewritten(line, expected):
    assert _rewrite_line(line) == expected
    if not line.endswith("\n"):
        assert _rewrite_line(line + "\n") == expected + "\n"


def _gpt_compiled(policy: str = "O1"):
    torch.manual_seed(0)
    model = models.GPT(vocab=64, block=16, dim=32, heads=2, layers=2)
    compiled = amp_graph.compile(model, policy=policy, dtype=torch.bfloat16)
    idx = torch.randint(0, 64, (2, 16))
    compiled(idx)
    return model, compiled, idx


def _with_fx_code(gm: fx.GraphModule) -> fx.GraphModule:
    """The same graph over the same model (not copies of its modules: ``GraphModule(root,
    graph)`` would make those), with fx's own code (getattr chains)."""
    plain = fx.GraphModule(nn.Module(), fx.Graph())
    plain.model = gm.model
    graph = copy.deepcopy(gm.graph)
    graph._codegen._body_transformer = None
    plain.graph = graph  # generates the code
    return plain


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_a_compiled_model_reads_every_dotted_attribute_through_module_dicts(policy):
    _, compiled, idx = _gpt_compiled(policy)
    gm = compiled.graph_module
    dotted = [n for n in gm.graph.nodes if n.op == "get_attr" and "." in n.target]
    assert dotted, "the GPT's parameters are read through submodules"
    assert "getattr(self." not in gm.code and "= self.model." not in gm.code
    assert gm.code.count("._modules[") >= len(dotted)
    plain = _with_fx_code(gm)
    assert "getattr(self." in plain.code or "= self.model." in plain.code
    assert [n.format_node() for n in plain.graph.nodes] == [n.format_node() for n in gm.graph.nodes]
    with torch.no_grad():
        assert torch.equal(compiled(idx), plain(idx))


def test_reads_are_live_like_getattr_for_parameters_and_submodules_replaced_after_capture():
    model, compiled, idx = _gpt_compiled()
    gm = compiled.graph_module
    plain = _with_fx_code(gm)
    with torch.no_grad():
        before = compiled(idx)
        # a new Parameter object (as FSDP2 and functional_call swap them), a new submodule
        fc = model.blocks[0].fc
        fc._parameters["weight"] = nn.Parameter(torch.randn_like(fc.weight))
        model.blocks[1].ln1 = nn.LayerNorm(32)
        model.blocks[1].ln1.weight.fill_(3.0)
        after = compiled(idx)
        assert not torch.equal(after, before)
        assert torch.equal(after, plain(idx))
        model.blocks[1].ln1.weight.fill_(0.5)
        assert not torch.equal(compiled(idx), after)
        assert torch.equal(compiled(idx), plain(idx))


def test_a_path_through_anything_but_a_registered_submodule_fails_instead_of_reading_it():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sub = nn.Linear(2, 2)

        def forward(self, x):
            return x @ self.sub.weight

    gm = fx.symbolic_trace(Net())
    read_attributes_directly(gm.graph)
    gm.recompile()
    x = torch.ones(1, 2)
    assert torch.equal(gm(x), x @ gm.sub.weight)
    del gm._modules["sub"]
    gm.__dict__["sub"] = types.SimpleNamespace(weight=torch.zeros(2, 2))  # getattr finds it
    with pytest.raises(KeyError, match="sub"):
        gm(x)


def test_copies_of_a_rewritten_module_run_and_compute_the_same():
    _, compiled, idx = _gpt_compiled()
    gm = compiled.graph_module
    with torch.no_grad():
        expected = gm(idx)
        copied = copy.deepcopy(gm)
        assert "._modules[" in copied.code
        assert torch.equal(copied(idx), expected)


def test_a_pickled_module_re_traces_the_rewritten_code_into_the_same_reads():
    """Pickling keeps the code, not the graph: unpickling traces it, and the dictionary reads
    become the same get_attr nodes (a rewritten amp_graph module holds unpicklable custom ops;
    a traced model shows the transformer itself is no obstacle)."""
    nested = nn.Sequential(models.MLP())
    # parameters as get_attr reads (symbolic_trace would call the Linear modules)
    traced = fx.symbolic_trace(nested, concrete_args=None)
    traced = fx.GraphModule(nested, _as_attribute_reads(traced))
    read_attributes_directly(traced.graph)
    traced.recompile()
    assert "self._modules['0']._modules['fc1'].weight" in traced.code
    unpickled = pickle.loads(pickle.dumps(traced))
    x = torch.randn(3, 64)
    assert torch.equal(unpickled(x), nested(x))
    targets = sorted(n.target for n in unpickled.graph.nodes if n.op == "get_attr")
    assert targets == sorted(n.target for n in traced.graph.nodes if n.op == "get_attr")


def _as_attribute_reads(traced: fx.GraphModule) -> fx.Graph:
    """The graph of ``traced`` with each Linear call as ``F.linear`` of get_attr reads."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in traced.graph.nodes:
        if node.op == "call_module":
            weight = graph.get_attr(f"{node.target}.weight")
            bias = graph.get_attr(f"{node.target}.bias")
            x = env[node.args[0]]
            env[node] = graph.call_function(torch.nn.functional.linear, (x, weight, bias))
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    return graph


def test_registering_twice_rewrites_once_and_keeps_an_earlier_transformer():
    gm = fx.symbolic_trace(models.MLP())
    gm.graph.on_generate_code(lambda _: lambda body: ["# first\n", *body])
    read_attributes_directly(gm.graph)
    read_attributes_directly(gm.graph)
    gm.recompile()
    assert gm.code.count("# first") == 1
    transformer = gm.graph._codegen._body_transformer
    assert isinstance(transformer, attribute_reads._DirectReads)
    assert not isinstance(transformer.previous, attribute_reads._DirectReads)


def test_a_graph_step_reads_its_builds_parameters_through_module_dicts():
    from graph_helpers import TrainGraph

    model = models.MLP()
    g = TrainGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.bfloat16)
    g(torch.randn(4, 64), torch.randint(0, 10, (4,)))
    build = g.build_graph
    assert any(n.op == "get_attr" and "." in n.target for n in build.graph.nodes)
    assert "._modules[" in build.code and "getattr(self." not in build.code
