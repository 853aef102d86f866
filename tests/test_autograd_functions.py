"""Custom torch.autograd.Functions keep their own backward through every entry point.

torch.autocast is the oracle: the same model run eagerly under torch.autocast gives the
outputs and gradients each captured one must give, bit for bit under policy="autocast"
(and O1, whose CPU lists are autocast's) on the CPU, where these ops are deterministic.
The Functions are written the way real code writes them: a straight-through estimator,
saved inputs and outputs, non-tensor arguments, needs_input_grad, several outputs with
mark_non_differentiable, once_differentiable, the setup_context style, a torch.library
custom op in forward and backward (flash-attn's shape), custom_fwd/custom_bwd, double
backward.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from amp_graph.passes.meta import AMP, KEPT_FUNCTION
from graph_helpers import TrainGraph
from torch.autograd.function import once_differentiable

import amp_graph
from amp_graph.capture import CaptureError
from amp_graph.capture.autograd_functions import function_calls

BF16 = torch.bfloat16


# --- Functions as real code writes them ----------------------------------------------------


class StraightThroughRound(torch.autograd.Function):
    """Quantization-aware training's estimator: round forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class SavedMatmul(torch.autograd.Function):
    """Saves its inputs and its output; a matmul inside the forward, which autocast casts."""

    @staticmethod
    def forward(ctx, a, w):
        out = a @ w.t()
        y = torch.tanh(out)
        ctx.save_for_backward(a, w, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        a, w, y = ctx.saved_tensors
        g = grad * (1 - y * y)
        # backward runs outside autocast: the Function casts to its inputs' dtypes itself
        grad_a = (g @ w.to(g.dtype)).to(a.dtype) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            grad_w = (g.flatten(0, -2).t() @ a.to(g.dtype).flatten(0, -2)).to(w.dtype)
        else:
            grad_w = None
        return grad_a, grad_w


class ScaledShift(torch.autograd.Function):
    """Non-tensor arguments (a float, a string, an int), stored on ctx."""

    @staticmethod
    def forward(ctx, x, scale, mode, power):
        ctx.scale, ctx.power = scale, power
        y = x * scale if mode == "mul" else x + scale
        return y**power

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale * ctx.power, None, None, None


class MaxWithIndex(torch.autograd.Function):
    """Two outputs, the second non-differentiable (a custom topk/argmax)."""

    @staticmethod
    def forward(ctx, x):
        values, index = x.max(dim=-1)
        ctx.mark_non_differentiable(index)
        ctx.save_for_backward(index)
        ctx.shape = x.shape
        return values, index

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_values, grad_index):
        (index,) = ctx.saved_tensors
        grad = grad_values.new_zeros(ctx.shape)
        return grad.scatter(-1, index.unsqueeze(-1), grad_values.unsqueeze(-1) * 2.0)


class SetupContextGelu(torch.autograd.Function):
    """The setup_context style (torch.func's): forward takes no ctx."""

    @staticmethod
    def forward(x, approximate):
        return F.gelu(x, approximate=approximate)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, approximate = inputs
        ctx.save_for_backward(x)
        ctx.approximate = approximate

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            y = F.gelu(x, approximate=ctx.approximate)
        return torch.autograd.grad(y, x, grad)[0] * 0.5, None


class Cube(torch.autograd.Function):
    """A backward that is itself differentiable: double backward goes through it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 3 * x * x


class CastInputsMatmul(torch.autograd.Function):
    """custom_fwd(cast_inputs=float32): the forward in float32, autocast off inside."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, a, w):
        ctx.save_for_backward(a, w)
        return a @ w.t()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        a, w = ctx.saved_tensors
        return grad @ w, grad.flatten(0, -2).t() @ a.flatten(0, -2)


