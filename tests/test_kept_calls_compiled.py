"""Custom ops and custom autograd Functions, compiled, compute as torch.autocast runs them.

amp_graph keeps each custom op call and each custom Function call as one node that runs
under the capture's autocast state. A compiler that traces the graph must not lose that:
AOTAutograd keeps a custom op without the autocast around it (its body would compute in
float32, as it does under ``torch.compile`` + torch.autocast), and dynamo cannot trace the
autocast switch around a Function call. torch.autocast in eager mode is the oracle: the same
model's outputs (bit for bit; inductor fuses only the ops around the calls) and gradients
(within bf16's rounding: inductor orders the bias gradients' sums its own way), and what the
custom op's body computes in at run time.

Paths: ``amp_graph.compile(mode="default")`` (the CUDA default), ``Graph`` with
``enable_compile``, and the backend with ``inner="inductor"`` / ``"aot_eager"``. The models
are written as people write them: a Liger-style custom op with its own backward, a Function
decorated with ``torch.amp.custom_fwd`` (flash-attn's style), one whose backward reads a
dtype from its gradient, and a bitsandbytes-style Function with a lazily filled state.

``amp_graph.export`` cannot carry autocast into a program, which calls each op with autocast
off: a custom op whose dtypes autocast decides is refused by name, and one that decides its
own dtypes is kept and computes what torch.autocast's run computes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from test_custom_ops import Int8Matmul, QuantState
from torch._subclasses.fake_tensor import FakeTensor

import amp_graph
from amp_graph.capture.autocast_ops import NAMESPACE, autocast_op
from amp_graph.capture.autograd_functions import AutocastState, function_calls
from amp_graph.frontends.compiled_segments import compiled_around_calls

BF16 = torch.bfloat16

# the dtype each real (not fake) run of the op's body computed its product in
BODY_DTYPES: list[torch.dtype] = []


@torch.library.custom_op("amp_graph_kept_calls_test::fused_mm", mutates_args=())
def fused_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A Liger-style fused kernel: a matmul body, which eager autocast runs in bf16."""
    product = a @ w.t()
    if not isinstance(product, FakeTensor):
        BODY_DTYPES.append(product.dtype)
    return torch.relu(product)


@fused_mm.register_fake
def _(a, w):
    return a.new_empty((*a.shape[:-1], w.shape[0]))


def _fused_mm_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, output)


def _fused_mm_backward(ctx, grad):
    a, w, out = ctx.saved_tensors
    grad = grad * (out > 0).to(grad.dtype)
    return (grad @ w.to(grad.dtype)).to(a.dtype), (grad.t() @ a.to(grad.dtype)).to(w.dtype)


fused_mm.register_autograd(_fused_mm_backward, setup_context=_fused_mm_context)


class Float32Softmax(torch.autograd.Function):
    """flash-attn's style of precision control: inputs cast to float32, autocast off inside."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x):
        out = torch.softmax(x, -1)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return out * (grad - (grad * out).sum(-1, keepdim=True))


class ReadsGradDtype(torch.autograd.Function):
    """A matmul whose backward casts its saved weight to the gradient's dtype."""

    calls = 0  # forward runs: a Function kept whole runs its forward at every call

    @staticmethod
    def forward(ctx, a, w):
        ReadsGradDtype.calls += 1
        ctx.save_for_backward(a, w)
        return a @ w.t()

    @staticmethod
    def backward(ctx, grad):
        a, w = ctx.saved_tensors
        return grad @ w.to(grad.dtype), grad.t() @ a.to(grad.dtype)


class Block(nn.Module):
    """One block calling each kind: a linear, the custom op, the three Functions."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.w = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.qweight = nn.Parameter(torch.randn(dim, dim), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim))
        self.state = QuantState()

    def forward(self, x):
        h = fused_mm(self.fc(x), self.w)
        h = Float32Softmax.apply(h) * h
        h = ReadsGradDtype.apply(h, self.w2)
        return Int8Matmul.apply(h, self.qweight, self.bias, self.state)


class OpOnly(nn.Module):
    """The custom op on a bf16 activation and a float32 weight (mixed inputs)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return fused_mm(self.fc(x), self.fc.weight).sum(-1)


def _step(model, x, autocast: bool, owner=None):
    """Output, the gradients of ``owner``'s parameters (default: ``model``'s) and the input's
    gradient of one forward and backward."""
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", BF16, enabled=autocast):
        out = model(x)
    out.float().sum().backward()
    owner = owner or model
    return out, {n: p.grad for n, p in owner.named_parameters() if p.requires_grad}, x.grad


