"""One small, runnable sample per op of torch.autocast's CUDA lists, and the header's lists.

``SAMPLES`` maps each aten op name of ``amp_graph.policy.autocast_lists``' CUDA tables
(written as in those tables: ``"softmax.int"``, ``"pow.Tensor_Scalar"``) to an
:class:`OpSample`: the Python-level call a user would write to reach that op, with every
non-tensor argument baked in, and a maker of tiny deterministic inputs. Internal ops with
no public Python API are called as ``torch.ops.aten.<name>.<overload>``.

``autocast_header_lists()`` parses ``ATen/autocast_mode.h`` of the installed torch: the
tests derive what autocast does from it, never from amp_graph's own tables.
``cuda_autocast_output()`` runs torch.autocast's real CUDA kernels without a GPU, on fake
CUDA tensors: a second, independent oracle for output dtypes.
"""

from __future__ import annotations

import contextlib
import operator
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

Inputs = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class OpSample:
    """How to call one aten op from Python, and on what."""

    aten: str  # the name as autocast's lists write it: "softmax.int"
    fn: Callable[..., torch.Tensor]  # traceable by torch.fx.symbolic_trace; one tensor out
    make_inputs: Callable[[torch.dtype], Inputs]  # floating inputs in the given dtype
    cpu_runnable: bool = True  # False: no CPU kernel exists at all
    note: str = ""


# --- input makers ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Floats:
    shape: tuple[int, ...]
    lo: float
    hi: float


@dataclass(frozen=True)
class _Ints:
    shape: tuple[int, ...]
    high: int


@dataclass(frozen=True)
class _Signs:
    shape: tuple[int, ...]


def floats(*shape: int, lo: float = -2.0, hi: float = 2.0) -> _Floats:
    """A floating input, uniform in [lo, hi) (in the dtype the test asks for)."""
    return _Floats(shape, lo, hi)


def ints(*shape: int, high: int) -> _Ints:
    """An int64 input (indices, class targets) in [0, high)."""
    return _Ints(shape, high)


def signs(*shape: int) -> _Signs:
    """A floating input of +1 and -1 (targets of margin and embedding losses)."""
    return _Signs(shape)


Spec = _Floats | _Ints | _Signs


def inputs(*specs: Spec) -> Callable[[torch.dtype], Inputs]:
    """A deterministic ``make_inputs``: the same values for every dtype, up to rounding."""

    def make(dtype: torch.dtype) -> Inputs:
        made = []
        for position, spec in enumerate(specs):
            gen = torch.Generator().manual_seed(1234 + position)
            if isinstance(spec, _Ints):
                made.append(torch.randint(0, spec.high, spec.shape, generator=gen))
                continue
            u = torch.rand(spec.shape, generator=gen)
            if isinstance(spec, _Signs):
                made.append(torch.where(u < 0.5, -1.0, 1.0).to(dtype))
            else:
                made.append((spec.lo + (spec.hi - spec.lo) * u).to(dtype))
        return tuple(made)

    return make


# --- the samples -------------------------------------------------------------------------

