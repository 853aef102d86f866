"""One IR: a GraphModule the user brings is captured as any model, so the passes only ever
see aten-level graphs with a fake value on every node.

Each model below is compiled twice, as written and as ``torch.fx.symbolic_trace`` traced it;
both must give the same aten ops at the same dtypes, bit-identical outputs and gradients, and
the traced GraphModule must be left as it was, its parameters shared with the compiled graph.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import zoo
from amp_graph.passes import AMP, run_passes
from amp_graph.passes.meta import VAL

import amp_graph
from amp_graph.demo import models
from amp_graph.frontends.compiler import compile_record
from amp_graph.policy import Policy

BF16 = torch.bfloat16


def _gpt() -> tuple[nn.Module, tuple]:
    return models.GPT(vocab=64, block=16, dim=32, heads=2, layers=2), (
        torch.randint(0, 64, (2, 16)),
    )


def _convnet() -> tuple[nn.Module, tuple]:
    return models.ConvNet(channels=8), (torch.randn(2, 1, 8, 8),)


def _recurrent() -> tuple[nn.Module, tuple]:
    return models.RecurrentNet(), (torch.randn(2, 5, 8),)


def _updated_between_uses() -> tuple[nn.Module, tuple]:
    return zoo.UpdateBetweenUses(), (torch.randn(3, 16),)


CASES = {
    "gpt": _gpt,
    "convnet": _convnet,
    "recurrent": _recurrent,
    "updated_between_uses": _updated_between_uses,
}


def _plan(gm: fx.GraphModule) -> list[tuple]:
    """What the passes decided, node by node, names aside: op, role, compute and out dtype."""
    return [
        (str(n.target) if n.op == "call_function" else n.op, str(n.meta[AMP].role),
         n.meta[AMP].compute_dtype, str(n.meta[AMP].out_dtype))
        for n in gm.graph.nodes
        if n.op not in ("placeholder", "get_attr")
    ]  # fmt: skip


@pytest.mark.parametrize("policy", ["O1", "O2"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_traced_graph_module_compiles_as_its_model(name: str, policy: str) -> None:
    torch.manual_seed(0)
    model, inputs = CASES[name]()
    traced = fx.symbolic_trace(model)
    code = traced.code
    direct = amp_graph.compile(model, policy, BF16, example_inputs=inputs)
    via_trace = amp_graph.compile(traced, policy, BF16, example_inputs=inputs)
    assert _plan(via_trace.graph_module) == _plan(direct.graph_module)
    assert traced.code == code, "the user's GraphModule was changed"
    assert all(AMP not in n.meta for n in traced.graph.nodes)

    out_direct, out_traced = direct(*inputs), via_trace(*inputs)
    assert out_traced.dtype == out_direct.dtype
    assert torch.equal(out_traced, out_direct)
    if name == "updated_between_uses" and policy == "O2":
        # O2 keeps the model's own float32 value in float32, as eager float32 does: fc1 saves
        # it, then it is written in place, and backward fails in eager too. Both paths agree.
        for out in (out_traced, out_direct):
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.float().sum().backward()
        return
    out_traced.float().square().mean().backward()
    traced_grads = {k: p.grad.clone() for k, p in traced.named_parameters()}
    model.zero_grad(set_to_none=True)
    out_direct.float().square().mean().backward()
    for key, param in model.named_parameters():  # symbolic_trace keeps the parameter names
        assert torch.equal(traced_grads[key], param.grad), key


def test_the_traced_graph_reads_the_users_parameters() -> None:
    """An optimizer over the traced GraphModule's parameters trains the compiled graph."""
    model, inputs = _convnet()
    traced = fx.symbolic_trace(model)
    compiled = amp_graph.compile(traced, "O1", BF16, example_inputs=inputs)
    before = compiled(*inputs).detach().clone()
    with torch.no_grad():
        for param in traced.parameters():
            param.add_(0.1)
    assert not torch.equal(compiled(*inputs), before)
    assert {id(p) for p in compiled.parameters()} >= {id(p) for p in traced.parameters()}


def test_every_node_the_passes_see_has_a_fake_value() -> None:
    model, inputs = _gpt()
    compiled = amp_graph.compile(fx.symbolic_trace(model), "O1", BF16, example_inputs=inputs)
    captured = compile_record(compiled).original
    missing = [n.name for n in captured.graph.nodes if n.op != "output" and VAL not in n.meta]
    assert not missing, f"nodes without meta['val']: {missing}"
    assert {n.op for n in captured.graph.nodes} <= {
        "placeholder",
        "get_attr",
        "call_function",
        "output",
    }


def test_the_passes_refuse_a_torch_level_graph() -> None:
    """The passes take what the capture makes; a torch-level graph gets a clear error."""
    model, _ = _convnet()
    traced = fx.symbolic_trace(copy.deepcopy(model))
    with pytest.raises(TypeError, match=r"amp_graph\.compile"):
        run_passes(traced, Policy.preset("O1"), BF16)


def test_the_passes_refuse_a_graph_whose_blocks_are_not_flat() -> None:
    """inline_regions is the captured form, not a pass: a capture with the model's own
    autocast block still in it is refused, saying what to run; once flat, it passes."""
    from amp_graph.passes import inline_regions

    from amp_graph.capture import capture_module

    model = zoo.NestedRegion()
    x = torch.randn(4, 16)
    gm = capture_module(
        model, (x,), {}, device_type="cpu", autocast_dtype=BF16, policy=Policy.preset("O1")
    ).graph_module
    with pytest.raises(TypeError, match=r"inline_regions"):
        run_passes(gm, Policy.preset("O1"), BF16)
    assert inline_regions(gm).stats["autocast_regions"] > 0
    result = run_passes(gm, Policy.preset("O1"), BF16)
    assert "inline_regions" not in result.seconds
    assert torch.equal(gm(x), amp_graph.compile(model, "O1", BF16)(x))


@pytest.mark.parametrize(
    "override",
    [{"modules": {"blocks.0.attn": "fp32"}}, {"module_types": {models.DecoderBlock: "fp32"}}],
    ids=["module path", "module type"],
)
def test_module_overrides_reach_the_ops_a_tracer_inlined(override: dict) -> None:
    """symbolic_trace inlines the forwards it traces through (attention's matmuls, residual
    adds); their nodes keep the tracer's module stack, which the capture carries over, so a
    module override holds for them as it does for the model itself."""
    torch.manual_seed(0)
    model, inputs = _gpt()
    policy = Policy.preset("O1").override(**override)
    direct = amp_graph.compile(model, policy, BF16, example_inputs=inputs).graph_module
    via_trace = amp_graph.compile(fx.symbolic_trace(model), policy, BF16, example_inputs=inputs)

    def paths(gm: fx.GraphModule) -> list[tuple]:
        return [(n.meta[AMP].module_path, n.meta[AMP].source) for n in gm.graph.nodes]

    assert _plan(via_trace.graph_module) == _plan(direct)
    assert paths(via_trace.graph_module) == paths(direct)
    pinned = [n for n in direct.graph.nodes if n.meta[AMP].source.startswith("module")]
    assert any(str(n.target).startswith("aten.scaled_dot_product_attention") for n in pinned)
    assert torch.equal(via_trace(*inputs), amp_graph.compile(model, policy, BF16)(*inputs))