def _assert_as_autocast(got, want):
    """Outputs bit for bit and in autocast's dtype; gradients in its dtypes and within bf16's
    rounding of it."""
    (out, grads, x_grad), (want_out, want_grads, want_x_grad) = got, want
    assert out.dtype == want_out.dtype
    assert torch.equal(out, want_out)
    torch.testing.assert_close(x_grad, want_x_grad, rtol=1.6e-2, atol=1e-2)
    for name, grad in want_grads.items():
        mine = grads[name]
        assert mine is not None and mine.dtype == grad.dtype, name
        torch.testing.assert_close(mine, grad, rtol=1.6e-2, atol=1e-2, msg=name)


def _body_dtypes_of_real_runs(run):
    BODY_DTYPES.clear()
    result = run()
    return result, list(BODY_DTYPES)


@pytest.fixture
def block_and_reference():
    torch.manual_seed(0)
    model = Block()
    return model, copy.deepcopy(model), torch.randn(4, 8)


def test_compile_with_inductor_runs_custom_ops_and_functions_as_autocast(
    fresh_dynamo, block_and_reference
):
    model, reference, x = block_and_reference
    want, want_body = _body_dtypes_of_real_runs(lambda: _step(reference, x, autocast=True))
    assert want_body == [BF16]
    compiled = amp_graph.compile(model, "O1", BF16, mode="default")
    _step(compiled, x, autocast=False)  # the first call compiles
    model.zero_grad(set_to_none=True)
    calls_before = ReadsGradDtype.calls
    got, body = _body_dtypes_of_real_runs(lambda: _step(compiled, x, False, owner=model))
    assert body == [BF16]
    assert ReadsGradDtype.calls == calls_before + 1  # the Function's own forward ran
    _assert_as_autocast(got, want)
    # the graph the user reads still shows the calls; the compiled copy runs them
    assert len(function_calls(compiled.graph_module)) == 4


def test_the_graph_is_compiled_in_pieces_between_function_calls(block_and_reference):
    model, _, x = block_and_reference
    compiled = amp_graph.compile(model, "O1", BF16, mode="eager", example_inputs=(x,))
    pieces_compiled = []

    def compile_piece(piece):
        pieces_compiled.append(piece)
        return piece

    split = compiled_around_calls(compiled.graph_module, compile_piece)
    # the custom op stays inside a piece, as amp_graph's op; the three Functions split the
    # rest into the linear and the op, then the product (none between the last two calls)
    assert len(pieces_compiled) == 2
    inside = [n.target for p in pieces_compiled for n in p.graph.nodes if n.op == "call_function"]
    assert any(getattr(t, "namespace", None) == NAMESPACE for t in inside)
    assert not any(function_calls(p) for p in pieces_compiled)
    assert len(function_calls(split)) == 0  # the calls sit in pieces of their own
    call_pieces = [
        p
        for p in split.children()
        if isinstance(p, torch.fx.GraphModule) and all(p is not c for c in pieces_compiled)
    ]
    assert [len(function_calls(p)) for p in call_pieces] == [1, 1, 1]


def test_graph_enable_compile_runs_custom_ops_and_functions_as_autocast(
    fresh_dynamo, block_and_reference
):
    model, reference, x = block_and_reference
    want, _ = _body_dtypes_of_real_runs(lambda: _step(reference, x, autocast=True))

    class Step(amp_graph.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.config.enable_amp(True, dtype=BF16)
            self.config.enable_compile(fullgraph=True)
            # lr 0: the gradients are what the test reads; the weights stay the reference's
            self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))

        def build(self, x):
            out = self.model(x)
            out.float().sum().backward()
            return out

    step = Step()
    step(x.clone().requires_grad_())
    model.zero_grad(set_to_none=True)
    xs = x.clone().requires_grad_()
    out, body = _body_dtypes_of_real_runs(lambda: step(xs))
    assert body == [BF16]
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    _assert_as_autocast((out, grads, xs.grad), want)


@pytest.mark.parametrize("inner", ["inductor", "aot_eager"])
def test_the_backend_through_aot_autograd_runs_a_custom_op_body_under_autocast(fresh_dynamo, inner):
    torch.manual_seed(0)
    model = OpOnly()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    want, want_body = _body_dtypes_of_real_runs(lambda: _step(reference, x, autocast=True))
    compiled = torch.compile(model, backend=amp_graph.backend("autocast", BF16, inner=inner))
    got, body = _body_dtypes_of_real_runs(lambda: _step(compiled, x, False, owner=model))
    assert want_body == body == [BF16]
    _assert_as_autocast(got, want)


