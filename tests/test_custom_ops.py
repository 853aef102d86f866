"""Custom ops and Function state compute what eager torch.autocast computes.

torch.autocast is the oracle: the same model run eagerly under ``torch.autocast("cpu",
bfloat16)`` gives the outputs and gradients a compiled one must give, bit for bit under
policy="autocast" and O1 on the CPU. The models are written as real code writes them: a
``torch.library.custom_op`` with a matmul body called in forward (its body runs under
autocast in eager mode), one with ``torch.library.register_autocast``, and a
bitsandbytes-style Function that fills a quantized-weight cache on a state object on its
first call.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

import amp_graph
from amp_graph.capture import CaptureError
from amp_graph.capture.autograd_functions import function_calls

BF16 = torch.bfloat16


# --- custom ops as real code writes them ----------------------------------------------------


@torch.library.custom_op("amp_graph_custom_ops_test::scaled_mm", mutates_args=())
def scaled_mm(a: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """A matmul body: under eager autocast it computes in bf16, whatever its inputs."""
    return (a @ w.t()) * scale


@scaled_mm.register_fake
def _(a, w, scale):
    return a.new_empty((*a.shape[:-1], w.shape[0]))


def _scaled_mm_context(ctx, inputs, output):
    a, w, scale = inputs
    ctx.save_for_backward(a, w)
    ctx.scale = scale


def _scaled_mm_backward(ctx, grad):
    a, w = ctx.saved_tensors
    # twice the true gradient: an inlined body would show as half of it
    grad_a = 2 * (grad @ w.to(grad.dtype)) * ctx.scale
    grad_w = 2 * (grad.t() @ a.to(grad.dtype)) * ctx.scale
    return grad_a.to(a.dtype), grad_w.to(w.dtype), None


scaled_mm.register_autograd(_scaled_mm_backward, setup_context=_scaled_mm_context)


@torch.library.custom_op("amp_graph_custom_ops_test::cast_mm", mutates_args=())
def cast_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A matmul that torch.autocast casts to bf16 by its own rule (register_autocast)."""
    return a @ w.t()


@cast_mm.register_fake
def _(a, w):
    return a.new_empty((*a.shape[:-1], w.shape[0]))


def _cast_mm_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _cast_mm_backward(ctx, grad):
    a, w = ctx.saved_tensors
    return (grad @ w.to(grad.dtype)).to(a.dtype), (grad.t() @ a.to(grad.dtype)).to(w.dtype)


cast_mm.register_autograd(_cast_mm_backward, setup_context=_cast_mm_context)
torch.library.register_autocast("amp_graph_custom_ops_test::cast_mm", "cpu", torch.bfloat16)


@torch.library.custom_op("amp_graph_custom_ops_test::no_fake", mutates_args=())
def no_fake(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


class LinearThenOp(nn.Module):
    """(a) a bf16 activation into the op's matmul body, then a float32 custom loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return torch.tanh(scaled_mm(self.fc(x), self.w, 0.5))


class OpOnFloat32(nn.Module):
    """(a) the op on float32 values only: its fake says float32, its body computes bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        # mse_loss computes in float32 under torch.autocast and O1: the plan must know the
        # value of the op is bf16 to cast it
        y = scaled_mm(x, self.w, 2.0)
        return nn.functional.mse_loss(y, torch.zeros_like(y), reduction="none")


class RegisteredAutocast(nn.Module):
    """(b) an op torch.autocast casts by its register_autocast rule, twice."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.w2 = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return cast_mm(cast_mm(x, self.w).float(), self.w2)


class MixedInputs(nn.Module):
    """(c) a bf16 activation and a float32 weight into one op (torch.ops spelling)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.ops.amp_graph_custom_ops_test.scaled_mm(self.fc(x), self.fc.weight, 1.0)


# --- a bitsandbytes-style Function with a lazily filled state ------------------------------


@dataclass
class QuantState:
    """bitsandbytes' MatmulLtState: the quantized weight, filled on first use."""

    CB: torch.Tensor | None = None
    SCB: torch.Tensor | None = None


class Int8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, bias, state):
        if state.CB is None:  # quantize once, cache on the state (as bitsandbytes does)
            state.SCB = b.abs().amax(1, keepdim=True) / 127
            state.CB = torch.round(b / state.SCB).to(torch.int8)
        w = state.CB.to(a.dtype) * state.SCB.to(a.dtype)
        ctx.state = state
        ctx.save_for_backward(a)
        out = a @ w.t()
        return out + bias.to(out.dtype)

    @staticmethod
    def backward(ctx, grad):
        w = ctx.state.CB.to(grad.dtype) * ctx.state.SCB.to(grad.dtype)
        return grad @ w, None, grad.sum(0), None


class Int8Linear(nn.Module):
    def __init__(self, keep_output: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.qweight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(4))
        self.state = QuantState()
        self.keep_output = keep_output

    def forward(self, x):
        out = Int8Matmul.apply(self.fc(x), self.qweight, self.bias, self.state)
        if self.keep_output:  # the model's own code stores a computed value on the state
            self.state.last = out
        return out


