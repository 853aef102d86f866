"""A widening cast folded into the op that reads it (passes/absorb_casts.py): the op takes
``dtype=`` instead, the same bits forward and backward, and the graph shows it.

The oracle is the same compile with the pass replaced by one that changes nothing (the
cast left in the graph); gradients and outputs must be equal, bit for bit.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from amp_graph.passes import absorb_casts as absorb_casts_pass
from amp_graph.passes import pipeline
from amp_graph.passes.result import PassResult

import amp_graph
from amp_graph.demo.models import NanoAttention

# the modules (``amp_graph.passes`` exports the pass functions under the same names)
aten = torch.ops.aten


class Reduce(nn.Module):
    """A linear (bf16 under O1), then one op that takes ``dtype=``."""

    def __init__(self, reduce: Callable[[torch.Tensor], torch.Tensor], width: int = 24) -> None:
        super().__init__()
        self.fc = nn.Linear(8, width)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.fc(x) * 1.5)


# each op as the model writes it; ``dtype=`` given, as absorb_casts rewrites it
REDUCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "softmax": lambda h, **dtype: torch.softmax(h, -1, **dtype),
    "log_softmax": lambda h, **dtype: torch.log_softmax(h, -1, **dtype),
    "sum": lambda h, **dtype: h.sum(**dtype),
    "sum_dim": lambda h, **dtype: h.sum(-1, **dtype),
    "mean": lambda h, **dtype: h.mean(**dtype),
    "mean_dim": lambda h, **dtype: h.mean(-1, keepdim=True, **dtype),
}
# mean is not in O1's float32 list: compute it in float32 so that it reads a widened input
POLICY = amp_graph.Policy.preset("O1").override(ops={torch.mean: "fp32", torch.Tensor.mean: "fp32"})


def _not_absorbing(gm: torch.fx.GraphModule) -> PassResult:
    return PassResult(gm, modified=False, stats={})


def run(compiled: nn.Module, model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Output and every gradient (parameters and input) after one backward."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = compiled(x)
    out.float().square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return [out.detach(), x.grad.clone(), *grads]


def absorbed_and_not(
    model: nn.Module, x: torch.Tensor, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> tuple[nn.Module, list[torch.Tensor], list[torch.Tensor]]:
    absorbed = amp_graph.compile(model, POLICY, dtype, example_inputs=(x,))
    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "absorb_casts", _not_absorbing)
        kept = amp_graph.compile(model, POLICY, dtype, example_inputs=(x,))
    assert amp_graph.report(kept).casts_absorbed == 0
    return absorbed, run(absorbed, model, x), run(kept, model, x)


def assert_same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for got, want in zip(a, b, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_each_op_takes_the_cast_as_its_dtype_with_the_same_bits(name, dtype, monkeypatch):
    torch.manual_seed(0)
    model = Reduce(REDUCTIONS[name])
    absorbed, got, want = absorbed_and_not(model, torch.randn(5, 8), dtype, monkeypatch)
    assert_same_bits(got, want)
    (op_node,) = [n for n in absorbed.graph.nodes if n.meta["amp"].cast_absorbed]
    assert op_node.target in absorb_casts_pass.TAKES_DTYPE
    assert op_node.args[0].meta["val"].dtype == dtype  # reads the narrow value itself
    given = op_node.kwargs.get("dtype", op_node.args[2] if len(op_node.args) > 2 else None)
    assert given is torch.float32
    assert amp_graph.report(absorbed).casts_absorbed == 1


def test_nanogpt_attention_softmax_and_log_softmax_absorb_their_casts(monkeypatch):
    torch.manual_seed(0)
    model = NanoAttention()
    x = torch.randn(2, 16, 32)
    absorbed, got, want = absorbed_and_not(model, x, torch.bfloat16, monkeypatch)
    assert_same_bits(got, want)
    code = absorbed.code
    assert "aten.softmax.int(mul, -1, torch.float32)" in code.replace("masked_fill", "mul")
    assert "log_softmax.int(" in code and ", -1, torch.float32)" in code
    report = amp_graph.report(absorbed)
    assert report.casts_absorbed == 2
    # the float32 copies no longer in the graph: the attention scores and the logits
    assert report.absorbed_cast_bytes == (2 * 4 * 16 * 16 + 2 * 16 * 11) * 4
    assert "absorbed into an op's dtype= 2 (" in report.totals()
    softmax = next(n for n in absorbed.graph.nodes if n.target is aten.softmax.int)
    text = str(amp_graph.explain(absorbed, softmax.name))
    assert "widens its input to fp32 itself, by its dtype=" in text
    diff = amp_graph.inspect.diff(absorbed)
    assert any("dtype=fp32" in row.detail for row in diff.rows if row.node == softmax.name)


def test_cumsum_keeps_its_cast():
    """cumsum's ``dtype=`` would change its gradient's bits (its derivative casts the
    gradient down before the reverse sum): the cast stays, and the bits are the cast's."""
    model = Reduce(lambda h: h.cumsum(1))
    x = torch.randn(5, 8)
    compiled = amp_graph.compile(model, "O1", torch.bfloat16, example_inputs=(x,))
    assert amp_graph.report(compiled).casts_absorbed == 0
    cumsum = next(n for n in compiled.graph.nodes if n.target is aten.cumsum.default)
    assert cumsum.args[0].meta["amp"].role.value == "cast" and "dtype" not in cumsum.kwargs
    leaf = torch.randn(5, 24, dtype=torch.bfloat16, requires_grad=True)
    torch.cumsum(leaf, 1, dtype=torch.float32).square().sum().backward()
    absorbed_grad, leaf.grad = leaf.grad, None
    leaf.float().cumsum(1).square().sum().backward()
    assert not torch.equal(absorbed_grad, leaf.grad)  # why it is not in TAKES_DTYPE