def test_the_autocast_op_computes_the_users_op_under_its_state_bit_for_bit():
    torch.manual_seed(0)
    a, w = torch.randn(3, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True)
    state = AutocastState.of_policy("cpu", BF16)
    op = autocast_op(torch.ops.amp_graph_kept_calls_test.fused_mm.default, state)
    assert op is autocast_op(torch.ops.amp_graph_kept_calls_test.fused_mm.default, state)
    out = op(a, w)
    out.float().sum().backward()
    got = out, a.grad.clone(), w.grad.clone()
    a.grad = w.grad = None
    with torch.autocast("cpu", BF16):
        want = fused_mm(a, w)
    want.float().sum().backward()
    assert out.dtype == BF16 and torch.equal(got[0], want)
    assert torch.equal(got[1], a.grad) and torch.equal(got[2], w.grad)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = op(mode.from_tensor(a), mode.from_tensor(w))
    assert fake.dtype == BF16 and fake.shape == (3, 5)  # the body's dtype, not register_fake's


# --- export: a program calls ops with autocast off ------------------------------------------


@torch.library.custom_op("amp_graph_kept_calls_test::own_autocast_mm", mutates_args=())
def own_autocast_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The advised form for export: the body decides its dtype itself."""
    with torch.autocast("cpu", BF16):
        return a @ w.t()


@own_autocast_mm.register_fake
def _(a, w):
    return a.new_empty((*a.shape[:-1], w.shape[0]), dtype=BF16)


@torch.library.custom_op("amp_graph_kept_calls_test::scaled_sin", mutates_args=())
def scaled_sin(a: torch.Tensor) -> torch.Tensor:
    """Computes in its input's dtype, with autocast on or off."""
    return a.sin() * 2


@scaled_sin.register_fake
def _(a):
    return torch.empty_like(a)


@torch.library.custom_op("amp_graph_kept_calls_test::host_round", mutates_args=())
def host_round(a: torch.Tensor) -> torch.Tensor:
    """An opaque kernel: it reads values on the host, so its body cannot run on fakes."""
    return torch.tensor(a.tolist(), dtype=a.dtype).round()


@host_round.register_fake
def _(a):
    return torch.empty_like(a)


class OpOnFloat32(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x):
        return fused_mm(x, self.w).sum(-1)


class AutocastFreeOps(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        h = own_autocast_mm(scaled_sin(self.fc(x)), self.fc.weight)
        return host_round(h.float().softmax(-1) * 100)


@pytest.mark.parametrize(
    ("model_type", "off"),
    [
        (OpOnFloat32, "with autocast off it computes fp32"),
        (OpOnly, r"with autocast off it computes an error \(mm.default on bf16, fp32 inputs\)"),
    ],
)
def test_export_refuses_a_custom_op_whose_dtype_autocast_decides(model_type, off):
    from amp_graph.deploy.custom_op_bodies import AutocastDependentOp

    with pytest.raises(
        AutocastDependentOp,
        match=rf"custom op amp_graph_kept_calls_test::fused_mm.*{off}.*inside its body",
    ):
        amp_graph.export(model_type(), (torch.randn(4, 8),), policy="O1", dtype=BF16)


def test_export_refuses_a_register_autocast_rule_it_cannot_carry():
    from test_custom_ops import RegisteredAutocast

    from amp_graph.deploy.custom_op_bodies import AutocastDependentOp

    with pytest.raises(AutocastDependentOp, match=r"cast_mm \(node cast_mm\).*computes bf16"):
        amp_graph.export(RegisteredAutocast(), (torch.randn(3, 4),), policy="O1", dtype=BF16)


def test_export_keeps_custom_ops_that_decide_their_own_dtypes():
    torch.manual_seed(0)
    model, x = AutocastFreeOps(), torch.randn(4, 8)
    with torch.autocast("cpu", BF16):
        want = model(x)
    program = amp_graph.export(model, (x,), policy="O1", dtype=BF16)
    ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert {
        "amp_graph_kept_calls_test.own_autocast_mm.default",
        "amp_graph_kept_calls_test.host_round.default",
    } <= ops
    assert torch.equal(program.module()(x), want)
