"""The fp8 ops against a float32 quantize/dequantize reference, torchao, opcheck and torch.compile.

The reference dequantizes each float8 operand with the op's own scales the way
``torch._scaled_mm`` defines it (``q.float() * scale.reciprocal()``), multiplies in float32
and rounds once to the output dtype. On the CPU ``torch._scaled_mm`` is exactly that (an
float32 emulation), so CPU results must match bit for bit; on a GPU the float8 tensor cores
accumulate differently (and the forward with fast accumulation), so CUDA cases compare with a
norm-wise tolerance of 2^-7.
"""

from __future__ import annotations

import pytest
import torch
from fp8_helpers import ScaledMatmulProbe

from amp_graph.ops import fp8_ops
from amp_graph.ops.fp8_ops import fp8_quantize, fp8_scale
from amp_graph.policy import E4M3, E5M2, check_fp8_low_dtype, get_recipe

RECIPES = ["tensorwise", "rowwise"]
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available() or fp8_ops.fp8_matmul_error("cuda") is not None,
            reason="needs a CUDA GPU with float8 matmuls (sm_89+)",
        ),
    ),
]


def _assert_matches(actual: torch.Tensor, expected: torch.Tensor, device: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if device == "cpu":
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    else:
        error = (actual.double() - expected.double()).norm() / expected.double().norm()
        assert error <= 2**-7, error


def _dequantized(x: torch.Tensor, dtype: torch.dtype, recipe: str, dim: int = -1) -> torch.Tensor:
    """x through float8 and back, in float32, with the scale fp8_scale gives it."""
    scale = fp8_scale(x, dtype, recipe, dim)
    return fp8_quantize(x, scale, dtype).float() * scale.reciprocal()


def _reference(x, w, b, g, recipe):
    """(out, grad_x, grad_w, grad_b) of the fp8 linear, computed in float32."""
    k, n = w.shape[1], w.shape[0]
    x2, g2 = x.reshape(-1, k), g.reshape(-1, n)
    mm = _dequantized(x, E4M3, recipe) @ _dequantized(w, E4M3, recipe).t()
    if recipe == "tensorwise":  # bias added by _scaled_mm in float32, from bfloat16
        out = (mm + b.bfloat16().float()).bfloat16()
        g_q = _dequantized(g2, E5M2, recipe)
        grad_x = (g_q @ _dequantized(w, E4M3, recipe)).to(x.dtype)
        grad_w = g_q.t() @ _dequantized(x2, E4M3, recipe)
    else:  # rowwise: bf16 out, then the bias; gradients scaled along the contraction dim
        out = mm.bfloat16() + b.bfloat16()
        g_rows = _dequantized(g2, E4M3, recipe, dim=-1)
        grad_x = (g_rows @ _dequantized(w, E4M3, recipe, dim=0)).bfloat16().to(x.dtype)
        g_cols = _dequantized(g2, E4M3, recipe, dim=0)
        grad_w = (g_cols.t() @ _dequantized(x2, E4M3, recipe, dim=0)).bfloat16().float()
    return out, grad_x.reshape(x.shape), grad_w, g2.float().sum(0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(48, 64), (3, 7, 64)], ids=["2d", "3d_rows_not_multiple_of_16"])
def test_forward_and_backward_match_float32_reference(device, recipe, x_dtype, shape):
    x = torch.randn(shape, device=device).to(x_dtype).requires_grad_()
    w = torch.randn(32, 64, device=device, requires_grad=True)
    b = torch.randn(32, device=device, requires_grad=True)
    out = fp8_ops.linear(x, w, b, recipe)
    g = torch.randn_like(out)
    out.backward(g)
    ref_out, ref_gx, ref_gw, ref_gb = _reference(x.detach(), w.detach(), b.detach(), g, recipe)
    _assert_matches(out, ref_out, device)
    _assert_matches(x.grad, ref_gx, device)
    _assert_matches(w.grad, ref_gw, device)  # parameter gradients arrive in float32
    _assert_matches(b.grad, ref_gb, device)


def test_scales_follow_torchaos_formula():
    x = torch.randn(8, 64) * 3
    amax = x.abs().max().double()
    assert fp8_scale(x, E4M3, "tensorwise") == (448.0 / amax).float()
    assert fp8_scale(x, E5M2, "tensorwise") == (57344.0 / amax).float()
    rows = fp8_scale(x, E4M3, "rowwise")  # per row, rounded down to a power of two
    exact = 448.0 / x.abs().amax(dim=-1, keepdim=True).double()
    assert rows.shape == (8, 1)
    assert torch.equal(rows, torch.exp2(torch.floor(torch.log2(exact.float()))))
    assert (rows <= exact).all() and (rows > exact / 2).all()
    columns = fp8_scale(x, E4M3, "rowwise", dim=0)
    assert columns.shape == (1, 64)
    assert fp8_scale(torch.zeros(4, 16), E4M3, "tensorwise").isfinite()  # amax floor