_CONV1D = inputs(floats(1, 2, 6), floats(3, 2, 3), floats(3))
_CONV2D = inputs(floats(1, 2, 5, 5), floats(3, 2, 3, 3), floats(3))
_CONV3D = inputs(floats(1, 2, 4, 4, 4), floats(3, 2, 2, 2, 2), floats(3))
_CONVT2D = inputs(floats(1, 2, 4, 4), floats(2, 3, 3, 3), floats(3))
_MAT = inputs(floats(3, 4), floats(4, 5))
_BATCH_MAT = inputs(floats(2, 3, 4), floats(2, 4, 5))
_UNARY = inputs(floats(3, 4))
_POSITIVE = inputs(floats(3, 4, lo=0.5, hi=2.0))
_OPEN_UNIT = inputs(floats(3, 4, lo=-0.9, hi=0.9))
_PAIR = inputs(floats(3, 4), floats(3, 4))
_SIGNED_PAIR = inputs(floats(4, 5), floats(4, 5), signs(4))
_CLASSES = inputs(floats(4, 5), ints(4, high=5))
_IMAGE_1D = inputs(floats(1, 2, 4))
_IMAGE_2D = inputs(floats(1, 2, 4, 4))
_IMAGE_3D = inputs(floats(1, 2, 3, 3, 3))
_ATTENTION = inputs(floats(1, 2, 3, 4), floats(1, 2, 3, 4), floats(1, 2, 3, 4))
# input (2, 3), hx (2, 4), cx (2, 4), w_ih (4H, 3), w_hh (4H, 4), b_ih, b_hh; H = 4.
_LSTM_CELL = inputs(
    floats(2, 3), floats(2, 4), floats(2, 4), floats(16, 3), floats(16, 4), floats(16), floats(16)
)
_GRU_CELL = inputs(floats(2, 3), floats(2, 4), floats(12, 3), floats(12, 4), floats(12), floats(12))
_RNN_CELL = inputs(floats(2, 3), floats(2, 4), floats(4, 3), floats(4, 4), floats(4), floats(4))


def _interpolate(**kwargs: object) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: F.interpolate(x, **kwargs)


