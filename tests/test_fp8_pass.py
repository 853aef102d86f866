"""passes/fp8_linears on graphs captured by torch.export (non-strict, pre-dispatch aten IR).

Structure: which nodes the pass writes, what it records, what it leaves alone. Numbers: the
rewritten graph must equal, bit for bit, the model run eagerly with the same layers calling
``amp_graph.ops.fp8_ops.linear``; both run under ``torch.autocast("cpu", bfloat16)``, which stands
in for the O1-bf16 passes the fp8 policy runs around this one.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from amp_graph.passes.fp8_linears import fp8_linears as fp8_linears_pass
from amp_graph.passes.meta import AMP, AmpInfo, Role
from fp8_helpers import ScaledMatmulProbe

from amp_graph.demo import models
from amp_graph.ops import fp8_ops
from amp_graph.policy import E4M3, E5M2, Fp8Config, Rule

ops = torch.ops.amp_graph


def fp8_linears(gm, *args, **kwargs):
    """The pass, then the recompile its driver does once after all passes."""
    result = fp8_linears_pass(gm, *args, **kwargs)
    gm.recompile()
    return result


BF16 = torch.bfloat16


def export(model: nn.Module, *args: torch.Tensor) -> fx.GraphModule:
    return torch.export.export(model, args, strict=False).module()


def count(gm: fx.GraphModule, target) -> int:
    return sum(n.target is target for n in gm.graph.nodes)


def nodes(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is target]


class Fp8Layer(nn.Module):
    """The eager reference: an nn.Linear computed by amp_graph.ops.fp8_ops.linear."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_ops.linear(x, self.linear.weight, self.linear.bias)


def test_mlp_linears_become_fp8_and_the_10_class_head_stays():
    model = models.MLP()
    x = torch.randn(32, 1, 8, 8)
    gm = export(model, x)
    result = fp8_linears(gm, root=model)
    assert result.modified and result.stats == {"fp8_linears": 2, "fp8_kept": 1}
    assert count(gm, ops.fp8_linear.default) == 2
    assert count(gm, ops.fp8_scale.default) == count(gm, ops.fp8_quantize.default) == 4
    assert count(gm, torch.ops.aten.linear.default) == 1  # the head: out_features=10
    head = nodes(gm, torch.ops.aten.linear.default)[0]
    assert head.meta[AMP].detail.startswith("not fp8: out_features=10 is not a multiple of 16")
    assert "torch.ops.amp_graph.fp8_linear.default(" in gm.code
    gm.graph.lint()

    for node in nodes(gm, ops.fp8_linear.default):
        info: AmpInfo = node.meta[AMP]
        assert (info.role, info.rule, info.source) == (Role.OP, Rule.FOLLOW, "fp8")
        assert info.detail.startswith("fp8: aten.linear with K=")
        assert info.out_dtype == BF16 and info.exact and node.meta["val"].dtype == BF16
        assert info.module_path in ("fc1", "fc2")
    assert {n.meta["val"].dtype for n in nodes(gm, ops.fp8_quantize.default)} == {E4M3}
    assert {n.meta[AMP].out_dtype for n in nodes(gm, ops.fp8_scale.default)} == {torch.float32}

    reference = copy.deepcopy(model)
    reference.fc1, reference.fc2 = Fp8Layer(reference.fc1), Fp8Layer(reference.fc2)
    with torch.autocast("cpu", BF16):
        assert torch.equal(gm(x), reference(x))