# --- helpers -------------------------------------------------------------------------------


def _run(model, x, dtype=BF16, owner=None):
    """Outputs, the gradients of ``owner``'s parameters (default: ``model``'s) and the
    input's gradient of one step of ``model`` (eager under torch.autocast in ``dtype``
    where given, else as it is)."""
    x = x.detach().clone().requires_grad_()
    if dtype is None:
        out = model(x)
    else:
        with torch.autocast("cpu", dtype=dtype):
            out = model(x)
    out.float().sum().backward()
    grads = {name: p.grad for name, p in (owner or model).named_parameters()}
    return out, grads, x.grad


def _assert_bitwise(got, want):
    (out, grads, x_grad), (want_out, want_grads, want_x_grad) = got, want
    assert type(out) is torch.Tensor and out.dtype == want_out.dtype
    assert torch.equal(out, want_out)
    assert torch.equal(x_grad, want_x_grad)
    for name, grad in want_grads.items():
        if grad is None:
            assert grads[name] is None, name
        else:
            assert type(grads[name]) is torch.Tensor and torch.equal(grads[name], grad), name


def _compiled_against_autocast(model_type, policy):
    torch.manual_seed(0)
    model = model_type()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4)
    want = _run(reference, x)
    compiled = amp_graph.compile(model, policy, BF16)
    got = _run(compiled, x, dtype=None, owner=model)
    return compiled, got, want


# --- custom ops ----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["autocast", "O1"])
@pytest.mark.parametrize("model_type", [LinearThenOp, OpOnFloat32, RegisteredAutocast, MixedInputs])
def test_a_custom_op_computes_what_torch_autocast_gives_it_bit_for_bit(model_type, policy):
    compiled, got, want = _compiled_against_autocast(model_type, policy)
    _assert_bitwise(got, want)
    kept = function_calls(compiled.graph_module)
    assert kept and all("amp_graph_custom_ops_test" in n.target.name for n in kept)


def test_a_custom_op_under_o0_computes_in_float32():
    torch.manual_seed(0)
    model = MixedInputs()
    x = torch.randn(3, 4)
    want = _run(copy.deepcopy(model), x, dtype=None)
    compiled = amp_graph.compile(model, "O0", BF16)
    _assert_bitwise(_run(compiled, x, dtype=None, owner=model), want)


@pytest.mark.parametrize("inside_function", [False, True])
def test_a_custom_op_without_fake_names_register_fake_not_the_backend(inside_function):
    class Kernel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return no_fake(x)

        @staticmethod
        def backward(ctx, grad):
            return grad

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            return Kernel.apply(h) if inside_function else no_fake(h)

    with pytest.raises(CaptureError) as raised:
        amp_graph.compile(Model(), "O1", BF16)(torch.randn(2, 4))
    text = str(raised.value)
    assert 'torch.library.register_fake("amp_graph_custom_ops_test::no_fake")' in text
    assert "backend=" not in text


# --- Function state ------------------------------------------------------------------------


def test_a_state_cache_is_filled_by_the_first_real_call_with_real_tensors():
    torch.manual_seed(0)
    model = Int8Linear()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4)
    compiled = amp_graph.compile(model, "autocast", BF16)
    _assert_bitwise(_run(compiled, x, dtype=None, owner=model), _run(reference, x))
    assert type(model.state.CB) is torch.Tensor and model.state.CB.dtype == torch.int8
    assert torch.equal(model.state.CB, reference.state.CB)
    # the user's model still runs eagerly, on the cache the compiled call filled
    eager = _run(model, x)
    assert type(eager[0]) is torch.Tensor and torch.equal(eager[0], _run(reference, x)[0])


def test_a_fake_value_the_model_stores_on_a_function_state_is_refused_by_name():
    with pytest.raises(CaptureError) as raised:
        amp_graph.compile(Int8Linear(keep_output=True), "autocast", BF16)(torch.randn(3, 4))
    text = str(raised.value)
    assert "Int8Matmul" in text and "'last'" in text and "QuantState" in text


def test_the_backend_with_inner_eager_runs_a_custom_op_under_autocast():
    # with inductor, aot_autograd's trace keeps the op without the autocast around it
    # (docs/limits.md)
    torch.manual_seed(0)
    model = MixedInputs()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=amp_graph.backend("autocast", BF16, inner="eager"))
    _assert_bitwise(_run(compiled, x, dtype=None, owner=model), _run(reference, x))


# --- custom ops that write into their inputs -----------------------------------------------