_LIST: list[OpSample] = [
    # ---- AT_FORALL_LOWER_PRECISION_FP ----
    OpSample(
        "_convolution.deprecated",
        lambda x, w, b: torch.ops.aten._convolution.deprecated(
            x, w, b, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, False, False, True
        ),
        _CONV2D,
        note="internal: no public Python API",
    ),
    OpSample(
        "_convolution",
        lambda x, w, b: torch.ops.aten._convolution.default(
            x, w, b, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, False, False, True, True
        ),
        _CONV2D,
        note="internal: no public Python API",
    ),
    OpSample("conv1d", lambda x, w, b: F.conv1d(x, w, b), _CONV1D),
    OpSample("conv2d", lambda x, w, b: F.conv2d(x, w, b, padding=1), _CONV2D),
    OpSample("conv3d", lambda x, w, b: F.conv3d(x, w, b), _CONV3D),
    # conv_tbc: input (time, batch, channels), weight (kernel, in, out), bias (out).
    OpSample(
        "conv_tbc",
        lambda x, w, b: torch.conv_tbc(x, w, b, 1),
        inputs(floats(5, 2, 3), floats(2, 3, 4), floats(4)),
    ),
    OpSample(
        "conv_transpose1d",
        lambda x, w, b: F.conv_transpose1d(x, w, b),
        inputs(floats(1, 2, 4), floats(2, 3, 3), floats(3)),
    ),
    OpSample(
        "conv_transpose2d.input", lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2), _CONVT2D
    ),
    OpSample(
        "conv_transpose3d.input",
        lambda x, w, b: F.conv_transpose3d(x, w, b),
        inputs(floats(1, 2, 3, 3, 3), floats(2, 3, 2, 2, 2), floats(3)),
    ),
    OpSample(
        "convolution",
        lambda x, w, b: torch.convolution(x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
        _CONV2D,
    ),
    OpSample("prelu", lambda x, w: F.prelu(x, w), inputs(floats(2, 3, 4), floats(3))),
    OpSample(
        "addmm",
        lambda c, a, b: torch.addmm(c, a, b),
        inputs(floats(3, 5), floats(3, 4), floats(4, 5)),
    ),
    OpSample(
        "addmv", lambda c, a, v: torch.addmv(c, a, v), inputs(floats(3), floats(3, 4), floats(4))
    ),
    OpSample(
        "addr", lambda c, u, v: torch.addr(c, u, v), inputs(floats(3, 4), floats(3), floats(4))
    ),
    OpSample("matmul", lambda a, b: a @ b, _BATCH_MAT, note="the @ operator"),
    OpSample("einsum", lambda a, b: torch.einsum("bij,bjk->bik", a, b), _BATCH_MAT),
    OpSample("mm", lambda a, b: torch.mm(a, b), _MAT),
    OpSample("mv", lambda a, v: torch.mv(a, v), inputs(floats(3, 4), floats(4))),
    OpSample("linalg_vecdot", lambda a, b: torch.linalg.vecdot(a, b), _PAIR),
    OpSample(
        "linear", lambda x, w, b: F.linear(x, w, b), inputs(floats(2, 4), floats(3, 4), floats(3))
    ),
    OpSample(
        "addbmm",
        lambda c, a, b: torch.addbmm(c, a, b),
        inputs(floats(3, 5), floats(2, 3, 4), floats(2, 4, 5)),
    ),
    OpSample(
        "baddbmm",
        lambda c, a, b: torch.baddbmm(c, a, b),
        inputs(floats(2, 3, 5), floats(2, 3, 4), floats(2, 4, 5)),
    ),
    OpSample("bmm", lambda a, b: torch.bmm(a, b), _BATCH_MAT),
    OpSample(
        "chain_matmul",
        lambda a, b, c: torch.chain_matmul(a, b, c),
        inputs(floats(2, 3), floats(3, 4), floats(4, 2)),
    ),
    OpSample(
        "linalg_multi_dot",
        lambda a, b, c: torch.linalg.multi_dot([a, b, c]),
        inputs(floats(2, 3), floats(3, 4), floats(4, 2)),
    ),
    # Fused RNN cells: CUDA kernels only (the CPU path is lstm_cell/gru_cell).
    OpSample(
        "_thnn_fused_lstm_cell",
        lambda gi, gh, cx, bi, bh: torch.ops.aten._thnn_fused_lstm_cell.default(gi, gh, cx, bi, bh)[
            0
        ],
        inputs(floats(2, 16), floats(2, 16), floats(2, 4), floats(16), floats(16)),
        cpu_runnable=False,
        note="CUDA kernel only",
    ),
    OpSample(
        "_thnn_fused_gru_cell",
        lambda gi, gh, hx, bi, bh: torch.ops.aten._thnn_fused_gru_cell.default(gi, gh, hx, bi, bh)[
            0
        ],
        inputs(floats(2, 12), floats(2, 12), floats(2, 4), floats(12), floats(12)),
        cpu_runnable=False,
        note="CUDA kernel only",
    ),
    OpSample(
        "lstm_cell",
        lambda x, h, c, wi, wh, bi, bh: torch.lstm_cell(x, (h, c), wi, wh, bi, bh)[0],
        _LSTM_CELL,
    ),
    OpSample(
        "gru_cell", lambda x, h, wi, wh, bi, bh: torch.gru_cell(x, h, wi, wh, bi, bh), _GRU_CELL
    ),
    OpSample(
        "rnn_tanh_cell",
        lambda x, h, wi, wh, bi, bh: torch.rnn_tanh_cell(x, h, wi, wh, bi, bh),
        _RNN_CELL,
    ),
    OpSample(
        "rnn_relu_cell",
        lambda x, h, wi, wh, bi, bh: torch.rnn_relu_cell(x, h, wi, wh, bi, bh),
        _RNN_CELL,
    ),
    OpSample(
        "_scaled_dot_product_flash_attention",
        lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention.default(q, k, v)[0],
        _ATTENTION,
        cpu_runnable=False,
        note="CUDA kernel only (CPU has _scaled_dot_product_flash_attention_for_cpu)",
    ),
    OpSample(
        "scaled_dot_product_attention",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
        _ATTENTION,
    ),
    # ---- registered for AutocastCUDA outside the header's macros ----
    OpSample(
        "_cudnn_rnn",
        lambda x, wi, wh, bi, bh, hx, cx: torch.ops.aten._cudnn_rnn.default(
            x, [wi, wh, bi, bh], 4, None, hx, cx, 2, 4, 0, 1, False, 0.0, False, False, [], None
        )[0],
        inputs(
            floats(3, 2, 3),
            floats(16, 3),
            floats(16, 4),
            floats(16),
            floats(16),
            floats(1, 2, 4),
            floats(1, 2, 4),
        ),
        cpu_runnable=False,
        note="cuDNN only; what nn.LSTM runs on CUDA",
    ),
    OpSample(
        "cudnn_convolution",
        lambda x, w: torch.ops.aten.cudnn_convolution.default(
            x, w, [0, 0], [1, 1], [1, 1], 1, False, False, False
        ),
        inputs(floats(1, 2, 5, 5), floats(3, 2, 3, 3)),
        cpu_runnable=False,
        note="cuDNN only",
    ),
    OpSample(
        "cudnn_convolution_transpose",
        lambda x, w: torch.ops.aten.cudnn_convolution_transpose.default(
            x, w, [0, 0], [0, 0], [1, 1], [1, 1], 1, False, False, False
        ),
        inputs(floats(1, 2, 4, 4), floats(2, 3, 3, 3)),
        cpu_runnable=False,
        note="cuDNN only",
    ),
    # ---- AT_FORALL_FP32 ----
    OpSample("acos", lambda x: torch.acos(x), _OPEN_UNIT),
    OpSample("asin", lambda x: x.asin(), _OPEN_UNIT, note="Tensor method"),
    OpSample("cosh", lambda x: torch.cosh(x), _UNARY),
    OpSample("erfinv", lambda x: torch.erfinv(x), _OPEN_UNIT),
    OpSample("exp", lambda x: x.exp(), _UNARY, note="Tensor method"),
    OpSample("expm1", lambda x: torch.expm1(x), _UNARY),
    OpSample("log", lambda x: torch.log(x), _POSITIVE),
    OpSample("log10", lambda x: torch.log10(x), _POSITIVE),
    OpSample("log2", lambda x: x.log2(), _POSITIVE, note="Tensor method"),
    OpSample("log1p", lambda x: torch.log1p(x), _POSITIVE),
    OpSample("reciprocal", lambda x: torch.reciprocal(x), _POSITIVE),
    OpSample("rsqrt", lambda x: x.rsqrt(), _POSITIVE, note="Tensor method"),
    OpSample("sinh", lambda x: torch.sinh(x), _UNARY),
    OpSample("tan", lambda x: torch.tan(x), _OPEN_UNIT),
    OpSample("pow.Tensor_Scalar", lambda x: x**3, _UNARY, note="the ** operator"),
    OpSample(
        "pow.Tensor_Tensor",
        lambda x, y: torch.pow(x, y),
        inputs(floats(3, 4, lo=0.5, hi=2.0), floats(3, 4)),
    ),
    OpSample(
        "pow.Scalar",
        lambda x: operator.pow(2.0, x),
        _UNARY,
        note="2.0 ** x, as symbolic tracing records it",
    ),
    OpSample("softplus", lambda x: F.softplus(x), _UNARY),
    OpSample(
        "layer_norm",
        lambda x, w, b: F.layer_norm(x, (4,), w, b),
        inputs(floats(3, 4), floats(4), floats(4)),
    ),
    OpSample(
        "native_layer_norm",
        lambda x, w, b: torch.native_layer_norm(x, [4], w, b, 1e-5)[0],
        inputs(floats(3, 4), floats(4), floats(4)),
    ),
    OpSample("rms_norm", lambda x, w: F.rms_norm(x, (4,), w), inputs(floats(3, 4), floats(4))),
    OpSample(
        "group_norm",
        lambda x, w, b: F.group_norm(x, 2, w, b),
        inputs(floats(2, 4, 3), floats(4), floats(4)),
    ),
    OpSample(
        "frobenius_norm.dim",
        lambda x: torch.frobenius_norm(x, [0, 1]),
        _UNARY,
        note="no public caller left: torch.norm(p='fro') runs linalg_vector_norm",
    ),
    OpSample("nuclear_norm", lambda x: torch.nuclear_norm(x), _UNARY),
    OpSample("nuclear_norm.dim", lambda x: torch.nuclear_norm(x, [0, 1]), _UNARY),
    OpSample("cosine_similarity", lambda a, b: F.cosine_similarity(a, b), _PAIR),
    OpSample(
        "poisson_nll_loss",
        lambda x, t: F.poisson_nll_loss(x, t),
        inputs(floats(3, 4), floats(3, 4, lo=0.0, hi=3.0)),
    ),
    OpSample(
        "cosine_embedding_loss", lambda a, b, t: F.cosine_embedding_loss(a, b, t), _SIGNED_PAIR
    ),
    OpSample("nll_loss", lambda x, t: F.nll_loss(x, t), _CLASSES),
    OpSample(
        "nll_loss2d",
        lambda x, t: F.nll_loss(x, t),
        inputs(floats(2, 3, 2, 2), ints(2, 2, 2, high=3)),
        note="F.nll_loss on 4-d input runs aten::nll_loss2d",
    ),
    OpSample(
        "hinge_embedding_loss",
        lambda x, t: F.hinge_embedding_loss(x, t),
        inputs(floats(3, 4), signs(3, 4)),
    ),
    OpSample(
        "kl_div",
        lambda x, t: F.kl_div(x, t, reduction="batchmean"),
        inputs(floats(3, 4, lo=-3.0, hi=0.0), floats(3, 4, lo=0.0, hi=1.0)),
    ),
    OpSample("l1_loss", lambda x, t: F.l1_loss(x, t), _PAIR),
    OpSample("smooth_l1_loss", lambda x, t: F.smooth_l1_loss(x, t), _PAIR),
    OpSample("huber_loss", lambda x, t: F.huber_loss(x, t), _PAIR),
    OpSample("mse_loss", lambda x, t: F.mse_loss(x, t), _PAIR),
    OpSample(
        "margin_ranking_loss",
        lambda a, b, t: F.margin_ranking_loss(a, b, t),
        inputs(floats(4), floats(4), signs(4)),
    ),
    OpSample(
        "multilabel_margin_loss",
        lambda x, t: F.multilabel_margin_loss(x, t),
        inputs(floats(3, 4), ints(3, 4, high=4)),
    ),
    OpSample(
        "soft_margin_loss", lambda x, t: F.soft_margin_loss(x, t), inputs(floats(3, 4), signs(3, 4))
    ),
    OpSample(
        "triplet_margin_loss",
        lambda a, p, n: F.triplet_margin_loss(a, p, n),
        inputs(floats(3, 4), floats(3, 4), floats(3, 4)),
    ),
    OpSample("multi_margin_loss", lambda x, t: F.multi_margin_loss(x, t), _CLASSES),
    OpSample(
        "binary_cross_entropy_with_logits",
        lambda x, t: F.binary_cross_entropy_with_logits(x, t),
        inputs(floats(3, 4), floats(3, 4, lo=0.0, hi=1.0)),
    ),
    OpSample("dist", lambda a, b: torch.dist(a, b), _PAIR),
    OpSample("pdist", lambda x: F.pdist(x), _UNARY),
    OpSample("cdist", lambda a, b: torch.cdist(a, b), inputs(floats(3, 4), floats(2, 4))),
    OpSample("renorm", lambda x: torch.renorm(x, 2, 0, 1.0), _UNARY),
    OpSample("logsumexp", lambda x: torch.logsumexp(x, 1), _UNARY),
    OpSample("upsample_nearest1d", _interpolate(scale_factor=2.0, mode="nearest"), _IMAGE_1D),
    OpSample(
        "_upsample_nearest_exact1d", _interpolate(scale_factor=2.0, mode="nearest-exact"), _IMAGE_1D
    ),
    OpSample("upsample_nearest2d", _interpolate(scale_factor=2.0), _IMAGE_2D),
    OpSample(
        "_upsample_nearest_exact2d", _interpolate(size=(6, 6), mode="nearest-exact"), _IMAGE_2D
    ),
    OpSample("upsample_nearest3d", _interpolate(scale_factor=2.0, mode="nearest"), _IMAGE_3D),
    OpSample(
        "_upsample_nearest_exact3d", _interpolate(scale_factor=2.0, mode="nearest-exact"), _IMAGE_3D
    ),
    OpSample("upsample_linear1d", _interpolate(scale_factor=2.0, mode="linear"), _IMAGE_1D),
    OpSample("upsample_bilinear2d", _interpolate(scale_factor=2.0, mode="bilinear"), _IMAGE_2D),
    OpSample(
        "_upsample_bilinear2d_aa",
        _interpolate(size=(3, 3), mode="bilinear", antialias=True),
        _IMAGE_2D,
    ),
    OpSample("upsample_trilinear3d", _interpolate(scale_factor=2.0, mode="trilinear"), _IMAGE_3D),
    OpSample("upsample_bicubic2d", _interpolate(scale_factor=2.0, mode="bicubic"), _IMAGE_2D),
    OpSample(
        "_upsample_bicubic2d_aa",
        _interpolate(size=(3, 3), mode="bicubic", antialias=True),
        _IMAGE_2D,
    ),
    # ---- AT_FORALL_FP32_SET_OPT_DTYPE, and norm (AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE) ----
    OpSample("prod", lambda x: torch.prod(x), _POSITIVE),
    OpSample("prod.dim_int", lambda x: x.prod(1), _POSITIVE, note="Tensor method"),
    OpSample("softmax.int", lambda x: F.softmax(x, dim=-1), _UNARY),
    OpSample("log_softmax.int", lambda x: F.log_softmax(x, dim=-1), _UNARY),
    OpSample("cumprod", lambda x: torch.cumprod(x, 1), _POSITIVE),
    OpSample("cumsum", lambda x: x.cumsum(0), _UNARY, note="Tensor method"),
    OpSample("linalg_vector_norm", lambda x: torch.linalg.vector_norm(x), _UNARY),
    OpSample("linalg_matrix_norm", lambda x: torch.linalg.matrix_norm(x, ord=1), _UNARY),
    OpSample("linalg_matrix_norm.str_ord", lambda x: torch.linalg.matrix_norm(x), _UNARY),
    OpSample("sum", lambda x: x.sum(), _UNARY, note="Tensor method"),
    OpSample("sum.dim_IntList", lambda x: torch.sum(x, dim=1), _UNARY),
    OpSample(
        "norm.Scalar",
        lambda x: torch.ops.aten.norm.Scalar(x, 2),
        _UNARY,
        note="torch.norm and Tensor.norm run linalg_vector_norm on CPU and CUDA",
    ),
    OpSample(
        "norm.ScalarOpt_dim",
        lambda x: torch.ops.aten.norm.ScalarOpt_dim(x, 2, [1]),
        _UNARY,
        note="torch.norm and Tensor.norm run linalg_vector_norm on CPU and CUDA",
    ),
    # ---- AT_FORALL_PROMOTE ----
    OpSample(
        "addcdiv",
        lambda x, a, b: torch.addcdiv(x, a, b, value=0.5),
        inputs(floats(3, 4), floats(3, 4), floats(3, 4, lo=0.5, hi=2.0)),
    ),
    OpSample(
        "addcmul",
        lambda x, a, b: torch.addcmul(x, a, b, value=0.5),
        inputs(floats(3, 4), floats(3, 4), floats(3, 4)),
    ),
    OpSample("atan2", lambda a, b: torch.atan2(a, b), _PAIR),
    OpSample(
        "bilinear",
        lambda a, b, w, bias: F.bilinear(a, b, w, bias),
        inputs(floats(2, 3), floats(2, 4), floats(5, 3, 4), floats(5)),
    ),
    OpSample("cross", lambda a, b: torch.cross(a, b, dim=1), inputs(floats(2, 3), floats(2, 3))),
    OpSample("dot", lambda a, b: torch.dot(a, b), inputs(floats(5), floats(5))),
    OpSample("vdot", lambda a, b: torch.vdot(a, b), inputs(floats(5), floats(5))),
    OpSample(
        "grid_sampler",
        lambda x, g: F.grid_sample(x, g, align_corners=False),
        inputs(floats(1, 2, 4, 4), floats(1, 3, 3, 2, lo=-1.0, hi=1.0)),
    ),
    OpSample(
        "index_put",
        lambda x, i, v: x.index_put((i,), v),
        inputs(floats(5, 3), ints(2, high=5), floats(2, 3)),
        note="Tensor method",
    ),
    OpSample("tensordot", lambda a, b: torch.tensordot(a, b, dims=1), _MAT),
    OpSample(
        "scatter_add",
        lambda x, i, s: torch.scatter_add(x, 0, i, s),
        inputs(floats(4, 3), ints(2, 3, high=4), floats(2, 3)),
    ),
    # ---- banned: autocast raises on CUDA (use binary_cross_entropy_with_logits) ----
    OpSample(
        "binary_cross_entropy",
        lambda p, t: F.binary_cross_entropy(p, t),
        inputs(floats(3, 4, lo=0.05, hi=0.95), floats(3, 4, lo=0.0, hi=1.0)),
    ),
]

