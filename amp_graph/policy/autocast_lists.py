"""torch.autocast's op lists, as data.

The CUDA lists are the ``AT_FORALL_*`` macros of ``ATen/autocast_mode.h`` (shipped with
every torch wheel under ``torch/include``); the CPU lists are the registrations of
``aten/src/ATen/autocast_mode.cpp`` for the ``AutocastCPU`` key. Names are aten op names;
an overload is written ``name.overload`` only where autocast registers just that overload.
``tests/test_tables.py`` checks these tables against the installed torch (the header, and
the dispatcher's ``AutocastCPU``/``AutocastCUDA`` registrations) so that drift shows up.

The lists differ between torch releases. The literal tables below are torch.autocast's as of
torch 2.13 (the oldest release amp_graph supports; 2.11's differ: no float32 ``rms_norm``
on CUDA); :data:`CHANGES` records what later releases added and removed, and the
module's public tables (``CPU_FP32``, ...) are those of the *installed* torch
(:func:`tables_for`), so that O1 and ``policy="autocast"`` mean what this torch's autocast
does. A release that changes them again fails ``tests/test_tables.py`` until a
:class:`ListChange` says what changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.torch_version import TorchVersion

# fmt: off  (the tables read better packed)

# --- CUDA (ATen/autocast_mode.h) -------------------------------------------------------

# AT_FORALL_LOWER_PRECISION_FP: cast floating inputs to the low-precision dtype.
CUDA_LOWER_PRECISION: frozenset[str] = frozenset(
    {
        "_convolution.deprecated",
        "_convolution",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_tbc",
        "conv_transpose1d",
        "conv_transpose2d.input",
        "conv_transpose3d.input",
        "convolution",
        "prelu",
        "addmm",
        "addmv",
        "addr",
        "matmul",
        "einsum",
        "mm",
        "mv",
        "linalg_vecdot",
        "linear",
        "addbmm",
        "baddbmm",
        "bmm",
        "chain_matmul",
        "linalg_multi_dot",
        "_thnn_fused_lstm_cell",
        "_thnn_fused_gru_cell",
        "lstm_cell",
        "gru_cell",
        "rnn_tanh_cell",
        "rnn_relu_cell",
        "_scaled_dot_product_flash_attention",
        "scaled_dot_product_attention",
    }
)

# Registered for AutocastCUDA outside the header's macros, in files that only CUDA builds
# compile: cuDNN's RNN (aten/src/ATen/cudnn/AutocastRNN.cpp) and cuDNN convolutions.
CUDA_LOWER_PRECISION_EXTRA: frozenset[str] = frozenset(
    {
        "_cudnn_rnn",
        "cudnn_convolution",
        "cudnn_convolution_transpose",
    }
)

# AT_FORALL_FP32: cast floating inputs to float32.
CUDA_FP32: frozenset[str] = frozenset(
    {
        "acos",
        "asin",
        "cosh",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log2",
        "log1p",
        "reciprocal",
        "rsqrt",
        "sinh",
        "tan",
        "pow.Tensor_Scalar",
        "pow.Tensor_Tensor",
        "pow.Scalar",
        "softplus",
        "layer_norm",
        "native_layer_norm",
        "rms_norm",
        "group_norm",
        "frobenius_norm.dim",
        "nuclear_norm",
        "nuclear_norm.dim",
        "cosine_similarity",
        "poisson_nll_loss",
        "cosine_embedding_loss",
        "nll_loss",
        "nll_loss2d",
        "hinge_embedding_loss",
        "kl_div",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "mse_loss",
        "margin_ranking_loss",
        "multilabel_margin_loss",
        "soft_margin_loss",
        "triplet_margin_loss",
        "multi_margin_loss",
        "binary_cross_entropy_with_logits",
        "dist",
        "pdist",
        "cdist",
        "renorm",
        "logsumexp",
        "upsample_nearest1d",
        "_upsample_nearest_exact1d",
        "upsample_nearest2d",
        "_upsample_nearest_exact2d",
        "upsample_nearest3d",
        "_upsample_nearest_exact3d",
        "upsample_linear1d",
        "upsample_bilinear2d",
        "_upsample_bilinear2d_aa",
        "upsample_trilinear3d",
        "upsample_bicubic2d",
        "_upsample_bicubic2d_aa",
    }
)

# AT_FORALL_FP32_SET_OPT_DTYPE: run in float32 by setting the op's dtype argument, unless
# the caller set it. AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE: norm, likewise.
CUDA_FP32_SET_OPT_DTYPE: frozenset[str] = frozenset(
    {
        "prod",
        "prod.dim_int",
        "softmax.int",
        "log_softmax.int",
        "cumprod",
        "cumsum",
        "linalg_vector_norm",
        "linalg_matrix_norm",
        "linalg_matrix_norm.str_ord",
        "sum",
        "sum.dim_IntList",
        "norm.Scalar",
        "norm.ScalarOpt_dim",
    }
)

# AT_FORALL_PROMOTE: cast floating inputs to the widest floating input type.
CUDA_PROMOTE: frozenset[str] = frozenset(
    {
        "addcdiv",
        "addcmul",
        "atan2",
        "bilinear",
        "cross",
        "dot",
        "vdot",
        "grid_sampler",
        "index_put",
        "tensordot",
        "scatter_add",
    }
)

# Autocast raises for these on CUDA (unsafe to autocast; use the *_with_logits form).
CUDA_BANNED: frozenset[str] = frozenset({"binary_cross_entropy"})

# Registered for AutocastCUDA as float32 outside the header's macros (autocast_mode.cpp):
# none before torch 2.14 (see CHANGES).
CUDA_FP32_EXTRA: frozenset[str] = frozenset()

# --- CPU (aten/src/ATen/autocast_mode.cpp, AutocastCPU) --------------------------------

CPU_LOWER_PRECISION: frozenset[str] = frozenset(
    {
        "conv1d",
        "conv1d.padding",
        "conv2d",
        "conv2d.padding",
        "conv3d",
        "conv3d.padding",
        "bmm",
        "mm",
        "linalg_vecdot",
        "baddbmm",
        "addmm",
        "addbmm",
        "linear",
        "_convolution.deprecated",
        "matmul",
        "conv_tbc",
        "mkldnn_rnn_layer",
        "conv_transpose1d",
        "conv_transpose2d.input",
        "conv_transpose3d.input",
        "prelu",
        "scaled_dot_product_attention",
        "_native_multi_head_attention",
        "_addmm_activation",
    }
)

CPU_FP32: frozenset[str] = frozenset(
    {
        "avg_pool3d",
        "binary_cross_entropy",
        "grid_sampler",
        "polar",
        "prod",
        "prod.dim_int",
        "quantile",
        "quantile.scalar",
        "nanquantile",
        "nanquantile.scalar",
        "stft",
        "stft.center",
        "cdist",
        "grid_sampler_2d",
        "_grid_sampler_2d_cpu_fallback",
        "grid_sampler_3d",
        "trace",
        "view_as_complex",
        "cholesky",
        "cholesky_inverse",
        "cholesky_solve",
        "inverse",
        "lu_solve",
        "orgqr",
        "ormqr",
        "pinverse",
        "max_pool3d",
        "max_unpool2d",
        "max_unpool3d",
        "adaptive_avg_pool3d",
        "reflection_pad1d",
        "reflection_pad2d",
        "replication_pad1d",
        "replication_pad2d",
        "replication_pad3d",
        "mse_loss",
        "cosine_embedding_loss",
        "nll_loss",
        "nll_loss2d",
        "hinge_embedding_loss",
        "poisson_nll_loss",
        "smooth_l1_loss",
        "cross_entropy_loss",
        "l1_loss",
        "huber_loss",
        "margin_ranking_loss",
        "soft_margin_loss",
        "triplet_margin_loss",
        "multi_margin_loss",
        "ctc_loss.IntList",
        "ctc_loss.Tensor",
        "kl_div",
        "multilabel_margin_loss",
        "binary_cross_entropy_with_logits",
        "fft_fft",
        "fft_ifft",
        "fft_fft2",
        "fft_ifft2",
        "fft_fftn",
        "fft_ifftn",
        "fft_rfft",
        "fft_irfft",
        "fft_rfft2",
        "fft_irfft2",
        "fft_rfftn",
        "fft_irfftn",
        "fft_hfft",
        "fft_ihfft",
        "linalg_cond",
        "linalg_cond.p_str",
        "linalg_matrix_rank",
        "linalg_matrix_rank.atol_rtol_tensor",
        "linalg_matrix_rank.atol_rtol_float",
        "linalg_matrix_rank.tol_tensor",
        "linalg_solve",
        "linalg_cholesky",
        "linalg_svdvals",
        "linalg_eigvals",
        "linalg_eigvalsh",
        "linalg_inv",
        "linalg_householder_product",
        "linalg_tensorinv",
        "linalg_tensorsolve",
        "fake_quantize_per_tensor_affine",
        "geqrf",
        "_lu_with_info",
        "qr",
        "svd",
        "triangular_solve",
        "fractional_max_pool2d",
        "fractional_max_pool3d",
        "adaptive_max_pool3d",
        "multilabel_margin_loss_forward",
        "linalg_qr",
        "linalg_cholesky_ex",
        "linalg_svd",
        "linalg_eig",
        "linalg_eigh",
        "linalg_lstsq",
        "linalg_inv_ex",
    }
)

CPU_PROMOTE: frozenset[str] = frozenset({"stack", "cat", "index_copy"})
# fmt: on

# --- what later releases changed ------------------------------------------------------------


@dataclass(frozen=True)
class ListChange:
    """What one torch release changed in one of the tables above."""

    since: str  # the first release with the change, "2.14"
    table: str  # the name of the table in this module
    added: frozenset[str] = frozenset()
    removed: frozenset[str] = frozenset()
    why: str = ""


CHANGES: tuple[ListChange, ...] = (
    ListChange(
        "2.14",
        "CPU_FP32",
        added=frozenset({"linalg_matrix_sqrth"}),
        removed=frozenset({"cholesky", "qr"}),
        why="aten::linalg_matrix_sqrth is new and autocast runs it in float32; aten::cholesky "
        "and aten::qr, deprecated since 1.9, are gone (torch.cholesky now raises)",
    ),
    ListChange(
        "2.14",
        "CUDA_FP32_EXTRA",
        added=frozenset({"linalg_matrix_sqrth"}),
        why="registered float32 for AutocastCUDA in autocast_mode.cpp, not in the header",
    ),
)

TABLES: tuple[str, ...] = (
    "CUDA_LOWER_PRECISION",
    "CUDA_LOWER_PRECISION_EXTRA",
    "CUDA_FP32",
    "CUDA_FP32_EXTRA",
    "CUDA_FP32_SET_OPT_DTYPE",
    "CUDA_PROMOTE",
    "CUDA_BANNED",
    "CPU_LOWER_PRECISION",
    "CPU_FP32",
    "CPU_PROMOTE",
)
_BEFORE_CHANGES: dict[str, frozenset[str]] = {name: globals()[name] for name in TABLES}  # 2.13


def tables_for(version: str) -> dict[str, frozenset[str]]:
    """Every table as torch.autocast of release ``version`` has it (by table name).

    >>> "linalg_matrix_sqrth" in tables_for("2.14.1")["CPU_FP32"]
    True
    >>> "qr" in tables_for("2.13.0")["CPU_FP32"]
    True
    """
    tables = dict(_BEFORE_CHANGES)
    release = TorchVersion(version.split("+")[0])
    for change in CHANGES:
        if release >= change.since:
            tables[change.table] = (tables[change.table] - change.removed) | change.added
    return tables


# The installed torch's tables: what the rest of amp_graph reads.
_INSTALLED = tables_for(str(torch.__version__))
CUDA_LOWER_PRECISION = _INSTALLED["CUDA_LOWER_PRECISION"]
CUDA_LOWER_PRECISION_EXTRA = _INSTALLED["CUDA_LOWER_PRECISION_EXTRA"]
CUDA_FP32 = _INSTALLED["CUDA_FP32"]
CUDA_FP32_EXTRA = _INSTALLED["CUDA_FP32_EXTRA"]
CUDA_FP32_SET_OPT_DTYPE = _INSTALLED["CUDA_FP32_SET_OPT_DTYPE"]
CUDA_PROMOTE = _INSTALLED["CUDA_PROMOTE"]
CUDA_BANNED = _INSTALLED["CUDA_BANNED"]
CPU_LOWER_PRECISION = _INSTALLED["CPU_LOWER_PRECISION"]
CPU_FP32 = _INSTALLED["CPU_FP32"]
CPU_PROMOTE = _INSTALLED["CPU_PROMOTE"]