class AutocastBackwardMatmul(torch.autograd.Function):
    """custom_fwd without cast_inputs: custom_bwd runs the backward under autocast too."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, a, w):
        ctx.save_for_backward(a, w)
        return a @ w.t()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        a, w = ctx.saved_tensors
        return grad @ w, grad.flatten(0, -2).t() @ a.flatten(0, -2)


# flash-attn's shape: the Function calls a torch.library custom op (the kernel) in forward
# and another in backward; the ops have fake implementations
@torch.library.custom_op("amp_graph_test::scaled_attention_fwd", mutates_args=())
def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return scores.softmax(-1) @ v


@_attention_fwd.register_fake
def _(q, k, v):
    return torch.empty_like(q)


@torch.library.custom_op("amp_graph_test::scaled_attention_bwd", mutates_args=())
def _attention_bwd(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scale = q.shape[-1] ** -0.5
    probs = ((q @ k.transpose(-1, -2)) * scale).softmax(-1)
    grad_probs = grad @ v.transpose(-1, -2)
    grad_scores = probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True)) * scale
    return grad_scores @ k, grad_scores.transpose(-1, -2) @ q, probs.transpose(-1, -2) @ grad


@_attention_bwd.register_fake
def _(grad, q, k, v):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class FlashLikeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return _attention_fwd(q, k, v)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        return _attention_bwd(grad.contiguous(), q, k, v)


# --- models that call them -------------------------------------------------------------------


class Block(nn.Module):
    """Each Function between ordinary layers, as models call them."""

    def __init__(self, dim=8):
        super().__init__()
        self.fc_in = nn.Linear(dim, dim)
        self.w = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.frozen = nn.Parameter(torch.randn(dim, dim) / dim**0.5, requires_grad=False)
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.fc_out = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.fc_in(x)
        h = StraightThroughRound.apply(h * 4) / 4 + h
        h = SavedMatmul.apply(h, self.w) + SavedMatmul.apply(h, self.frozen)
        h = ScaledShift.apply(h, 0.5, "mul", 2) + h
        values, index = MaxWithIndex.apply(h)
        h = h + values.unsqueeze(-1) + index.unsqueeze(-1).to(h.dtype) * 0.01
        h = SetupContextGelu.apply(self.norm(h), "tanh")
        q, k, v = self.qkv(h).unflatten(-1, (3, 1, -1)).unbind(-3)
        h = FlashLikeAttention.apply(q, k, v).flatten(-2) + h
        h = CastInputsMatmul.apply(h, self.fc_out.weight) + AutocastBackwardMatmul.apply(
            h, self.fc_out.weight
        )
        return self.fc_out(h)


class LinearThen(nn.Module):
    """A linear layer, then one Function: the smallest model whose gradient goes through it."""

    def __init__(self, function, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.function = function

    def forward(self, x):
        return self.function.apply(self.fc(x))


def _inputs():
    torch.manual_seed(0)
    return torch.randn(2, 5, 8)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _eager_autocast(model, x, dtype=BF16):
    with torch.autocast("cpu", dtype=dtype):
        out = model(x)
    out.float().square().sum().backward()
    return out, _grads(model)


def _assert_same(out, grads, want_out, want_grads):
    assert out.dtype == want_out.dtype
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    assert grads.keys() == want_grads.keys()
    for name in grads:
        assert grads[name].dtype == want_grads[name].dtype, name
        torch.testing.assert_close(grads[name], want_grads[name], rtol=0, atol=0, msg=name)


def _models():
    torch.manual_seed(0)
    model = Block()
    return model, copy.deepcopy(model)


# --- the oracle, entry point by entry point ----------------------------------------------------


def test_compile_keeps_every_function_backward_bit_for_bit_with_autocast():
    policy = "autocast"
    model, reference = _models()
    x = _inputs()
    want_out, want_grads = _eager_autocast(reference, x)
    compiled = amp_graph.compile(model, policy, BF16)
    out = compiled(x)
    out.float().square().sum().backward()
    _assert_same(out, _grads(model), want_out, want_grads)
    # one node per Function call: 9 calls in Block.forward, no forward op of theirs inlined
    calls = function_calls(compiled.graph_module)
    assert len(calls) == 9
    names = {n.target.function.__name__ for n in calls}
    assert "StraightThroughRound" in names and "FlashLikeAttention" in names
    ops = {str(n.target) for n in compiled.graph_module.graph.nodes}
    assert not any("round" in op or "scaled_attention" in op for op in ops)


def test_a_straight_through_estimator_gets_its_own_gradient_not_rounds():
    """The issue's repro: round's derivative is 0, the Function's backward is the identity."""

    torch.manual_seed(0)
    for policy in ("O0", "O1"):
        model = LinearThen(StraightThroughRound, 4)
        x = torch.randn(2, 4)
        amp_graph.compile(model, policy, BF16)(x).float().sum().backward()
        got = model.fc.weight.grad.clone()
        model.zero_grad()
        ctx = torch.autocast("cpu", BF16, enabled=policy != "O0")
        with ctx:
            model(x).float().sum().backward()
        assert got.abs().max() > 0.5
        torch.testing.assert_close(got, model.fc.weight.grad, rtol=0, atol=0)


def test_compile_in_place_keeps_function_backward():
    model, reference = _models()
    x = _inputs()
    want_out, want_grads = _eager_autocast(reference, x)
    amp_graph.compile_(model, "autocast", BF16)
    out = model(x)
    out.float().square().sum().backward()
    _assert_same(out, _grads(model), want_out, want_grads)


