"""The model suite: structure (which nodes compute in which dtype, how many casts) and
numbers (bitwise against torch.autocast / the plan reference; gradients within tolerance)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from amp_graph.passes import AMP, Role
from conftest import PlanReference, compile_checked, skip_where_cpu_lacks_kernels_of

import amp_graph
from amp_graph.demo import models

BF16, FP32 = torch.bfloat16, torch.float32

CASES = {
    "mlp": (models.MLP, lambda: (torch.randn(8, 64),)),
    "cnn": (models.ConvNet, lambda: (torch.randn(8, 1, 8, 8),)),
    "gpt": (models.GPT, lambda: (torch.randint(0, 64, (2, 16)),)),
    "rnn": (models.RecurrentNet, lambda: (torch.randn(8, 8, 8),)),
    "mixed": (models.MixedOpsNet, lambda: (torch.randn(8, 16),)),
    "llama": (models.LlamaMLP, lambda: (torch.randn(8, 32),)),
}
# Tolerance for gradients of the compiled module against eager torch.autocast. Forward
# values are bitwise equal; gradients differ only where amp_graph shares one cast between
# several consumers, so their gradients are summed in the low dtype (as torch.autocast does
# for the cached weight casts) instead of in float32: a few bf16 ulps.
GRAD_RTOL, GRAD_ATOL = 2e-2, 1e-3


def out_dtypes(compiled, predicate):
    return {n.meta[AMP].out_dtype for n in compiled.graph.nodes if predicate(n.meta[AMP])}


def aten(name):
    """Ops of one aten name (any overload) that the policy decides (not in-place ones)."""
    return lambda info: (
        info.role is Role.OP and info.aten is not None and (info.aten.split(".")[0] == name)
    )


def test_mlp_structure():
    compiled = compile_checked(models.MLP(), "O1", example_inputs=CASES["mlp"][1]())
    assert out_dtypes(compiled, aten("linear")) == {BF16}
    assert out_dtypes(compiled, aten("gelu")) == {BF16}
    assert amp_graph.report(compiled).casts_kept == 7  # input + 3 weights + 3 biases


def test_cnn_structure_batchnorm_and_residuals():
    compiled = compile_checked(models.ConvNet(), "O1", example_inputs=CASES["cnn"][1]())
    assert out_dtypes(compiled, aten("conv2d")) == {BF16}
    # batch norm is in no autocast list: it follows its bf16 input, fp32 statistics kept
    bns = [n for n in compiled.graph.nodes if aten("batch_norm")(n.meta[AMP])]
    assert len(bns) == 5 and {n.meta[AMP].out_dtype for n in bns} == {BF16}
    assert all(n.meta[AMP].compute_dtype is None for n in bns)
    assert compiled.model.bn.running_mean.dtype == FP32
    adds = [n for n in compiled.graph.nodes if aten("add")(n.meta[AMP])]
    assert len(adds) == 2 and {n.meta[AMP].out_dtype for n in adds} == {BF16}
    counters = [n for n in compiled.graph.nodes if n.meta[AMP].role is Role.INPLACE]
    assert len(counters) == 5  # num_batches_tracked += 1, in place on the model's buffer


def test_gpt_structure():
    compiled = compile_checked(models.GPT(), "O1", example_inputs=CASES["gpt"][1]())
    infos = [n.meta[AMP] for n in compiled.graph.nodes]
    assert out_dtypes(compiled, aten("embedding")) == {FP32}
    assert out_dtypes(compiled, aten("layer_norm")) == {FP32}
    assert out_dtypes(compiled, aten("linear")) == {BF16}
    assert out_dtypes(compiled, aten("scaled_dot_product_attention")) == {BF16}
    assert out_dtypes(compiled, aten("gelu")) == {BF16}
    # the residual stream stays fp32: fp32 + bf16 promotes, exactly as under autocast
    residual = [i for i in infos if aten("add")(i) and i.module_path.startswith("blocks")]
    assert residual and {i.out_dtype for i in residual} == {FP32}
    # the tied head/embedding weight: embedding reads it in fp32, the head casts it once
    gm = compiled.graph_module
    weight_casts = [
        n
        for n in gm.graph.nodes
        if n.meta[AMP].role is Role.CAST
        and n.args[0].op == "get_attr"
        and gm.get_parameter(n.args[0].target) is compiled.model.tok.weight
    ]
    assert len(weight_casts) == 1
    # ln1's output feeds q, k and v: one cast, where torch.autocast casts three times
    ln_casts = [
        n
        for n in gm.graph.nodes
        if n.meta[AMP].role is Role.CAST and n.args[0].meta[AMP].module_path == "blocks.0.ln1"
    ]
    assert len(ln_casts) == 1 and len(ln_casts[0].meta[AMP].cast_for) == 3


def test_rnn_structure_casts_recurrent_weights():
    model = models.RecurrentNet()
    skip_where_cpu_lacks_kernels_of(model)
    compiled = compile_checked(model, "O1", example_inputs=CASES["rnn"][1]())
    rnns = [n for n in compiled.graph.nodes if n.meta[AMP].aten in ("lstm.input", "gru.input")]
    assert len(rnns) == 2  # the LSTM and the GRU, each one aten op with bf16 parameters
    assert {n.meta[AMP].out_dtype[0] for n in rnns} == {BF16}
    for node in rnns:
        weights = node.args[2]
        assert all(w.meta[AMP].role is Role.CAST and w.args[1] == BF16 for w in weights)
    assert model.lstm.weight_ih_l0.dtype == FP32


def test_mixed_ops_structure():
    compiled = compile_checked(models.MixedOpsNet(), "O1", example_inputs=CASES["mixed"][1]())
    roles = Counter(n.meta[AMP].role for n in compiled.graph.nodes)
    assert roles[Role.INPLACE] == 3  # relu_, g += h and mul_: torch runs all three in place
    for node in compiled.graph.nodes:
        if node.meta[AMP].role is Role.CAST:
            assert node.args[0].meta[AMP].out_dtype in (FP32, BF16)
    assert out_dtypes(compiled, aten("gt")) == {torch.bool}
    assert out_dtypes(compiled, aten("argmax")) == {torch.int64}
    assert out_dtypes(compiled, aten("cat")) == {FP32}  # promote on CUDA: cat(bf16, fp32)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("policy", ["O1", "O2", "O3"])
def test_forward_is_bitwise_the_plan_reference(name, policy):
    factory, inputs = CASES[name]
    model = factory().eval()
    example = inputs()
    compiled = compile_checked(model, policy, example_inputs=example)
    assert torch.equal(compiled(*example), PlanReference(compiled).run(*example))


def _loss(out):
    return out.float().pow(2).mean()


@pytest.mark.parametrize("name", sorted(CASES))
def test_autocast_preset_forward_bitwise_and_gradients_close(name):
    factory, inputs = CASES[name]
    model = factory()
    skip_where_cpu_lacks_kernels_of(model)
    example = inputs()
    compiled = compile_checked(model, "autocast", example_inputs=example)
    torch.manual_seed(1)
    try:
        with torch.autocast("cpu", torch.bfloat16):
            reference = model(*example)
    except RuntimeError as error:  # oneDNN's bf16 LSTM needs bf16 instructions
        assert torch.isfinite(compiled(*example).float()).all()  # torch's own kernel runs
        pytest.skip(f"torch.autocast cannot run {name} on this CPU to compare: {error}")
    _loss(reference).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = compiled(*example)
    assert out.dtype == reference.dtype
    assert torch.equal(out, reference)
    _loss(out).backward()
    for n, p in model.named_parameters():
        if n in expected:
            assert p.grad.dtype == FP32
            torch.testing.assert_close(p.grad, expected[n], rtol=GRAD_RTOL, atol=GRAD_ATOL)


def test_gradients_reach_fp32_parameters_through_every_policy():
    for policy in ("O1", "O2", "O3"):
        model = models.GPTWithLoss()
        idx = torch.randint(0, 64, (2, 16))
        compiled = compile_checked(model, policy, example_inputs=(idx, idx))
        loss = compiled(idx, idx)
        loss.float().backward()
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and g.dtype == FP32 and torch.isfinite(g).all() for g in grads)