# Ops of later torch releases (amp_graph.policy.autocast_lists.CHANGES), where they exist.
HAS_MATRIX_SQRTH = hasattr(torch.ops.aten, "linalg_matrix_sqrth")  # new in torch 2.14
if HAS_MATRIX_SQRTH:
    _LIST.append(
        OpSample(
            "linalg_matrix_sqrth",
            lambda x: torch.ops.aten.linalg_matrix_sqrth.default(x),
            inputs(floats(1, 1, lo=0.5, hi=2.0)),  # symmetric positive definite
            note="autocast_mode.cpp registers it float32 for CUDA, outside the header",
        )
    )

SAMPLES: dict[str, OpSample] = {sample.aten: sample for sample in _LIST}
assert len(SAMPLES) == len(_LIST), "two samples for one op name"


# --- torch.autocast's CUDA lists, from the installed torch's header -----------------------

HEADER = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
_MACRO = re.compile(r"#define (AT_FORALL_\w+)\(_\)((?:[^\n]*\\\n)*[^\n]*)")
_ENTRY = re.compile(r"_\(\s*(\w+)\s*(?:,\s*(\w+)\s*)?\)")
_REDISPATCH = re.compile(r'_\(\s*ADD_NS\((\w+)\),\s*"([\w.]+)"')


