"""amp_graph.inspect.dataflow: per-module op counts, and bytes cast forward and backward,
checked against the `_to_copy` calls PyTorch really makes (the oracle)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import amp_graph
from amp_graph import Policy
from amp_graph.demo.models import (
    GPT,
    MLP,
    ConvNet,
    DecoderBlock,
    GPTWithLoss,
    LlamaMLP,
    MixedOpsNet,
    RecurrentNet,
)
from amp_graph.inspect import dataflow


class CountCopies(TorchDispatchMode):
    """Counts aten._to_copy (every dtype conversion) and the bytes it reads and writes."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default:
            self.count += 1
            self.bytes += args[0].numel() * (args[0].dtype.itemsize + out.dtype.itemsize)
        return out


def measured(compiled, inputs):
    with CountCopies() as forward:
        out = compiled(*inputs)
    loss = out if out.dim() == 0 else out.sum()
    with CountCopies() as backward:
        loss.backward()
    return forward.count, forward.bytes, backward.count, backward.bytes


# O1 with every cast kept for backward: dataflow's backward totals are then exact
KEEPING_O1 = dataclasses.replace(Policy.preset("O1"), recompute_casts=False)

CASES = {
    "MLP": (MLP, lambda: (torch.randn(4, 64),)),
    "DecoderBlock": (lambda: DecoderBlock(32, 4), lambda: (torch.randn(2, 8, 32),)),
    "GPT": (GPT, lambda: (torch.randint(0, 64, (2, 16)),)),
    "GPTWithLoss": (GPTWithLoss, lambda: (torch.randint(0, 64, (2, 16)),) * 2),
    "ConvNet": (ConvNet, lambda: (torch.randn(2, 1, 8, 8),)),
    "LlamaMLP": (LlamaMLP, lambda: (torch.randn(2, 5, 32),)),  # the model's own .float()
    "MixedOpsNet": (MixedOpsNet, lambda: (torch.randn(3, 16),)),
}


