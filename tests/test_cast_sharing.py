"""One rule for sharing a cast (passes/sharing.py), as the three passes that share casts use it.

simplify_casts (one ``x.to(d)`` for several readers), fp8_linears (one float8 quantization
for several fp8 linears) and hoist_parameter_casts (a parameter cast once per step for every
micro-batch) share a cast only where no write into the value's storage, and no grad-mode
change, lies between the cast and its reader. Each test builds the case one of the passes
once got wrong and compares with torch.autocast or an eager reference.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from amp_graph.passes.insert_casts import make_cast
from amp_graph.passes.meta import AMP, AmpInfo, Role
from amp_graph.passes.sharing import ENTRY, CastSharing, key_before_graph, written_values
from amp_graph.passes.simplify_casts import simplify_casts

import amp_graph
from amp_graph.ops import fp8_ops
from amp_graph.policy import Rule
from amp_graph.training.nn_graph import Graph

BF16 = torch.bfloat16
aten = torch.ops.aten


def calls(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is target]


def position(gm: fx.GraphModule, node: fx.Node) -> int:
    return list(gm.graph.nodes).index(node)


# ---- fp8_linears: a value written between two fp8 linears is quantized again ------------------


class WrittenBetweenLinears(nn.Module):
    """``h`` feeds two fp8 linears and is written, through a view, between them: the
    second linear reads ``h`` itself (export rewires nothing), with new values."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 16), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.relu()
        a = self.fc1(h)
        h[:, :8].mul_(4.0)
        return a + self.fc2(h)