def test_gpt_quantizes_a_shared_input_once_and_the_filter_keeps_the_head():
    model = models.GPT()
    idx = torch.randint(0, 64, (2, 32))
    gm = export(model, idx)
    paths = []

    def keep_head(module: nn.Module, path: str) -> bool:
        paths.append((path, type(module)))
        return path != "head"

    stats = fp8_linears(gm, Fp8Config(module_filter=keep_head), root=model).stats
    assert stats == {"fp8_linears": 12, "fp8_kept": 1}
    assert ("blocks.0.attn.q", nn.Linear) in paths and ("head", nn.Linear) in paths
    # q, k and v read the same layer norm output: one scale and one quantize for all three
    qkv = [
        n
        for n in nodes(gm, ops.fp8_linear.default)
        if n.meta[AMP].module_path.endswith(("attn.q", "attn.k", "attn.v"))
    ]
    assert len(qkv) == 6 and len({n.args[2] for n in qkv}) == 2  # one x_e4m3 per block
    # per block: 4 activations (ln1, attention out, ln2, gelu) + 6 weights
    assert count(gm, ops.fp8_quantize.default) == 2 * 10
    head = nodes(gm, torch.ops.aten.linear.default)[0]
    assert head.meta[AMP].detail == "not fp8: module_filter returned False"

    reference = copy.deepcopy(model)
    for block in reference.blocks:
        for name in ("q", "k", "v", "proj"):
            setattr(block.attn, name, Fp8Layer(getattr(block.attn, name)))
        block.fc, block.out = Fp8Layer(block.fc), Fp8Layer(block.out)
    with torch.autocast("cpu", BF16):
        assert torch.equal(gm(idx), reference(idx))


class Functional(nn.Module):
    """Linear layers written as matmuls with parameters, in each form the pass matches, and
    one matmul with a buffer, which is not a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.w_kn = nn.Parameter(torch.randn(64, 32) / 8)  # x @ w_kn
        self.w_nk = nn.Parameter(torch.randn(48, 32) / 8)  # w_nk @ h.mT
        self.w_mm = nn.Parameter(torch.randn(32, 16) / 8)  # mm and addmm
        self.b = nn.Parameter(torch.randn(16))
        self.register_buffer("proj", torch.randn(32, 32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x @ self.w_kn
        flat = h.reshape(-1, 32)
        return (
            self.w_nk @ h.transpose(1, 2),
            torch.addmm(self.b, flat, self.w_mm),
            torch.mm(flat, self.w_mm),
            h @ self.proj,
        )


def test_matmuls_with_a_parameter_operand_become_fp8():
    model = Functional()
    x = torch.randn(2, 16, 64)
    gm = export(model, x)
    assert fp8_linears(gm).stats == {"fp8_linears": 4, "fp8_kept": 0}
    remaining = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.addmm.default not in remaining
    assert torch.ops.aten.mm.default not in remaining
    assert remaining.count(torch.ops.aten.matmul.default) == 1  # the buffer's

    m = model
    h = fp8_ops.linear(x, m.w_kn.t())
    flat = h.reshape(-1, 32)
    expected = (
        fp8_ops.linear(h.transpose(1, 2).mT, m.w_nk).mT,
        fp8_ops.linear(flat, m.w_mm.t(), m.b),
        fp8_ops.linear(flat, m.w_mm.t()),
        h @ m.proj.to(BF16),
    )
    with torch.autocast("cpu", BF16):
        for got, want in zip(gm(x), expected, strict=True):
            assert torch.equal(got, want)


@pytest.mark.usefixtures("torch_scaled_mm")
def test_gradients_flow_through_the_rewritten_graph_in_fp8():
    """Dispatch probe on the rewritten GPT: per fp8 linear one e4m3 x e4m3 scaled matmul
    forward, two e5m2 x e4m3 backward (every linear's input depends on a parameter)."""
    model = models.GPT()
    idx = torch.randint(0, 64, (2, 32))
    gm = export(model, idx)
    converted = fp8_linears(gm).stats["fp8_linears"]
    assert converted == 13  # the tied 64x64 head too
    probe = ScaledMatmulProbe()
    with probe, torch.autocast("cpu", BF16):
        logits = gm(idx)
        forward = list(probe.calls)
        logits.float().logsumexp(-1).mean().backward()
    assert forward == [(E4M3, E4M3)] * converted
    assert probe.calls[converted:] == [(E5M2, E4M3)] * (2 * converted)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)