@pytest.mark.parametrize("policy", ["O1", "O2", "autocast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_conversions_match_what_pytorch_runs(name, dtype, policy):
    """Exact with the casts kept for backward; with ``recompute_casts`` (the default)
    backward also casts again, at most once each, the recomputed copies an op saved."""
    make_model, make_inputs = CASES[name]
    inputs = make_inputs()
    for recompute in (False, True):
        torch.manual_seed(0)
        chosen = dataclasses.replace(Policy.preset(policy), recompute_casts=recompute)
        compiled = amp_graph.compile(make_model(), chosen, dtype, example_inputs=inputs)
        total = dataflow(compiled).total
        predicted = (
            total.forward_casts,
            total.forward_bytes,
            total.backward_casts,
            total.backward_bytes,
        )
        got = measured(compiled, inputs)
        if not recompute:
            assert predicted == got
            continue
        recomputed = amp_graph.report(compiled).casts_recomputed
        assert got[:2] == predicted[:2]
        assert predicted[2] <= got[2] <= predicted[2] + recomputed


def test_rnn_conversions_in_fp16():
    # bf16 LSTMs on CPU convert weights inside the kernel's backward; fp16 runs as planned.
    inputs = (torch.randn(2, 5, 8),)
    compiled = amp_graph.compile(RecurrentNet(), KEEPING_O1, torch.float16, example_inputs=inputs)
    total = dataflow(compiled).total
    assert (
        total.forward_casts,
        total.forward_bytes,
        total.backward_casts,
        total.backward_bytes,
    ) == measured(compiled, inputs)


@pytest.fixture(scope="module")
def block() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return amp_graph.compile(
        DecoderBlock(32, 4), "O1", torch.bfloat16, example_inputs=(torch.randn(2, 8, 32),)
    )


def test_rows_per_module_add_up_to_the_total(block):
    flow = dataflow(block)
    assert [r.module for r in flow.rows][:3] == ["ln1", "attn.q", "attn"]
    for field in ("forward_casts", "forward_bytes", "backward_casts", "backward_bytes"):
        assert sum(getattr(r, field) for r in flow.rows) == getattr(flow.total, field)
    assert flow.total.forward_bytes == amp_graph.report(block).cast_bytes  # no model casts here
    tensor_ops = {k: v for k, v in amp_graph.report(block).ops_by_dtype.items() if k != "-"}
    assert dict(flow.total.ops) == tensor_ops  # O1 here: every op computes in its output dtype


def test_depth_groups_modules(block):
    flow = dataflow(block, depth=1)
    by_name = {r.module: r for r in flow.rows}
    assert set(by_name) == {"ln1", "attn", "(top level)", "ln2", "fc", "out"}
    attn = by_name["attn"]
    assert attn.type == "CausalSelfAttention" and attn.ops["bf16"] == 13
    assert attn.forward_casts == 8  # q, k, v, proj: a weight and a bias each
    assert (
        attn.forward_bytes == 4 * (32 * 32 + 32) * 6 and attn.backward_bytes == attn.forward_bytes
    )
    top = by_name["(top level)"]
    assert top.forward_casts == 0 and top.backward_casts == 2  # the residual adds promote


def test_the_backward_convention(block):
    by_node = {c.node: c for c in dataflow(block).conversions}
    weight = by_node["model_attn_q_weight_bf16"]
    assert weight.kind == "cast" and weight.forward_bytes == weight.backward_bytes == 32 * 32 * 6
    assert weight.module == "attn.q"  # the cast of a weight counts in the module using it
    promotion = by_node["add"]  # the residual: x (fp32) + the attention's bf16 output
    assert promotion.kind == "promotion" and promotion.forward_bytes == 0
    assert (promotion.source, promotion.target) == ("bf16", "fp32")
    assert promotion.backward_bytes == 2 * 8 * 32 * 6


def test_mixed_dtype_kernels_are_not_promotions():
    # aten.batch_norm takes bf16 activations with fp32 weights and statistics and returns
    # each gradient in its input's own dtype: no conversion (the oracle test checks totals).
    compiled = amp_graph.compile(ConvNet(), "O1", example_inputs=(torch.randn(2, 1, 8, 8),))
    norms = [n for n in compiled.graph.nodes if n.target is torch.ops.aten.batch_norm.default]
    assert norms and norms[0].meta["amp"].out_dtype == torch.bfloat16
    flow = dataflow(compiled)
    assert {c.kind for c in flow.conversions} == {"cast"}
    assert not {c.node for c in flow.conversions} & {n.name for n in norms}


def test_the_backend_graph_has_the_same_data_flow(fresh_dynamo):
    # Dynamo lifts parameters to graph inputs: their gradients and owning modules come from
    # dynamo's own records, so the same model gives the same table as amp_graph.compile.
    model, x = DecoderBlock(32, 4), torch.randn(2, 8, 32)
    compiled = torch.compile(model, backend=amp_graph.backend(inner="eager"))
    compiled(x)
    [gm] = amp_graph.captured_graphs(compiled)
    reference = dataflow(amp_graph.compile(model, example_inputs=(x,)), depth=1)
    flow = dataflow(gm, depth=1)
    assert flow.total.backward_casts == 16
    assert str(flow) == str(reference)


def test_frozen_parameters_have_no_backward_casts():
    model = MLP()
    model.requires_grad_(False)
    model.head.requires_grad_(True)
    compiled = amp_graph.compile(model, example_inputs=(torch.randn(4, 64),))
    by_node = {c.node: c for c in dataflow(compiled).conversions}
    assert by_node["model_fc1_weight_bf16"].backward_bytes == 0
    head = by_node["model_head_weight_bf16"]
    assert head.backward_bytes == head.forward_bytes > 0


def test_with_symbolic_sizes_bytes_are_unknown():
    compiled, x = amp_graph.compile(MLP(), KEEPING_O1), torch.randn(4, 64)
    compiled(x)  # captured at the first call, with this call's sizes
    _, forward_bytes, _, backward_bytes = measured(compiled, (x,))
    assert dataflow(compiled).total.forward_bytes == forward_bytes
    compiled(torch.randn(5, 64))  # a second size: captured again, with a symbolic batch
    flow = dataflow(compiled)
    assert len(compiled.graph_modules) == 2
    assert flow.total.forward_casts == 7 and flow.total.forward_bytes is None  # x's cast
    # backward: only the weights' and biases' casts, whose sizes do not depend on the batch
    assert flow.total.backward_bytes == backward_bytes
    assert "forward: 7 conversions, bytes unknown (symbolic or unknown sizes)" in flow.summary()


def test_text_and_html(block):
    flow = dataflow(block, depth=1)
    text = str(flow)
    assert text.splitlines()[0].split()[:4] == ["module", "type", "ops", "fp32"]
    assert "81,600" in text and "backward:" in text
    html = flow._repr_html_()
    assert html.count("<tr") == len(flow.rows) + 2 and "font-weight:600" in html


def test_the_summary_counts_conversions_of_unknown_size():
    compiled = amp_graph.compile(DecoderBlock(32, 4), "O1", torch.bfloat16)
    compiled(torch.randn(2, 8, 32))
    compiled(torch.randn(3, 5, 32))  # symbolic batch and sequence: activations' sizes unknown
    flow = dataflow(compiled)
    assert flow.total.backward_casts == 16 and flow.total.backward_bytes is None
    assert flow.summary().endswith("(14 cast, 2 promotion)")