def test_quantize_saturates_and_keeps_representable_values():
    grid = torch.arange(-448.0, 449.0, 32.0)  # all exactly representable in e4m3
    assert torch.equal(fp8_quantize(grid, torch.tensor(1.0), E4M3).float(), grid)
    x = torch.tensor([1.0, -3.0, 0.5])
    scale = fp8_scale(x, E4M3, "tensorwise")
    q = fp8_quantize(x, scale, E4M3)
    assert q.dtype == E4M3 and q.float()[1] == -448.0  # amax maps to the format's max
    big = fp8_quantize(torch.tensor([1e9, -1e9]), torch.tensor(1.0), E5M2)
    assert big.float().tolist() == [57344.0, -57344.0]  # saturated, not inf


def test_nonfinite_input_gives_nonfinite_output():
    x = torch.randn(16, 32)
    x[3, 5] = float("inf")
    out = fp8_ops.linear(x, torch.randn(16, 32))
    assert not out.isfinite().all()  # never silently finite


def test_matches_torchao_float8_training():
    """torchao's Float8Linear runs on the CPU through the same torch._scaled_mm: the forward
    and the input gradient agree bit for bit; torchao returns the weight gradient rounded to
    its input's bfloat16 (autograd then widens it), amp_graph computes it in float32, so ours
    rounded to bfloat16 must equal torchao's. (No bias: torchao adds it after rounding.)"""
    import copy

    import torchao.float8 as torchao_float8  # in the dev extra

    for recipe in RECIPES:
        layer = torch.nn.Linear(64, 32, bias=False)
        theirs = torchao_float8.convert_to_float8_training(
            torch.nn.Sequential(copy.deepcopy(layer)),
            config=torchao_float8.Float8LinearConfig.from_recipe_name(recipe),
        )
        x = torch.randn(40, 64, dtype=torch.bfloat16)
        x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        ours = fp8_ops.linear(x_ours, layer.weight, None, recipe)
        reference = theirs(x_theirs)
        g = torch.randn_like(ours)
        ours.backward(g)
        reference.backward(g)
        assert torch.equal(ours, reference), recipe
        assert torch.equal(x_ours.grad, x_theirs.grad), recipe
        assert layer.weight.grad.dtype == torch.float32
        assert torch.equal(layer.weight.grad.bfloat16().float(), theirs[0].weight.grad), recipe


@pytest.mark.usefixtures("torch_scaled_mm")
@pytest.mark.parametrize("recipe", RECIPES)
def test_dispatch_probe_one_scaled_mm_forward_two_backward(recipe):
    grad_format = get_recipe(recipe).grad_dtype
    x = torch.randn(4, 16, 64, requires_grad=True)
    layers = [torch.randn(64, 64, requires_grad=True) for _ in range(3)]
    probe = ScaledMatmulProbe()
    with probe:
        h = x
        for w in layers:
            h = fp8_ops.linear(h, w, None, recipe)
        forward = list(probe.calls)
        h.float().sum().backward()
    backward = probe.calls[len(forward) :]
    assert forward == [(E4M3, E4M3)] * 3
    assert len(backward) == 6
    assert all(a == grad_format and b == E4M3 for a, b in backward)


@pytest.mark.usefixtures("torch_scaled_mm")
def test_backward_skips_the_input_gradient_nobody_needs():
    probe = ScaledMatmulProbe()
    w = torch.randn(32, 64, requires_grad=True)
    with probe:
        fp8_ops.linear(torch.randn(16, 64), w).float().sum().backward()
    assert len(probe.calls) == 2  # forward + grad_weight only


def test_tensorwise_saves_float8_operands_for_backward():
    """Tensorwise keeps x and W as float8 for the backward: a quarter of float32, half of
    the bfloat16 copies torch.autocast saves for a bf16 linear."""

    def saved_bytes(fn) -> tuple[int, set[torch.dtype]]:
        sizes, dtypes = [], set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            sizes.append(t.numel() * t.element_size())
            dtypes.add(t.dtype)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(sizes), dtypes

    x = torch.randn(256, 512, requires_grad=True)
    w = torch.randn(512, 512, requires_grad=True)
    fp8_bytes, fp8_dtypes = saved_bytes(lambda: fp8_ops.linear(x, w))

    def autocast_linear():
        with torch.autocast("cpu", torch.bfloat16):
            torch.nn.functional.linear(x, w)

    bf16_bytes, _ = saved_bytes(autocast_linear)
    assert fp8_dtypes == {E4M3, torch.float32}  # operands and their two scalar scales
    assert fp8_bytes == (256 * 512 + 512 * 512) + 2 * 4
    assert bf16_bytes == 2 * (256 * 512 + 512 * 512)