def test_graph_training_step_keeps_function_backward():
    """A Graph's step applies the Function's own gradients: the parameters after two SGD
    steps equal those of the eager torch.autocast loop bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Flatten(), nn.Linear(40, 3))
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    graph = TrainGraph(model, opt, policy="autocast", dtype=BF16)
    x, y = _inputs(), torch.tensor([0, 2])
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(2):
        loss = graph(x, y)
        ref_opt.zero_grad()
        with torch.autocast("cpu", BF16):
            ref_loss = loss_fn(reference(x).float(), y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in model[0].fc_in.parameters())


def test_custom_fwd_cast_inputs_computes_in_float32_and_custom_bwd_under_autocast():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            h = self.fc(x)  # bf16 under autocast
            return CastInputsMatmul.apply(h, self.w), AutocastBackwardMatmul.apply(h, self.w)

    torch.manual_seed(0)
    model = M()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    kept, low = amp_graph.compile(model, "autocast", BF16)(x)
    assert kept.dtype == torch.float32 and low.dtype == BF16  # as under torch.autocast
    (kept.sum() + low.float().sum()).backward()
    with torch.autocast("cpu", BF16):
        want_kept, want_low = reference(x)
    (want_kept.sum() + want_low.float().sum()).backward()
    torch.testing.assert_close(kept, want_kept, rtol=0, atol=0)
    torch.testing.assert_close(low, want_low, rtol=0, atol=0)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_double_backward_goes_through_the_function():
    torch.manual_seed(0)
    model = LinearThen(Cube, 3)
    x = torch.randn(2, 3, requires_grad=True)

    def second_order(run):
        y = run(x).float().sum()
        (gx,) = torch.autograd.grad(y, x, create_graph=True)
        (ggx,) = torch.autograd.grad(gx.square().sum(), x)
        return gx.detach(), ggx

    compiled = amp_graph.compile(model, "autocast", BF16)
    got = second_order(compiled)
    with torch.autocast("cpu", BF16):
        want = second_order(model)
    for g, w in zip(got, want, strict=True):
        assert g.abs().max() > 0
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_a_function_node_is_not_cast_and_explain_names_it():
    model, _ = _models()
    compiled = amp_graph.compile(model, "O1", BF16)
    compiled(_inputs())
    node = function_calls(compiled.graph_module)[0]
    amp = node.meta[AMP]
    assert amp.compute_dtype is None  # inputs as they come, as torch.autocast passes them
    assert "autograd.Function" in amp.detail and "backward" in amp.detail
    assert "StraightThroughRound" in amp_graph.explain(compiled, node.name)


def test_o1_keeps_function_backward_within_bf16_rounding_of_autocast():
    """O1 is Apex's lists (CUDA autocast's), not CPU autocast's: the ops between the
    Functions may round otherwise, so O1 is held within bf16's rounding of autocast."""
    model, reference = _models()
    x = _inputs()
    want_out, want_grads = _eager_autocast(reference, x)
    out = amp_graph.compile(model, "O1", BF16)(x)
    out.float().square().sum().backward()
    got = _grads(model)
    assert out.dtype == want_out.dtype
    torch.testing.assert_close(out, want_out, rtol=0.05, atol=0.05)
    for name, grad in got.items():
        scale = want_grads[name].abs().max()
        torch.testing.assert_close(grad, want_grads[name], rtol=0.05, atol=0.05 * scale, msg=name)


def test_o2_keeps_function_backward():
    """O2 (half model, inputs cast at entry): the Function runs under autocast in the low
    dtype on what the plan gives it, and its backward reaches the parameters below it."""
    model, _ = _models()
    x = _inputs()
    out = amp_graph.compile(model, "O2", BF16, output_dtype=None)(x)  # as computed
    out.float().square().sum().backward()
    assert out.dtype == BF16
    grads = _grads(model)
    assert grads["fc_in.weight"].abs().max() > 0 and torch.isfinite(grads["fc_in.weight"]).all()


# --- what cannot be kept is refused, never inlined ------------------------------------------


class HostOnly(torch.autograd.Function):
    """Its forward reads data on the host: it cannot run on fake tensors."""

    @staticmethod
    def forward(ctx, x):
        return x * float(x.detach().numpy().sum())

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_a_function_that_cannot_run_on_fake_tensors_is_refused_by_name():
    class M(nn.Module):
        def forward(self, x):
            return HostOnly.apply(x)

    with pytest.raises(CaptureError) as raised:
        amp_graph.compile(M(), "O1", BF16)(torch.randn(2, 2))
    text = str(raised.value)
    assert "HostOnly" in text and "custom_op" in text and "register_fake" in text