@torch.library.custom_op("amp_graph_custom_ops_test::accumulate_mm", mutates_args=("out",))
def accumulate_mm(out: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> None:
    """vLLM's style: the result written into a buffer. Its matmul is bf16 under autocast."""
    out.add_(a @ w.t())


@accumulate_mm.register_fake
def _(out, a, w):
    return None


@torch.library.custom_op("amp_graph_custom_ops_test::accumulate", mutates_args=("out",))
def accumulate(out: torch.Tensor, a: torch.Tensor) -> None:
    """No product: autocast changes nothing in it."""
    out.add_(a)


@accumulate.register_fake
def _(out, a):
    return None


class WritesIntoBuffer(nn.Module):
    def __init__(self, activation_dtype: torch.dtype | None = None, product: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, 4))
        self.activation_dtype, self.product = activation_dtype, product

    def forward(self, x):
        h = self.fc(x)
        h = h if self.activation_dtype is None else h.to(self.activation_dtype)
        out = torch.zeros(x.shape[0], 4)
        if self.product:
            accumulate_mm(out, h, self.w)
        else:
            accumulate(out, h.float())
        return out


def test_a_mutating_custom_op_whose_body_would_multiply_mixed_dtypes_is_refused_by_name():
    # O1: a bf16 activation and a float32 weight, which only autocast's casts reconcile
    compiled = amp_graph.compile(WritesIntoBuffer(), "O1", BF16)
    with pytest.raises(
        CaptureError,
        match=r"accumulate_mm writes into its inputs.*"
        r"mm.default on bf16, fp32 inputs.*Return the result",
    ):
        compiled(torch.randn(3, 4))


def test_a_mutating_custom_op_computing_in_float32_where_autocast_gives_bf16_warns():
    compiled = amp_graph.compile(WritesIntoBuffer(torch.float32), "O1", BF16)
    with pytest.warns(
        UserWarning,
        match=r"accumulate_mm .*products compute in fp32 where torch.autocast's run computes "
        r"them in bf16\.",
    ):
        compiled(torch.randn(3, 4))


@pytest.mark.parametrize(("policy", "product"), [("O0", True), ("O1", False)])
def test_a_mutating_custom_op_that_autocast_does_not_change_is_taken_quietly(policy, product):
    model = WritesIntoBuffer(torch.float32, product=product)
    want = model(torch.ones(3, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = amp_graph.compile(model, policy, BF16)(torch.ones(3, 4))
    assert got.dtype == want.dtype and torch.allclose(got, want, atol=1e-2)


# --- ... under the backend and export, which capture without autocast ----------------------

BACKEND_OWNER = r"the model \(torch.compile backend\)"


class UsedAroundTheWrite(nn.Module):
    """The buffer read before the op writes into it and after, through a linear that
    computes in bf16: a cast placed before the write would read the old value."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        out = torch.zeros(x.shape[0], 4)
        before = out * 2
        accumulate(out, self.fc(x).float())
        return self.fc2(out) + before.sum()


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_the_backend_checks_a_mutating_custom_op_on_the_dtypes_the_plan_gives(fresh_dynamo, inner):
    def backend():
        torch._dynamo.reset()
        return amp_graph.backend("O1", BF16, inner=inner)

    mixed = torch.compile(WritesIntoBuffer(), backend=backend())
    with pytest.raises(Exception, match=rf"{BACKEND_OWNER}: the custom op .*accumulate_mm writes"):
        mixed(torch.randn(3, 4))
    float32 = torch.compile(WritesIntoBuffer(torch.float32), backend=backend())
    with pytest.warns(UserWarning, match=rf"{BACKEND_OWNER}: .*accumulate_mm .*compute in fp32"):
        float32(torch.randn(3, 4))


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_the_backend_computes_a_mutating_custom_op_as_torch_autocast(fresh_dynamo, inner):
    torch.manual_seed(0)
    model, x = UsedAroundTheWrite(), torch.randn(3, 4)
    with torch.autocast("cpu", BF16):
        want = model(x)
    compiled = torch.compile(model, backend=amp_graph.backend("autocast", BF16, inner=inner))
    got = compiled(x)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize(
    ("activation_dtype", "off"),
    [
        (None, r"its body raises an error \(mm.default on bf16, fp32 inputs\)"),
        (torch.float32, "fp32"),
    ],
)
def test_export_refuses_a_mutating_custom_op_whose_products_autocast_decides(activation_dtype, off):
    from amp_graph.deploy.custom_op_bodies import AutocastDependentOp

    with pytest.raises(
        AutocastDependentOp,
        match=rf"accumulate_mm .*its products compute in bf16 .*with autocast off .*{off}.*"
        "return the result instead",
    ):
        amp_graph.export(
            WritesIntoBuffer(activation_dtype), (torch.randn(3, 4),), policy="O1", dtype=BF16
        )


def test_export_keeps_a_mutating_custom_op_that_autocast_does_not_change():
    torch.manual_seed(0)
    model, x = UsedAroundTheWrite(), torch.randn(3, 4)
    with torch.autocast("cpu", BF16):
        want = model(x)
    program = amp_graph.export(model, (x,), policy="autocast", dtype=BF16)
    got = program.module()(x)
    assert got.dtype == want.dtype and torch.equal(got, want)