def test_opcheck():
    """opcheck's test_schema compares inputs with allclose, which has no float8 kernel on the
    CPU, so fp8_linear (float8 inputs) runs the other three checks; the quantize ops take
    float inputs and run all four."""
    x = torch.randn(3, 5, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    for recipe in RECIPES:
        x_scale, w_scale = fp8_scale(x, E4M3, recipe), fp8_scale(w, E4M3, recipe)
        args = (x, w, fp8_quantize(x, x_scale, E4M3), x_scale)
        args += (fp8_quantize(w, w_scale, E4M3), w_scale, b, recipe)
        checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        torch.library.opcheck(torch.ops.amp_graph.fp8_linear.default, args, test_utils=checks)
        torch.library.opcheck(torch.ops.amp_graph.fp8_scale.default, (x, E5M2, recipe))
        torch.library.opcheck(torch.ops.amp_graph.fp8_quantize.default, (x, x_scale, E4M3))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_matches_eager(backend, fresh_dynamo):
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    w = torch.randn(48, 64, requires_grad=True)
    b = torch.randn(48, requires_grad=True)

    def step(x, w, b):
        return torch.nn.functional.gelu(fp8_ops.linear(x, w, b)).float().square().mean()

    eager = step(x, w, b)
    eager.backward()
    expected = (w.grad.clone(), b.grad.clone())
    w.grad = b.grad = None
    compiled = torch.compile(step, backend=backend, fullgraph=True)(x, w, b)
    compiled.backward()
    # inductor may fuse the bf16 epilogue differently; the fp8 math itself is the same
    tol = dict(rtol=0, atol=0) if backend == "aot_eager" else dict(rtol=2e-2, atol=1e-5)
    torch.testing.assert_close(compiled, eager, **tol)
    torch.testing.assert_close(w.grad, expected[0], **tol)
    torch.testing.assert_close(b.grad, expected[1], **tol)


def test_bad_inputs_are_named():
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    with pytest.raises(ValueError, match="unknown fp8 recipe 'rowise'"):
        fp8_ops.linear(x, w, recipe="rowise")
    with pytest.raises(ValueError, match=r"float8_e4m3fn or torch\.float8_e5m2"):
        fp8_scale(x, torch.bfloat16)
    s = fp8_scale(w, E4M3)
    with pytest.raises(ValueError, match="x's last dim 16"):
        fp8_ops.linear(torch.randn(4, 16), w)
    with pytest.raises(ValueError, match="w_fp8 must be float8_e4m3fn"):
        torch.ops.amp_graph.fp8_linear(x, w, x.to(E4M3), s, w.to(E5M2), s, None, "tensorwise")
    with pytest.raises(ValueError, match=r"x_scale for the rowwise recipe .* shape \(4, 1\)"):
        torch.ops.amp_graph.fp8_linear(x, w, x.to(E4M3), s, w.to(E4M3), s, None, "rowwise")
    with pytest.raises(ValueError, match="bias must have shape"):
        fp8_ops.linear(x, w, torch.randn(8))


def test_low_dtype_must_be_bfloat16():
    assert check_fp8_low_dtype(torch.bfloat16) is torch.bfloat16
    with pytest.raises(ValueError, match=r"bfloat16, not float16.*dtype=torch\.bfloat16"):
        check_fp8_low_dtype(torch.float16)
    with pytest.raises(ValueError, match=r"got dtype=torch\.float32"):
        check_fp8_low_dtype(torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA: 'cuda' may run fp8")
def test_device_without_float8_matmul_is_a_clear_error():
    assert fp8_ops.fp8_matmul_error("cpu") is None
    with pytest.raises(fp8_ops.Fp8UnsupportedError, match="no float8 matmul on device 'cuda'"):
        fp8_ops.require_fp8_matmul("cuda")


@pytest.mark.usefixtures("torch_scaled_mm")
def test_scaled_mm_failure_on_an_unsupported_device_names_the_device(monkeypatch):
    """What a GPU without float8 matmuls (sm_80) does: torch._scaled_mm raises. The op asks
    the probe, which fails the same way, and raises the specific error."""
    from amp_graph.ops import fp8_ops as ops

    def no_fp8(*args, **kwargs):
        raise RuntimeError("torch._scaled_mm is only supported on CUDA devices with ...")

    monkeypatch.setattr(torch, "_scaled_mm", no_fp8)
    ops._probe.cache_clear()
    try:
        with pytest.raises(fp8_ops.Fp8UnsupportedError, match="policy='O1'"):
            fp8_ops.linear(torch.randn(4, 32), torch.randn(16, 32))
    finally:
        ops._probe.cache_clear()


def test_an_enclosing_autocast_changes_nothing():
    """The CPU's _scaled_mm emulates with an inner float32 matmul that torch.autocast would
    otherwise run in bf16 (a real bug this test caught)."""
    x = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    plain = fp8_ops.linear(x, w)
    plain.float().sum().backward()
    expected = (plain, x.grad, w.grad)
    x.grad = w.grad = None
    with torch.autocast("cpu", torch.bfloat16):
        inside = fp8_ops.linear(x, w)
        inside.float().sum().backward()
    for got, want in zip((inside, x.grad, w.grad), expected, strict=True):
        assert torch.equal(got, want)