def test_a_function_class_defined_inside_forward_is_refused():
    class M(nn.Module):
        def forward(self, x):
            class Local(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x):
                    return x.round()

                @staticmethod
                def backward(ctx, grad):
                    return grad

            return Local.apply(x)

    with pytest.raises(CaptureError, match=r"Local.*module level"):
        amp_graph.compile(M(), "O1", BF16)(torch.randn(2, 2))


def test_apply_is_restored_after_capture_even_when_it_fails():
    class M(nn.Module):
        def forward(self, x):
            return HostOnly.apply(x)

    before = {c: c.__dict__.get("apply") for c in (HostOnly, StraightThroughRound)}
    with pytest.raises(CaptureError):
        amp_graph.compile(M(), "O1", BF16)(torch.randn(2, 2))
    assert {c: c.__dict__.get("apply") for c in before} == before
    x = torch.randn(3, requires_grad=True)
    StraightThroughRound.apply(x).sum().backward()  # eager: the original apply
    torch.testing.assert_close(x.grad, torch.ones(3))


def test_export_inlines_the_forward_of_an_inference_program():
    """amp_graph.export is an inference program (eval, no_grad): no backward to keep, so
    the Function's forward ops are the program's, each under the policy; custom_fwd's
    float32 block holds."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            h = StraightThroughRound.apply(self.fc(x))
            return CastInputsMatmul.apply(h, self.w)

    torch.manual_seed(0)
    model = M()
    x = torch.randn(4, 8)
    program = amp_graph.export(model, (x,), policy="autocast", dtype=BF16)
    with torch.no_grad():
        got = program.module()(x)
        with torch.autocast("cpu", BF16):
            want = model(x)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# --- the torch.compile backend ----------------------------------------------------------------


class BackendBlock(nn.Module):
    """Block's Functions less those the backend refuses (custom_fwd/custom_bwd, and
    SavedMatmul's casts to dtypes read from tensors) and SetupContextGelu, whose backward
    calls torch.autograd.grad: dynamo cannot trace it (torch 2.13 breaks the graph there,
    2.15 runs the whole frame eagerly, README's known limits)."""

    def __init__(self, dim=8):
        super().__init__()
        self.inner = Block(dim)

    def forward(self, x):
        b = self.inner
        h = b.fc_in(x)
        h = StraightThroughRound.apply(h * 4) / 4 + h
        h = ScaledShift.apply(h, 0.5, "mul", 2) + h
        values, _ = MaxWithIndex.apply(h)
        h = b.norm(h + values.unsqueeze(-1))
        q, k, v = b.qkv(h).unflatten(-1, (3, 1, -1)).unbind(-3)
        h = FlashLikeAttention.apply(q, k, v).flatten(-2) + h
        return StraightThroughRound.apply(b.fc_out(h))  # the last op: backward must reach it


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_backend_keeps_function_backward_bit_for_bit_with_autocast(inner):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = BackendBlock()
    reference = copy.deepcopy(model)
    x = _inputs()
    want_out, want_grads = _eager_autocast(reference, x)
    compiled = torch.compile(model, backend=amp_graph.backend("autocast", BF16, inner=inner))
    out = compiled(x)
    out.float().square().sum().backward()
    _assert_same(out, _grads(model), want_out, want_grads)
    graphs = amp_graph.captured_graphs(compiled)
    kept = [n for gm in graphs for n in gm.graph.nodes if n.meta.get(KEPT_FUNCTION)]
    assert len(graphs) == 1 and len(kept) == 5  # one node per Function call
    assert any("StraightThroughRound" in n.meta[KEPT_FUNCTION][0] for n in kept)


@pytest.mark.parametrize(
    ("function", "reason"),
    [
        (CastInputsMatmul, "custom_fwd"),
        (AutocastBackwardMatmul, "custom_fwd"),
        (SavedMatmul, "dtype it may read from a tensor"),
    ],
)
def test_backend_refuses_what_dynamo_traced_in_float32_naming_the_function(function, reason):
    """Dynamo traced these Functions in float32: their bodies lack autocast's casts or bake
    float32 where the model reads a dtype. The backend says so, where it would compute
    other dtypes than torch.autocast."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return function.apply(x, self.w)

    torch._dynamo.reset()
    compiled = torch.compile(M(), backend=amp_graph.backend("O1", BF16, inner="eager"))
    with pytest.raises(Exception) as raised:
        compiled(torch.randn(2, 4))
    text = str(raised.value)
    assert function.__name__ in text and reason in text and "amp_graph.compile" in text


# --- a memory-saving fused loss, as Liger-Kernel writes it ----------------------------------


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Liger's fused linear cross-entropy: the forward computes the loss and both gradients
    chunk by chunk (the logits never exist whole), the backward only scales them."""

    @staticmethod
    def forward(ctx, x, weight, target, chunk):
        n = x.shape[0]
        grad_x, grad_w = torch.zeros_like(x), torch.zeros_like(weight)
        loss = x.new_zeros((), dtype=torch.float32)
        for start in range(0, n, chunk):
            xc, tc = x[start : start + chunk], target[start : start + chunk]
            logits = (xc @ weight.t()).float()
            lse = logits.logsumexp(-1)
            loss = loss + (lse - logits.gather(-1, tc[:, None]).squeeze(-1)).sum()
            probs = (logits - lse[:, None]).exp()
            probs[torch.arange(tc.shape[0]), tc] -= 1
            probs = probs / n
            grad_x[start : start + chunk] = probs @ weight
            grad_w += probs.t() @ xc
        ctx.save_for_backward(grad_x, grad_w)
        return loss / n

    @staticmethod
    def backward(ctx, grad):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad, grad_w * grad, None, None


class TinyLM(nn.Module):
    def __init__(self, vocab=11, dim=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, target):
        h = self.block(self.embed(ids)).flatten(0, 1)
        return ChunkedLinearCrossEntropy.apply(h, self.lm_head.weight, target.flatten(), 4)


class LossGraph(amp_graph.Graph):
    def __init__(self, model, optimizer):
        super().__init__()
        self.model = model
        self.add_optimizer(optimizer)
        self.config.enable_amp(True, policy="autocast", dtype=BF16)

    def build(self, ids, target):
        loss = self.model(ids, target)
        loss.backward()
        return loss


def test_a_fused_chunked_loss_trains_through_compile_and_graph_as_under_autocast():
    torch.manual_seed(0)
    ids, target = torch.randint(0, 11, (2, 6)), torch.randint(0, 11, (2, 6))
    reference = TinyLM()
    compiled_model, graph_model = copy.deepcopy(reference), copy.deepcopy(reference)
    with torch.autocast("cpu", BF16):
        want = reference(ids, target)
    want.backward()
    want_grads = _grads(reference)
    assert want_grads["embed.weight"].abs().max() > 0

    got = amp_graph.compile(compiled_model, "autocast", BF16)(ids, target)
    got.backward()
    _assert_same(got, _grads(compiled_model), want, want_grads)

    # a Graph step: SGD on the Function's own gradients, as the eager loop takes it
    graph = LossGraph(graph_model, torch.optim.SGD(graph_model.parameters(), lr=0.5))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    ref_opt.step()  # the gradients of the first step, above
    torch.testing.assert_close(graph(ids, target), want, rtol=0, atol=0)
    for (name, p), q in zip(graph_model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_backend_with_inductor_keeps_function_backward_within_bf16_rounding():
    """Inductor fuses the ops around the Functions (its own rounding): within bf16's
    rounding of torch.autocast, every gradient there, none of them zero."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = BackendBlock()
    reference = copy.deepcopy(model)
    x = _inputs()
    want_out, want_grads = _eager_autocast(reference, x)
    compiled = torch.compile(model, backend=amp_graph.backend("autocast", BF16, inner="inductor"))
    out = compiled(x)
    out.float().square().sum().backward()
    got = _grads(model)
    assert out.dtype == want_out.dtype and got.keys() == want_grads.keys()
    for name, grad in got.items():
        scale = want_grads[name].abs().max()
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grad, want_grads[name], rtol=0.05, atol=0.05 * scale, msg=name)


def test_numerics_shadow_runs_a_function_in_float32():
    """amp_graph.numerics compares each node with the model run in float32: a Function's
    shadow runs with autocast off, so its row shows the error its bf16 matmul makes."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 16))

        def forward(self, x):  # x as given (float32): any error is the Function's own
            return SavedMatmul.apply(x, self.w)

    torch.manual_seed(0)
    compiled = amp_graph.compile(M(), "autocast", BF16)
    x = torch.randn(8, 16)
    compiled(x)
    report = amp_graph.numerics(compiled, x)
    (row,) = [r for r in report.rows if r.node == "saved_matmul"]
    assert row.dtype == BF16  # tanh of a bf16 product, as CPU autocast runs it
    assert 1e-4 < row.forward.rel_error < 0.05  # bf16's rounding against a float32 shadow