class EagerFp8(nn.Module):
    """The reference: the same forward, each linear computed by amp_graph.ops.fp8_ops.linear."""

    def __init__(self, model: WrittenBetweenLinears) -> None:
        super().__init__()
        self.m = copy.deepcopy(model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.relu()
        a = fp8_ops.linear(h, self.m.fc1.weight, self.m.fc1.bias)
        h[:, :8].mul_(4.0)
        return a + fp8_ops.linear(h, self.m.fc2.weight, self.m.fc2.bias)


def test_fp8_value_written_between_two_linears_is_quantized_again():
    model = WrittenBetweenLinears()
    x = torch.randn(8, 32)
    compiled = amp_graph.compile(model, "fp8", example_inputs=(x,), check_each_pass=True)
    gm = compiled.graph_module
    first, second = calls(gm, torch.ops.amp_graph.fp8_linear.default)
    write = calls(gm, aten.mul_.Tensor)[0]
    assert first.args[0] is second.args[0]  # both read h
    quantized = second.args[2]
    assert quantized is not first.args[2], "the second linear reads the stale quantization"
    assert quantized.target is torch.ops.amp_graph.fp8_quantize.default
    assert position(gm, quantized) > position(gm, write)

    with torch.autocast("cpu", BF16):
        expected = EagerFp8(model)(x)
    assert torch.equal(compiled(x), expected)


# ---- hoist_parameter_casts: a buffer written in place is cast where it is read ----------------


class BufferUpdatedInPlace(nn.Module):
    """A buffer read by a matmul (cast to bf16) before and after an in-place update of it,
    through a view: both reads are of the buffer's own ``get_attr``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("mix", torch.eye(8) + 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        before = self.fc(x) @ self.mix
        self.mix.diagonal().mul_(1.5)
        return before + self.fc(x) @ self.mix


class AccumulatingStep(Graph):
    def __init__(self, model: nn.Module, micro_batches: int) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        self.config.enable_amp(True, policy="O1", dtype=BF16)
        self.config.set_gradient_accumulation_steps(micro_batches)

    def build(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.model(x).float().pow(2).mean()
        loss.backward()
        return loss


def _hoisted_targets(build: fx.GraphModule) -> set[str]:
    """The casts the step graph makes for ``build``: the parameters whose getitem of
    ``low_precision_weights`` replaced their cast (named after it)."""
    weights = [n for n in build.graph.nodes if n.name == "low_precision_weights"]
    return {u.name for w in weights for u in w.users if u.target is operator.getitem}


def test_buffer_written_in_place_is_not_hoisted_and_every_micro_batch_reads_it_fresh():
    torch.manual_seed(0)
    base, batches = BufferUpdatedInPlace(), [torch.randn(4, 8) for _ in range(2)]
    model = copy.deepcopy(base)
    step = AccumulatingStep(model, micro_batches=2)
    losses = [step(x) for x in batches]

    ref = copy.deepcopy(base)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x in batches:
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for part in x.chunk(2):
            with torch.autocast("cpu", BF16):
                loss = ref(part).float().pow(2).mean() / 2
            loss.backward()
            total += loss.detach()
        opt.step()
        torch.testing.assert_close(losses.pop(0).detach(), total, rtol=0, atol=1e-6)
    assert torch.equal(model.mix, ref.mix)  # 4 updates of the buffer, in both
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)

    build = step.build_graph
    hoisted = _hoisted_targets(build)
    assert {"model_fc_weight_bf16", "model_fc_bias_bf16"} <= hoisted  # still cast once per step
    assert not any("mix" in name for name in hoisted)
    write = calls(build, aten.mul_.Tensor)[0]
    mix_casts = [
        n for n in build.graph.nodes if n.target == "to" and n.args[0].target == "model.mix"
    ]
    assert len(mix_casts) == 2  # one on each side of the write, in the graph
    assert position(build, mix_casts[0]) < position(build, write) < position(build, mix_casts[1])


# ---- simplify_casts: no cast shared across a torch.no_grad() block ---------------------------


class ReadsInsideAndOutsideNoGrad(nn.Module):
    """``fc`` runs inside ``torch.no_grad()`` (a statistic) and again outside it: the weight
    cast made inside has no autograd history and must not feed the second call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.skip = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = self.fc(x).abs().mean()
        return self.fc(x) * scale + self.skip(x)


def test_no_cast_is_shared_across_a_no_grad_block_and_gradients_equal_autocast():
    model = ReadsInsideAndOutsideNoGrad()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    compiled = amp_graph.compile(model, "O1", BF16, example_inputs=(x,), check_each_pass=True)
    out = compiled(x)
    out.float().sum().backward()
    with torch.autocast("cpu", BF16):
        expected = ref(x_ref)
    expected.float().sum().backward()

    assert torch.equal(out, expected)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None, f"{name}: no gradient (its cast was made under no_grad)"
        assert torch.equal(p.grad, q.grad), name
    assert torch.equal(x.grad, x_ref.grad)

    gm = compiled.graph_module
    restore = calls(gm, torch._C._set_grad_enabled)[-1]
    inside, outside, _skip = calls(gm, aten.linear.default)
    for cast_in, cast_out in zip(inside.args, outside.args, strict=True):
        assert cast_in is not cast_out  # x, weight and bias: each cast again outside
        assert position(gm, cast_out) > position(gm, restore)


# ---- the rule itself, on small graphs --------------------------------------------------------


def test_keys_follow_grad_mode_blocks_and_tied_attributes():
    """A block's restoring ``_set_grad_enabled(previous)`` returns to the entry mode; a write
    into one attribute is a write into another attribute of the same tensor."""
    root = nn.Module()
    root.a = nn.Parameter(torch.randn(4))
    root.b = root.a  # tied
    graph = fx.Graph()
    a, b = graph.get_attr("a"), graph.get_attr("b")
    previous = graph.call_function(torch.is_grad_enabled, ())
    no_grad = graph.call_function(torch._C._set_grad_enabled, (False,))
    restore = graph.call_function(torch._C._set_grad_enabled, (previous,))
    write = graph.call_function(aten.mul_.Tensor, (b, 2.0))
    graph.output((a,))
    gm = fx.GraphModule(root, graph)

    sharing, keys = CastSharing(gm), {}
    for node in gm.graph.nodes:
        keys[node] = sharing.key(a)
        sharing.visit(node)
    assert keys[previous] == (a, 0, ENTRY) == key_before_graph(a, set())
    assert keys[restore] == (a, 0, False)  # inside the block
    assert keys[write] == keys[previous]  # after it: the entry mode again
    assert sharing.key(a) == (a, 1, ENTRY)  # b's write is a's
    assert a in written_values(gm) and key_before_graph(a, written_values(gm)) is None
    assert no_grad not in written_values(gm)


def _chain_with_write(write_before_outer: bool) -> fx.GraphModule:
    """x (fp16) -> fp32 -> fp16, a lossless chain, and ``x.add_(1)`` either between its two
    casts or after both (before the reader): the reader must see x's old values."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta[AMP] = AmpInfo(role=Role.INPUT, out_dtype=torch.float16, exact=True)
    inner = make_cast(graph, x, torch.float32, "relu")

    def write() -> None:
        node = graph.call_function(aten.add_.Tensor, (x, 1.0))
        node.meta[AMP] = AmpInfo(role=Role.INPLACE, out_dtype=torch.float16, exact=True)

    if write_before_outer:
        write()
    outer = make_cast(graph, inner, torch.float16, "relu")
    if not write_before_outer:
        write()
    relu = graph.call_function(aten.relu.default, (outer,))
    relu.meta[AMP] = AmpInfo(role=Role.OP, rule=Rule.FOLLOW, out_dtype=torch.float16)
    graph.output(relu).meta[AMP] = AmpInfo(role=Role.OUTPUT, out_dtype=torch.float16)
    return fx.GraphModule(nn.Module(), graph)


@pytest.mark.parametrize("write_before_outer", [True, False], ids=["between", "after"])
def test_lossless_chain_is_not_folded_across_a_write_of_its_origin(write_before_outer):
    gm = _chain_with_write(write_before_outer)
    simplify_casts(gm)
    gm.recompile()
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    assert relu.args[0].op != "placeholder", "the reader reads x after the write"
    x = torch.tensor([-1.0, 0.5, 2.0], dtype=torch.float16)
    assert torch.equal(gm(x.clone()), x.relu())