def test_an_explicit_fp32_rule_from_classify_is_kept():
    model = models.MLP()
    gm = export(model, torch.randn(4, 1, 8, 8))
    fc1, fc2, _ = nodes(gm, torch.ops.aten.linear.default)
    fc1.meta[AMP] = AmpInfo(
        role=Role.OP, op="aten.linear", module_path="fc1", rule=Rule.DENY,
        source="module path", detail="module path override 'fc1'",
    )  # fmt: skip
    fc2.meta[AMP] = AmpInfo(
        role=Role.OP, op="aten.linear", module_path="fc2", rule=Rule.ALLOW,
        source="table", detail="linear is on autocast's lower precision list",
    )  # fmt: skip
    assert fp8_linears(gm).stats == {"fp8_linears": 1, "fp8_kept": 2}
    kept = fc1.meta[AMP]
    assert kept.rule is Rule.DENY and kept.source == "module path"  # classify's record stays
    assert kept.detail.startswith("module path override 'fc1'; not fp8: the policy gives it")
    (converted,) = nodes(gm, ops.fp8_linear.default)
    assert converted.meta[AMP].module_path == "fc2"


def test_pass_is_idempotent_and_leaves_other_graphs_alone():
    model = models.MLP()
    gm = export(model, torch.randn(4, 1, 8, 8))
    fp8_linears(gm)
    code, detail = gm.code, nodes(gm, torch.ops.aten.linear.default)[0].meta[AMP].detail
    again = fp8_linears(gm)
    assert not again.modified and gm.code == code
    assert nodes(gm, torch.ops.aten.linear.default)[0].meta[AMP].detail == detail
    conv = export(nn.Sequential(nn.Conv2d(1, 16, 3)), torch.randn(1, 1, 8, 8))
    assert fp8_linears(conv).stats == {"fp8_linears": 0, "fp8_kept": 0}


def test_rowwise_recipe_reaches_the_ops():
    model = models.MLP()
    x = torch.randn(32, 1, 8, 8)
    gm = export(model, x)
    fp8_linears(gm, Fp8Config(recipe="rowwise"))
    assert {n.args[-1] for n in nodes(gm, ops.fp8_linear.default)} == {"rowwise"}
    with torch.autocast("cpu", BF16):
        out = gm(x)
        expected = model.head(
            F.gelu(fp8_ops.linear(F.gelu(fp8_ops.linear(x.flatten(1), model.fc1.weight,
                                                         model.fc1.bias, "rowwise")),
                                  model.fc2.weight, model.fc2.bias, "rowwise"))
        )  # fmt: skip
    assert torch.equal(out, expected)


def test_a_module_filter_needs_the_model():
    gm = export(models.MLP(), torch.randn(4, 1, 8, 8))
    with pytest.raises(ValueError, match="pass the user's model as root="):
        fp8_linears(gm, Fp8Config(module_filter=lambda m, p: True))


def test_a_policy_that_converts_no_linear_says_so_with_the_reasons(caplog) -> None:
    """fp8 is chosen for speed alone: every linear kept (here, dims no float8 matmul takes)
    is a WARNING naming why, where a count in the stats was all there was."""
    odd = nn.Sequential(nn.Linear(10, 6), nn.ReLU(), nn.Linear(6, 3))
    with caplog.at_level("WARNING", logger="amp_graph.passes.fp8_linears"):
        result = fp8_linears(export(odd, torch.randn(4, 10)), root=odd)
    assert result.stats == {"fp8_linears": 0, "fp8_kept": 2}
    [said] = [r.getMessage() for r in caplog.records]
    assert "converted none of this graph's 2 linear-like ops" in said
    assert "not a multiple of 16" in said

    caplog.clear()
    fits = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 10))
    with caplog.at_level("WARNING", logger="amp_graph.passes.fp8_linears"):
        assert fp8_linears(export(fits, torch.randn(4, 32)), root=fits).stats["fp8_linears"]
    assert not caplog.records  # one converted (the other kept) is what the policy expects
