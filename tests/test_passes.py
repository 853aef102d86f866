"""Each pass's promise, checked on its own, plus the verifier and the driver."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from amp_graph.passes import (
    AMP,
    AmpInfo,
    PassError,
    Role,
    VerificationError,
    inline_regions,
    pipeline,
)
from amp_graph.passes.assign_dtypes import assign_dtypes
from amp_graph.passes.classify import classify
from amp_graph.passes.insert_casts import insert_casts, make_cast
from amp_graph.passes.simplify_casts import simplify_casts
from amp_graph.passes.verify import verify
from conftest import compile_checked
from torch.utils import _pytree as pytree

import amp_graph
from amp_graph.capture import capture_module
from amp_graph.demo import models
from amp_graph.policy import Policy, Rule


class QKV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.ln(x)
        return self.q(h) + self.k(h) + self.v(h)


def casts_of(gm, source_name):
    return [
        n for n in gm.graph.nodes if n.meta[AMP].role is Role.CAST and n.args[0].name == source_name
    ]


def captured(model, example, policy="O1", dtype=torch.bfloat16) -> fx.GraphModule:
    """The graph the passes take: the model captured by amp_graph (aten ops, a fake value on
    every node), its autocast regions inlined, before any other pass."""
    gm = capture_module(
        model,
        tuple(example),
        {},
        device_type="cpu",
        autocast_dtype=dtype,
        policy=Policy.preset(policy),
        low_dtype=dtype,
    ).graph_module
    inline_regions(gm)
    return gm


def staged(model, example, policy="O1", dtype=torch.bfloat16):
    gm = captured(model, example, policy, dtype)
    policy = Policy.preset(policy)
    classify(gm, policy)
    assign_dtypes(gm, dtype, policy.cast_inputs)
    return gm


def test_classify_records_rules_without_changing_the_graph():
    gm = captured(QKV(), (torch.randn(2, 8),))
    code = gm.code
    result = classify(gm, Policy.preset("O1"))
    assert not result.modified and gm.code == code
    rules = {n.name: n.meta[AMP].rule for n in gm.graph.nodes if n.meta[AMP].role is Role.OP}
    assert rules == {
        "layer_norm": Rule.DENY,
        "linear": Rule.ALLOW,
        "linear_1": Rule.ALLOW,
        "linear_2": Rule.ALLOW,
        "add": Rule.FOLLOW,
        "add_1": Rule.FOLLOW,
    }
    layer_norm = next(n for n in gm.graph.nodes if n.name == "layer_norm")
    assert "layer_norm" in layer_norm.meta[AMP].detail


def test_the_captured_graph_reads_the_models_own_parameters():
    model = QKV()
    gm = staged(model, (torch.randn(2, 8),))
    names = [n.name for n in gm.graph.nodes if n.meta[AMP].role is Role.OP]
    assert names == ["layer_norm", "linear", "linear_1", "add", "linear_2", "add_1"]
    q = next(n for n in gm.graph.nodes if n.name == "linear")
    assert q.target is torch.ops.aten.linear.default
    weight = q.args[1]
    assert weight.op == "get_attr" and gm.get_parameter(weight.target) is model.q.weight


def test_insert_casts_one_per_use_then_simplify_shares_one():
    gm = staged(QKV(), (torch.randn(2, 8),))
    inserted = insert_casts(gm).stats["casts_inserted"]
    assert len(casts_of(gm, "layer_norm")) == 3  # as torch.autocast: once per consumer
    verify(gm)
    removed = simplify_casts(gm).stats["casts_removed"]
    assert len(casts_of(gm, "layer_norm")) == 1 and removed == 2
    assert inserted == 3 + 6  # layer_norm for q, k, v, plus weight and bias of each linear
    assert sorted(casts_of(gm, "layer_norm")[0].meta[AMP].cast_for) == [
        "linear",
        "linear_1",
        "linear_2",
    ]
    verify(gm)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x)) + self.a(x)


def test_tied_weight_is_cast_once_per_call():
    compiled = compile_checked(Tied(), "O1", example_inputs=(torch.randn(2, 8),))
    weight_casts = [
        n
        for n in compiled.graph.nodes
        if n.meta[AMP].role is Role.CAST and n.args[0].op == "get_attr"
    ]
    assert len(weight_casts) == 1
    assert len(weight_casts[0].meta[AMP].cast_for) == 3


def test_no_cast_to_a_values_own_dtype():
    model = QKV().to(torch.bfloat16)
    compiled = compile_checked(
        model, "O1", example_inputs=(torch.randn(2, 8, dtype=torch.bfloat16),)
    )
    casts = [n for n in compiled.graph.nodes if n.meta[AMP].role is Role.CAST]
    assert all(c.args[0].meta[AMP].out_dtype != c.args[1] for c in casts)
    # bf16 parameters feed the bf16 linears directly; LayerNorm's inputs go to float32
    assert not [c for c in casts if c.args[0].op == "get_attr" and c.args[0].target[0] in "qkv"]
    assert {c.args[1] for c in casts} == {torch.float32, torch.bfloat16}


def _chain_graph(source_dtype, via, back):
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta[AMP] = AmpInfo(role=Role.INPUT, out_dtype=source_dtype, exact=True)
    first = make_cast(graph, x, via, "relu")
    second = make_cast(graph, first, back, "relu")
    relu = graph.call_function(torch.ops.aten.relu.default, (second,))
    relu.meta[AMP] = AmpInfo(role=Role.OP, rule=Rule.FOLLOW, out_dtype=back, exact=True)
    out = graph.output(relu)
    out.meta[AMP] = AmpInfo(role=Role.OUTPUT, out_dtype=back)
    return fx.GraphModule(nn.Module(), graph)


def test_lossless_chain_folds_and_lossy_chain_stays():
    lossless = _chain_graph(torch.float16, torch.float32, torch.float16)  # fp16 -> fp32 -> fp16
    simplify_casts(lossless)
    relu = next(n for n in lossless.graph.nodes if n.op == "call_function")
    assert relu.args[0].op == "placeholder"
    assert not any(n.meta[AMP].role is Role.CAST for n in lossless.graph.nodes)

    lossy = _chain_graph(torch.float32, torch.float16, torch.float32)  # fp32 -> fp16 -> fp32
    simplify_casts(lossy)
    assert sum(n.meta[AMP].role is Role.CAST for n in lossy.graph.nodes) == 2
    x = torch.tensor([1 + 2**-12])
    assert lossy(x).item() != x.item()  # the rounding is real, and it is kept

    widen = _chain_graph(torch.bfloat16, torch.float32, torch.float16)  # bf16 -> fp32 -> fp16
    simplify_casts(widen)
    casts = [n for n in widen.graph.nodes if n.meta[AMP].role is Role.CAST]
    assert (
        len(casts) == 1
        and casts[0].args[0].op == "placeholder"
        and casts[0].args[1] == torch.float16
    )


def test_verifier_catches_a_missing_cast_and_a_wrong_plan():
    compiled = compile_checked(QKV(), "O1", example_inputs=(torch.randn(2, 8),)).graph_module
    cast = casts_of(compiled, "layer_norm")[0]
    cast.replace_all_uses_with(cast.args[0])
    compiled.graph.erase_node(cast)
    with pytest.raises(VerificationError, match="a cast is missing"):
        verify(compiled)

    compiled = compile_checked(QKV(), "O1", example_inputs=(torch.randn(2, 8),)).graph_module
    add = next(n for n in compiled.graph.nodes if n.name == "add")
    add.meta[AMP].out_dtype = torch.float16
    with pytest.raises(VerificationError, match="the plan says its output is fp16"):
        verify(compiled)


def test_a_node_whose_fake_run_fails_is_an_error_naming_it():
    """Dtypes come from fake values only: no silent fallback when a node cannot run on them."""
    gm = captured(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(2, 4),))
    relu = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default)

    def no_fake_kernel(x):
        raise NotImplementedError("no fake kernel")

    relu.target = no_fake_kernel
    classify(gm, Policy.preset("O1"))
    with pytest.raises(RuntimeError, match=r"node 'relu' \(.*no_fake_kernel.*no fake kernel"):
        assign_dtypes(gm, torch.bfloat16)


def test_driver_names_the_failing_pass_and_those_before(monkeypatch):
    def broken(gm):
        raise RuntimeError("boom")

    monkeypatch.setattr(pipeline, "simplify_casts", broken)
    with pytest.raises(PassError) as info:
        amp_graph.compile(QKV())(torch.randn(2, 8))
    message = str(info.value)
    assert "'simplify_casts' failed" in message
    before = "(passes run before it: classify, assign_dtypes, low_extremes, insert_casts)"
    assert before in message and "boom" in message


def test_every_pass_keeps_the_invariants_on_every_model():
    cases = [
        (models.MLP(), (torch.randn(2, 64),)),
        (models.ConvNet(), (torch.randn(2, 1, 8, 8),)),
        (models.GPT(), (torch.randint(0, 64, (2, 8)),)),
        (models.RecurrentNet(), (torch.randn(2, 8, 8),)),
        (models.MixedOpsNet(), (torch.randn(2, 16),)),
        (models.LlamaMLP(), (torch.randn(2, 32),)),
    ]
    for model, example in cases:
        want = pytree.tree_leaves(model(*example))
        for policy in ("O0", "O1", "O2", "O3", "autocast"):
            for inputs in (example, None):
                compiled = compile_checked(
                    model, policy, example_inputs=inputs
                )  # verifies each pass
                got = pytree.tree_leaves(compiled(*example))
                assert [g.shape for g in got] == [w.shape for w in want]
                assert all(torch.isfinite(g).all() for g in got)
                if policy == "O0":  # float32 throughout: the model's own outputs
                    for g, w in zip(got, want, strict=True):
                        torch.testing.assert_close(g, w)


@pytest.mark.parametrize(
    "module",
    ["classify", "assign_dtypes", "insert_casts", "cast_outputs", "fp8_linears", "instrument"],
)
def test_pass_docstring_examples_run(module: str) -> None:
    """The examples in the passes' docstrings run on graphs the capture makes, as written."""
    import doctest
    import importlib

    result = doctest.testmod(
        importlib.import_module(f"amp_graph.passes.{module}"), optionflags=doctest.ELLIPSIS
    )
    assert result.failed == 0 and result.attempted > 0, f"{module}: {result}"
