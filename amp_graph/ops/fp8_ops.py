"""The fp8 linear as ``amp_graph`` custom ops: one node each in FX and ``torch.compile`` graphs.

==========================================  ====================================================
op                                          result
==========================================  ====================================================
``fp8_scale(x, dtype, recipe, dim=-1)``     float32 quantization scale ``format max / amax(x)``:
                                            a 0-d tensor (tensorwise) or one per row along
                                            ``dim`` (rowwise); power-of-two rounded if the
                                            recipe says so
``fp8_quantize(x, scale, dtype)``           ``x * scale``, saturated to the format, in ``dtype``
``fp8_linear(x, weight, x_fp8, x_scale,     ``x @ weight.T + bias`` computed by
w_fp8, w_scale, bias, recipe)``             ``torch._scaled_mm`` from the float8 operands,
                                            returned in bfloat16
==========================================  ====================================================

An fp8 linear is five nodes: scale and quantize ``x``, scale and quantize the weight, then
``fp8_linear``. ``fp8_scale`` and ``fp8_quantize`` are ``CompositeImplicitAutograd``: they
run as the aten ops they are made of, which ``torch.compile`` fuses, and carry no gradient.
``fp8_linear`` is opaque, with a fake (meta) implementation and its own backward:

* its gradient goes to ``x``, ``weight`` and ``bias`` straight through the quantization,
  as torchao's: ``x`` and ``weight`` are arguments only for that (the kernel reads their
  float8 versions);
* the output gradient is scaled and cast to the recipe's gradient format (e5m2 for
  tensorwise) and both gradient matmuls, ``grad_x = g @ W`` and ``grad_W = g.T @ x``, run as
  ``torch._scaled_mm`` without fast accumulation; the weight gradient comes out in the
  weight's dtype (float32), the input gradient in the input's;
* tensorwise saves the float8 operands for the backward (1 byte per element); rowwise must
  rescale ``x`` and ``W`` along the other axis, so it saves them in their own precision.

``torch._scaled_mm``'s requirements are met here, the same way on every device (so the CPU
runs the GPU's code path): the first operand row-major, the second column-major, and the
contraction dim of ``grad_W`` (the batch) zero-padded to a multiple of 16. Layers whose own
dims are not multiples of 16 are not given to these ops (:mod:`amp_graph.policy.fp8_filters`).

Example::

    >>> import torch
    >>> from amp_graph.ops import fp8_ops
    >>> x = torch.randn(32, 64, requires_grad=True)
    >>> w = torch.randn(16, 64, requires_grad=True)
    >>> y = fp8_ops.linear(x, w)
    >>> y.dtype, y.shape
    (torch.bfloat16, torch.Size([32, 16]))
    >>> y.float().sum().backward()
    >>> x.grad.dtype, w.grad.dtype
    (torch.float32, torch.float32)
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from amp_graph.policy.fp8_recipe import (
    AMAX_FLOOR,
    E4M3,
    FP8_DTYPES,
    OUT_DTYPE,
    Granularity,
    get_recipe,
)

from .fp8_cpu_matmul import cpu_scaled_mm_is_slow, emulated_scaled_mm

_MULTIPLE = 16  # torch._scaled_mm's alignment for the contraction dim


class Fp8UnsupportedError(RuntimeError):
    """This torch has no float8 matmul on the device (or none for the recipe's scaling)."""


# FRAGMENT: amp_graph.ops.scaler_ops defines the scaler's ops in the same namespace.
_lib = torch.library.Library("amp_graph", "FRAGMENT")
SCHEMAS = {
    "fp8_scale": "(Tensor x, ScalarType dtype, str recipe, int dim=-1) -> Tensor",
    "fp8_quantize": "(Tensor x, Tensor scale, ScalarType dtype) -> Tensor",
    "fp8_linear": (
        "(Tensor x, Tensor weight, Tensor x_fp8, Tensor x_scale, Tensor w_fp8, "
        "Tensor w_scale, Tensor? bias, str recipe) -> Tensor"
    ),
}
for _name, _schema in SCHEMAS.items():
    _lib.define(_name + _schema)


def _check_format(dtype: torch.dtype, op: str) -> None:
    if dtype not in FP8_DTYPES:
        raise ValueError(
            f"amp_graph.{op}: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}"
        )


# ---- quantization: CompositeImplicitAutograd, no gradient ---------------------------------


def fp8_scale(
    x: torch.Tensor, dtype: torch.dtype, recipe: str = "tensorwise", dim: int = -1
) -> torch.Tensor:
    """``format max / amax`` in float32, as torchao's ``tensor_to_scale``: over the whole
    tensor (tensorwise) or along ``dim`` keeping it (rowwise). The division runs in float64
    (torchao's choice: eager and compiled code then agree on every scale)."""
    _check_format(dtype, "fp8_scale")
    spec = get_recipe(recipe)
    magnitude = x.detach().abs()
    if spec.granularity is Granularity.TENSORWISE:
        amax = magnitude.amax()
    else:
        amax = magnitude.amax(dim=dim, keepdim=True)
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=AMAX_FLOOR)).float()
    if spec.power_of_2_scales:  # round down: x * scale stays within the format
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` in float32, clamped to the format's range, cast to ``dtype``."""
    _check_format(dtype, "fp8_quantize")
    limit = torch.finfo(dtype).max
    return (x.detach().float() * scale).clamp(-limit, limit).to(dtype)


_lib.impl("fp8_scale", fp8_scale, "CompositeImplicitAutograd")
_lib.impl("fp8_quantize", fp8_quantize, "CompositeImplicitAutograd")


# ---- device support ------------------------------------------------------------------------


@functools.cache
def _probe(device: str, rowwise: bool) -> str | None:
    """Run a 16x16 scaled matmul on ``device``: None if it works, else why not."""
    if not hasattr(torch, "_scaled_mm"):
        return "this torch has no torch._scaled_mm"
    try:
        a = torch.ones(16, 16, device=device).to(E4M3)
        scale = torch.ones((16, 1) if rowwise else (), device=device)
        b_scale = scale.reshape(1, 16) if rowwise else scale
        torch._scaled_mm(a, a.t(), scale_a=scale, scale_b=b_scale, out_dtype=OUT_DTYPE)
    except Exception as error:  # any failure: no usable float8 matmul there
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
    return None


def fp8_matmul_error(device: torch.device | str, recipe: str = "tensorwise") -> str | None:
    """Why this torch cannot run ``recipe``'s float8 matmuls on ``device``; None if it can.
    Probed once per device and scaling by running a tiny ``torch._scaled_mm``."""
    rowwise = get_recipe(recipe).granularity is Granularity.ROWWISE
    return _probe(str(torch.device(device)), rowwise)


def require_fp8_matmul(device: torch.device | str, recipe: str = "tensorwise") -> None:
    """Raise :class:`Fp8UnsupportedError` unless ``device`` runs ``recipe``'s matmuls."""
    reason = fp8_matmul_error(device, recipe)
    if reason is None:
        return
    scaling = "rowwise-scaled " if recipe == "rowwise" else ""
    raise Fp8UnsupportedError(
        f"torch {torch.__version__} has no {scaling}float8 matmul on device "
        f"'{torch.device(device)}' (torch._scaled_mm failed: {reason}). fp8 linears need a "
        "CUDA GPU of compute capability 8.9 or newer (rowwise scaling: 9.0), or the CPU "
        "(an emulation in float32: no speed-up). On this device use policy='O1' with "
        "dtype=torch.bfloat16" + (", or the 'tensorwise' recipe" if recipe == "rowwise" else "")
    )


# ---- the scaled matmul ---------------------------------------------------------------------


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 else t.contiguous()


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(0) == 1 else t.t().contiguous().t()


def _without_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """The CPU's _scaled_mm emulates in float32 with an inner matmul that an enclosing
    ``torch.autocast`` would run in bf16: the op's numerics must not depend on the caller's
    autocast state."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """Zero rows up to a multiple of 16: a contraction over rows gains exact zeros only."""
    missing = -t.shape[0] % _MULTIPLE
    return t if missing == 0 else torch.cat([t, t.new_zeros(missing, t.shape[1])])


def _scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    fast_accum: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a @ b`` from float8 operands quantized as ``a_fp8 = a * a_scale``: the layouts
    ``torch._scaled_mm`` needs and the dequantization scales (reciprocals) it takes. On a
    CPU whose ``torch._scaled_mm`` is slow, the same arithmetic from float32
    (:mod:`amp_graph.ops.fp8_cpu_matmul`)."""
    if a.device.type == "cpu" and cpu_scaled_mm_is_slow():
        with _without_autocast(a.device):
            scales = (a_scale.reciprocal(), b_scale.reciprocal())
            return emulated_scaled_mm(a, b, *scales, bias, out_dtype)
    try:
        with _without_autocast(a.device):
            return torch._scaled_mm(
                _row_major(a),
                _col_major(b),
                scale_a=a_scale.reciprocal(),
                scale_b=b_scale.reciprocal(),
                bias=bias,
                out_dtype=out_dtype,
                use_fast_accum=fast_accum,
            )
    except (RuntimeError, NotImplementedError, ValueError):
        rowwise = a_scale.numel() > 1
        require_fp8_matmul(a.device, "rowwise" if rowwise else "tensorwise")
        raise  # the device has float8 matmuls: a genuine error in the arguments


def _check_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: str,
) -> None:
    def fail(what: str) -> None:
        raise ValueError(f"amp_graph.fp8_linear: {what}")

    rowwise = get_recipe(recipe).granularity is Granularity.ROWWISE
    if weight.dim() != 2 or x.dim() < 1:
        fail(f"weight must be 2-D and x at least 1-D; got {tuple(weight.shape)}, {tuple(x.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        fail(f"x's last dim {x.shape[-1]} does not match weight {tuple(weight.shape)}")
    for name, q, like in (("x_fp8", x_fp8, x), ("w_fp8", w_fp8, weight)):
        if q.dtype != E4M3 or q.shape != like.shape:
            fail(
                f"{name} must be float8_e4m3fn of shape {tuple(like.shape)}; got {q.dtype} "
                f"{tuple(q.shape)}"
            )
    want_x = (*x.shape[:-1], 1) if rowwise else ()
    want_w = (n, 1) if rowwise else ()
    for name, s, want in (("x_scale", x_scale, want_x), ("w_scale", w_scale, want_w)):
        if s.dtype != torch.float32 or tuple(s.shape) != tuple(want):
            fail(
                f"{name} for the {recipe} recipe must be float32 of shape {tuple(want)}; got "
                f"{s.dtype} {tuple(s.shape)}"
            )
    if bias is not None and tuple(bias.shape) != (n,):
        fail(f"bias must have shape ({n},); got {tuple(bias.shape)}")


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: str,
) -> torch.Tensor:
    _check_linear(x, weight, x_fp8, x_scale, w_fp8, w_scale, bias, recipe)
    n, k = w_fp8.shape
    rowwise = get_recipe(recipe).granularity is Granularity.ROWWISE
    a_scale = x_scale.reshape(-1, 1) if rowwise else x_scale
    b_scale = w_scale.reshape(1, -1) if rowwise else w_scale
    # _scaled_mm adds a bf16 bias in its epilogue for tensorwise scales; rowwise adds after.
    fused = bias is not None and not rowwise
    out = _scaled_mm(
        x_fp8.reshape(-1, k),
        w_fp8.t(),
        a_scale,
        b_scale,
        OUT_DTYPE,
        fast_accum=True,
        bias=bias.to(OUT_DTYPE) if fused else None,
    )
    if bias is not None and not fused:
        out = out + bias.to(OUT_DTYPE)
    return out.reshape(*x_fp8.shape[:-1], n)


_lib.impl("fp8_linear", _linear, "CompositeExplicitAutograd")


@torch.library.register_fake("amp_graph::fp8_linear", lib=_lib)
def _fake_linear(x, weight, x_fp8, x_scale, w_fp8, w_scale, bias, recipe):  # type: ignore[no-untyped-def]
    _check_linear(x, weight, x_fp8, x_scale, w_fp8, w_scale, bias, recipe)
    return x_fp8.new_empty((*x_fp8.shape[:-1], w_fp8.shape[0]), dtype=OUT_DTYPE)


# ---- backward --------------------------------------------------------------------------------


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, weight, x_fp8, x_scale, w_fp8, w_scale, bias, recipe = inputs
    ctx.recipe = recipe
    ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
    if get_recipe(recipe).granularity is Granularity.TENSORWISE:
        ctx.save_for_backward(x_fp8, x_scale, w_fp8, w_scale)  # 1 byte per element
    else:
        ctx.save_for_backward(x, weight)  # rowwise rescales along the other axis


def _tensorwise_grads(ctx: Any, g: torch.Tensor, need_x: bool, need_w: bool) -> tuple:
    x_fp8, x_scale, w_fp8, w_scale = ctx.saved_tensors
    x_dtype, w_dtype, _ = ctx.dtypes
    g_dtype = get_recipe(ctx.recipe).grad_dtype
    g_scale = fp8_scale(g, g_dtype, ctx.recipe)
    g_fp8 = fp8_quantize(g, g_scale, g_dtype)
    grad_x = grad_w = None
    if need_x:  # (M, N) @ (N, K)
        grad_x = _scaled_mm(g_fp8, w_fp8, g_scale, w_scale, x_dtype, fast_accum=False)
    if need_w:  # (N, M) @ (M, K), M padded to a multiple of 16
        x2 = x_fp8.reshape(-1, w_fp8.shape[1])
        grad_w = _scaled_mm(
            _pad_rows(g_fp8).t(), _pad_rows(x2), g_scale, x_scale, w_dtype, fast_accum=False
        )
    return grad_x, grad_w


def _rowwise_grads(ctx: Any, g: torch.Tensor, need_x: bool, need_w: bool) -> tuple:
    x, weight = ctx.saved_tensors
    x_dtype, w_dtype, _ = ctx.dtypes
    recipe, g_dtype = ctx.recipe, get_recipe(ctx.recipe).grad_dtype
    grad_x = grad_w = None
    if need_x:  # contraction over N: g scaled per row, W per column
        g_scale = fp8_scale(g, g_dtype, recipe, dim=-1)
        w_scale = fp8_scale(weight, E4M3, recipe, dim=0)
        grad_x = _scaled_mm(
            fp8_quantize(g, g_scale, g_dtype),
            fp8_quantize(weight, w_scale, E4M3),
            g_scale,
            w_scale,
            OUT_DTYPE,  # the rowwise kernels return bf16
            fast_accum=False,
        ).to(x_dtype)
    if need_w:  # contraction over M: g and x both scaled per column
        x2 = x.reshape(-1, weight.shape[1])
        g_scale = fp8_scale(g, g_dtype, recipe, dim=0)
        x_scale = fp8_scale(x2, E4M3, recipe, dim=0)
        grad_w = _scaled_mm(
            _pad_rows(fp8_quantize(g, g_scale, g_dtype)).t(),
            _pad_rows(fp8_quantize(x2, x_scale, E4M3)),
            g_scale.reshape(-1, 1),
            x_scale,
            OUT_DTYPE,
            fast_accum=False,
        ).to(w_dtype)
    return grad_x, grad_w


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_b = ctx.needs_input_grad[6]
    b_dtype = ctx.dtypes[2]
    n = grad.shape[-1]
    g = grad.reshape(-1, n)
    tensorwise = get_recipe(ctx.recipe).granularity is Granularity.TENSORWISE
    grad_x, grad_w = (_tensorwise_grads if tensorwise else _rowwise_grads)(ctx, g, need_x, need_w)
    if grad_x is not None:
        grad_x = grad_x.reshape(*grad.shape[:-1], -1)
    grad_b = g.sum(0, dtype=torch.float32).to(b_dtype) if need_b else None
    return grad_x, grad_w, None, None, None, None, grad_b, None


torch.library.register_autograd(
    "amp_graph::fp8_linear", _backward, setup_context=_setup_context, lib=_lib
)


# ---- typed entry point -----------------------------------------------------------------------


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    recipe: str = "tensorwise",
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as an fp8 scaled matmul, returning bfloat16: the same
    five ops the graph pass inserts (scale and quantize each operand, then ``fp8_linear``)."""
    ops = torch.ops.amp_graph
    x_scale = ops.fp8_scale(x, E4M3, recipe)
    w_scale = ops.fp8_scale(weight, E4M3, recipe)
    return ops.fp8_linear(
        x,
        weight,
        ops.fp8_quantize(x, x_scale, E4M3),
        x_scale,
        ops.fp8_quantize(weight, w_scale, E4M3),
        w_scale,
        bias,
        recipe,
    )


__all__ = [
    "SCHEMAS",
    "Fp8UnsupportedError",
    "fp8_matmul_error",
    "fp8_quantize",
    "fp8_scale",
    "linear",
    "require_fp8_matmul",
]