def autocast_header_lists(header: Path = HEADER) -> dict[str, frozenset[str]]:
    """``{"AT_FORALL_FP32": {"acos", ..., "pow.Tensor_Scalar"}, ...}`` from the header.

    ``_(op)`` is ``"op"``, ``_(op, overload)`` is ``"op.overload"``; the redispatch macro's
    entries give their registered name (``"norm.Scalar"``).
    """
    text = header.read_text()
    lists: dict[str, frozenset[str]] = {}
    for name, body in _MACRO.findall(text):
        body = body.replace("\\\n", " ")
        if name == "AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE":
            lists[name] = frozenset(registered for _, registered in _REDISPATCH.findall(body))
        else:
            lists[name] = frozenset(f"{op}.{ov}" if ov else op for op, ov in _ENTRY.findall(body))
    return lists


# What torch.autocast does with an op on CUDA, by category.
LOWER, FP32, PROMOTE, BANNED = "lower", "fp32", "promote", "banned"

# Registered for AutocastCUDA in .cpp files, not in the header's macros (torch source:
# aten/src/ATen/autocast_mode.cpp registers cudnn_convolution{,_transpose} and bans
# binary_cross_entropy; aten/src/ATen/cudnn/AutocastRNN.cpp registers _cudnn_rnn).
CUDA_OUTSIDE_HEADER: dict[str, str] = {
    "cudnn_convolution": LOWER,
    "cudnn_convolution_transpose": LOWER,
    "_cudnn_rnn": LOWER,
    "binary_cross_entropy": BANNED,
    **({"linalg_matrix_sqrth": FP32} if HAS_MATRIX_SQRTH else {}),
}