def test_a_cast_several_ops_read_stays_one_cast():
    """One float32 copy read by softmax and by sum: absorbing it would make each op cast
    again (two conversions instead of one), so it stays."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.fc(x)
            return torch.softmax(h, -1), h.sum(-1)

    x = torch.randn(4, 8)
    compiled = amp_graph.compile(Shared(), "O1", torch.bfloat16, example_inputs=(x,))
    assert amp_graph.report(compiled).casts_absorbed == 0
    assert not any(n.meta["amp"].cast_absorbed for n in compiled.graph.nodes)


def test_the_models_own_cast_is_kept_as_written():
    """``F.softmax(x.float(), -1)``: the model's own cast is never altered."""

    class OwnCast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.softmax(self.fc(x).float(), -1)

    x = torch.randn(4, 8)
    compiled = amp_graph.compile(OwnCast(), "O1", torch.bfloat16, example_inputs=(x,))
    assert amp_graph.report(compiled).casts_absorbed == 0
    softmax = next(n for n in compiled.graph.nodes if n.target is aten.softmax.int)
    assert softmax.args[0].meta["amp"].role.value == "user_cast"


def test_conversions_are_counted_as_torch_runs_them():
    """dataflow counts softmax's dtype= as a forward cast (an aten ``_to_copy`` of its own)
    and a reduction's as none (its kernel converts); both have a backward cast."""
    x = torch.randn(2, 16, 32)
    flow = amp_graph.inspect.dataflow(
        amp_graph.compile(NanoAttention(), "O1", torch.bfloat16, example_inputs=(x,))
    )
    absorbed = [c for c in flow.conversions if c.kind == "absorbed cast"]
    assert len(absorbed) == 2 and all(c.forward_bytes and c.backward_bytes for c in absorbed)
    x = torch.randn(5, 8)
    summed = amp_graph.inspect.dataflow(
        amp_graph.compile(Reduce(REDUCTIONS["sum"]), "O1", torch.bfloat16, example_inputs=(x,))
    )
    (reduction,) = [c for c in summed.conversions if c.kind == "absorbed cast"]
    assert reduction.forward_bytes == 0 and reduction.backward_bytes == 5 * 24 * (2 + 4)


OP_OF = {  # the aten op each of REDUCTIONS runs
    "softmax": aten.softmax.int,
    "log_softmax": aten.log_softmax.int,
    "sum": aten.sum.default,
    "sum_dim": aten.sum.dim_IntList,
    "mean": aten.mean.default,
    "mean_dim": aten.mean.dim,
}