def cuda_categories(header: Path = HEADER) -> dict[str, str]:
    """Every op name torch.autocast lists for CUDA, and its category."""
    lists = autocast_header_lists(header)
    categories = dict(CUDA_OUTSIDE_HEADER)
    for name in lists["AT_FORALL_LOWER_PRECISION_FP"]:
        categories[name] = LOWER
    for macro in (
        "AT_FORALL_FP32",
        "AT_FORALL_FP32_SET_OPT_DTYPE",
        "AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE",
    ):
        for name in lists[macro]:
            categories[name] = FP32
    for name in lists["AT_FORALL_PROMOTE"]:
        categories[name] = PROMOTE
    return categories


# --- torch.autocast's CUDA kernels, run without a GPU ------------------------------------

CUDA_AUTOCAST_REGISTERED: frozenset[str] = frozenset(
    name.removeprefix("aten::")
    for name in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
)
"""Op names with an ``AutocastCUDA`` kernel in this build (CPU-only builds have them too)."""

# Messages of errors that mean "faking CUDA needs a real CUDA build here", not a wrong dtype.
NEEDS_REAL_CUDA = (
    "Torch not compiled with CUDA enabled",
    "not linked with support for cuda",
    # a CUDA build on a machine without a GPU driver: cuDNN's kernels (called directly, as
    # the cudnn_* samples do) ask the driver even for fake tensors
    "CUDA driver version is insufficient",
    "Found no NVIDIA driver",
)