def _on_fake_cuda(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with every value's meta moved to a fake CUDA tensor (no GPU needed)."""
    from oracles import _to_fake_cuda
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["val"] = _to_fake_cuda(node.meta["val"], mode)
    return gm


AUTOCAST_SETS_DTYPE = ("softmax", "log_softmax", "sum", "sum_dim")  # CUDA autocast's dtype= ops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_on_cuda_the_ops_autocast_gives_dtype_absorb(name, dtype, monkeypatch):
    """On CUDA the pass absorbs the casts of the ops CUDA autocast itself calls with
    ``dtype=float32`` (softmax, log_softmax, sum), whatever the narrow dtype, and leaves
    mean's (autocast has no rule for mean; with ``dtype=`` a CUDA mean reads the narrow input
    in another order than the cast). On fake CUDA tensors: no GPU needed."""
    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "absorb_casts", _not_absorbing)
        # casts as absorb_casts sees them (recompute_casts rewrites them later)
        policy = dataclasses.replace(POLICY, recompute_casts=False)
        x = torch.randn(5, 8)
        kept = amp_graph.compile(Reduce(REDUCTIONS[name]), policy, dtype, example_inputs=(x,))
    gm = _on_fake_cuda(copy.deepcopy(kept.graph_module))
    absorbed = absorb_casts_pass.absorb_casts(gm).stats["casts_absorbed"]
    expected = name in AUTOCAST_SETS_DTYPE
    assert absorbed == int(expected)
    assert absorb_casts_pass.absorbs(OP_OF[name], torch.device("cuda")) is expected
    assert absorb_casts_pass.absorbs(OP_OF[name], torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(REDUCTIONS))
@pytest.mark.parametrize("width", [24, 1000, 3000])
def test_on_cuda_an_absorbed_op_runs_autocasts_bits(name, dtype, width):
    """On a GPU: O1 compiled against CUDA torch.autocast, bit for bit, forward and backward,
    for the ops whose cast the pass absorbs there (autocast's own ``dtype=`` call), at
    widths where the explicit cast gives other bits (1000 and 3000 on an H200); mean, which
    O1 leaves in the low dtype as autocast does, is compiled as it stands."""
    torch.manual_seed(0)
    model = Reduce(REDUCTIONS[name], width).cuda()
    x = torch.randn(5, 8, device="cuda")
    compiled = amp_graph.compile(model, "O1", dtype, example_inputs=(x,))
    got = run(compiled, model, x)
    with torch.autocast("cuda", dtype=dtype):
        want = run(model, model, x)
    assert_same_bits(got, want)
    assert amp_graph.report(compiled).casts_absorbed == int(name in AUTOCAST_SETS_DTYPE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_on_cuda_nanogpt_attention_is_autocast_bit_for_bit(dtype):
    """nanoGPT attention (matmuls, a -inf mask, softmax, a log-softmax head) compiled under O1
    on a GPU against CUDA torch.autocast: the same bits forward and backward. In float16 the
    capture meets CUDA's ``_softmax(x, dim, half_to_float=True)``, which it once failed on."""
    torch.manual_seed(0)
    model = NanoAttention(dim=64, heads=4, block=128).cuda()
    x = torch.randn(4, 128, 64, device="cuda")
    compiled = amp_graph.compile(model, "O1", dtype, example_inputs=(x,))
    got = run(compiled, model, x)
    with torch.autocast("cuda", dtype=dtype):
        want = run(model, model, x)
    assert_same_bits(got, want)
    assert amp_graph.report(compiled).casts_absorbed == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dataflow_counts_a_forward_copy_only_where_the_op_makes_one(dtype, monkeypatch):
    """An absorbed softmax copies its input in the forward (an aten ``_to_copy``) on a CPU and
    for bf16 on CUDA, not for fp16 on CUDA (``half_to_float`` reads it); a reduction never
    does. Decided on the input's fake value: no GPU needed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        on_cuda = torch.empty(4, 8, dtype=dtype, device="cuda")
        on_cpu = torch.empty(4, 8, dtype=dtype)
    for op in (aten.softmax.int, aten.log_softmax.int):
        assert absorb_casts_pass.copies_input(op, on_cpu)
        assert absorb_casts_pass.copies_input(op, on_cuda) is (dtype == torch.bfloat16)
    assert not absorb_casts_pass.copies_input(aten.sum.default, on_cpu)
    assert not absorb_casts_pass.copies_input(aten.sum.default, on_cuda)