# A CUDA build of torch on a machine without a GPU driver (torch 2.15's wheel on a CPU box).
CUDA_BUILD_WITHOUT_DRIVER = torch.backends.cudnn.is_available() and not torch.cuda.is_available()


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype, enabled: bool = True) -> Iterator[None]:
    """torch.autocast("cuda") without a GPU: it turns itself off there, its flags do not.

    In a CUDA build without a driver, cuDNN is switched off for the block: nn.LSTM on fake
    CUDA tensors then runs torch's own RNN cells (both are in autocast's lower-precision
    list), as it does in a CPU build, instead of asking cuDNN, which needs the driver.
    """
    was_enabled, previous = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", enabled)
    torch.set_autocast_dtype("cuda", dtype)
    no_cudnn = (
        torch.backends.cudnn.flags(enabled=False)
        if CUDA_BUILD_WITHOUT_DRIVER
        else contextlib.nullcontext()
    )
    try:
        with no_cudnn:
            yield
    finally:
        torch.set_autocast_enabled("cuda", was_enabled)
        torch.set_autocast_dtype("cuda", previous)
        torch.clear_autocast_cache()


def cuda_autocast_output(fn: Callable[..., Any], inputs: Inputs, dtype: torch.dtype) -> Any:
    """What ``fn(*inputs)`` returns under ``torch.autocast("cuda", dtype)``, without a GPU.

    Every torch build registers the ``AutocastCUDA`` kernels; they run for tensors on a
    CUDA device while CUDA autocast is enabled. Fake CUDA tensors (shapes and dtypes, no
    data) are such tensors, so the casts are torch's own, op for op, and the result is a
    FakeTensor with the dtype a GPU run would give. ``fn`` may be an ``nn.Module`` (its
    parameters are faked too). Raises RuntimeError where faking needs a real CUDA build
    (the message then contains one of ``NEEDS_REAL_CUDA``).

    >>> out = cuda_autocast_output(torch.mm, (torch.ones(2, 2), torch.ones(2, 2)), torch.half)
    >>> out.dtype, out.device.type
    (torch.float16, 'cuda')
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fake(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")

    with FakeTensorMode(), cuda_autocast(dtype):
        args = tuple(fake(t) for t in inputs)
        if isinstance(fn, nn.Module):
            state = {name: fake(t) for name, t in [*fn.named_parameters(), *fn.named_buffers()]}
            return torch.func.functional_call(fn, state, args)
        return fn(*args)
