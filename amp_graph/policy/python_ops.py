"""Which aten op torch.autocast sees when a Python-level callable runs.

torch.autocast works on aten ops; a user names policy keys as Python callables
(``F.softmax``), operators (``operator.matmul``) and module types (``nn.LSTM``). Such a key
matches the captured graph's aten nodes through the aten op the callable runs. Each entry
lists candidates in order: the first one that the device's autocast lists mention decides
(``F.cross_entropy`` is ``cross_entropy_loss`` on CPU, where autocast registers it, and
``log_softmax`` on CUDA, where it does not and the composite's first op is fp32). The
aliases and composites below serve the aten nodes themselves (``aten.lstm``).

Builtins bound from ATen (``torch.mm``, ``torch._C._nn.linear``, ``Tensor.softmax``) need
no entry: their ``__name__`` is the aten op's name.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

AtenNames = tuple[str, ...]

# cuDNN runs every RNN in low precision under CUDA autocast; on CPU the LSTM has a oneDNN
# path (mkldnn_rnn_layer) and the others decompose into linear. (The CPU GRU and the cells
# then promote back to a float32 hidden state; amp_graph keeps them low: see README.)
_LSTM: AtenNames = ("_cudnn_rnn", "mkldnn_rnn_layer")
_GRU: AtenNames = ("_cudnn_rnn", "linear")
_RNN: AtenNames = ("_cudnn_rnn", "linear")

# Python functions (not ATen builtins) and the aten op autocast sees when they run.
FUNCTIONS: dict[Callable, AtenNames] = {
    F.softmax: ("softmax",),
    F.softmin: ("softmax",),
    F.log_softmax: ("log_softmax",),
    F.gumbel_softmax: ("softmax",),
    F.layer_norm: ("layer_norm",),
    F.group_norm: ("group_norm",),
    F.batch_norm: ("batch_norm",),
    F.instance_norm: ("instance_norm",),
    F.normalize: ("norm",),
    F.cross_entropy: ("cross_entropy_loss", "log_softmax"),
    F.nll_loss: ("nll_loss",),
    F.mse_loss: ("mse_loss",),
    F.l1_loss: ("l1_loss",),
    F.smooth_l1_loss: ("smooth_l1_loss",),
    F.huber_loss: ("huber_loss",),
    F.kl_div: ("kl_div",),
    F.binary_cross_entropy: ("binary_cross_entropy",),
    F.binary_cross_entropy_with_logits: ("binary_cross_entropy_with_logits",),
    F.poisson_nll_loss: ("poisson_nll_loss",),
    F.cosine_embedding_loss: ("cosine_embedding_loss",),
    F.hinge_embedding_loss: ("hinge_embedding_loss",),
    F.margin_ranking_loss: ("margin_ranking_loss",),
    F.multilabel_margin_loss: ("multilabel_margin_loss",),
    F.soft_margin_loss: ("soft_margin_loss",),
    F.multi_margin_loss: ("multi_margin_loss",),
    F.triplet_margin_loss: ("triplet_margin_loss",),
    F.ctc_loss: ("ctc_loss",),
    F.grid_sample: ("grid_sampler",),
    F.multi_head_attention_forward: ("_native_multi_head_attention", "linear"),
    F.embedding: ("embedding",),
    # composites: the first candidate a device's lists know decides (CPU casts at the inner
    # bmm/mm, CUDA at the composite itself)
    torch.einsum: ("einsum", "bmm"),
    torch.norm: ("norm",),
    torch.cdist: ("cdist",),
    torch.tensordot: ("tensordot", "mm"),
    torch.chain_matmul: ("chain_matmul", "mm"),
    torch.linalg.multi_dot: ("linalg_multi_dot", "mm"),
    torch.inner: ("inner", "mm"),
    torch.cov: ("cov", "mm"),
    F.multilabel_soft_margin_loss: ("sum",),
    F.local_response_norm: ("pow", "avg_pool3d"),
    F.pairwise_distance: ("norm",),
    torch.stft: ("stft",),
    torch.Tensor.norm: ("norm",),
}
if hasattr(F, "rms_norm"):
    FUNCTIONS[F.rms_norm] = ("rms_norm",)

# ATen builtins whose own name is in no list but which run a listed op (aliases and thin
# composites), by ``__name__``; tried after the name itself.
BUILTIN_ALIASES: dict[str, AtenNames] = {
    "square": ("pow",),
    "linalg_norm": ("linalg_vector_norm",),
    "linalg_matmul": ("matmul",),
    "matrix_power": ("matmul",),
    "linalg_matrix_power": ("matmul",),
    "trapezoid": ("sum",),
    "trapz": ("sum",),
    "cumulative_trapezoid": ("cumsum",),
    "pairwise_distance": ("norm",),
    "lstm": _LSTM,
    "gru": _GRU,
    "rnn_tanh": _RNN,
    "rnn_relu": _RNN,
}
SPECIAL_PREFIX = "special_"  # torch.special.expm1 is aten::special_expm1, an alias of expm1

# aten composites, by op name: CompositeImplicitAutograd ops that a device's autocast list
# may not name, so that autocast casts at the listed op their kernel runs first (an
# aten-level graph records the composite itself). F.cross_entropy is aten::cross_entropy_loss,
# listed on CPU; on CUDA its log_softmax decides.
ATEN_COMPOSITES: dict[str, AtenNames] = {
    "cross_entropy_loss": ("log_softmax",),
    "nll_loss_nd": ("nll_loss",),
    "lstm_cell": ("linear",),  # CPU: the cells run linear; CUDA lists the cells themselves
    "gru_cell": ("linear",),
    "rnn_tanh_cell": ("linear",),
    "rnn_relu_cell": ("linear",),
    "einsum": ("bmm",),
    "tensordot": ("mm",),
    "chain_matmul": ("mm",),
    "linalg_multi_dot": ("mm",),
    "inner": ("mm",),
    "cov": ("mm",),
    "pairwise_distance": ("norm",),
    "multilabel_soft_margin_loss": ("sum",),
}

# Python operators, as policy keys (``{operator.matmul: "fp32"}``).
OPERATORS: dict[Callable, AtenNames] = {
    operator.matmul: ("matmul",),
    operator.pow: ("pow",),
    operator.add: ("add",),
    operator.sub: ("sub",),
    operator.mul: ("mul",),
    operator.truediv: ("div",),
    operator.floordiv: ("floor_divide",),
    operator.neg: ("neg",),
}

# Leaf modules: the aten op autocast sees when the module runs.
MODULES: dict[type[nn.Module], AtenNames] = {
    nn.Linear: ("linear",),
    nn.Bilinear: ("bilinear",),
    nn.Conv1d: ("conv1d",),
    nn.Conv2d: ("conv2d",),
    nn.Conv3d: ("conv3d",),
    nn.ConvTranspose1d: ("conv_transpose1d",),
    nn.ConvTranspose2d: ("conv_transpose2d",),
    nn.ConvTranspose3d: ("conv_transpose3d",),
    nn.PReLU: ("prelu",),
    nn.LayerNorm: ("layer_norm",),
    nn.GroupNorm: ("group_norm",),
    nn.BatchNorm1d: ("batch_norm",),
    nn.BatchNorm2d: ("batch_norm",),
    nn.BatchNorm3d: ("batch_norm",),
    nn.SyncBatchNorm: ("batch_norm",),
    nn.InstanceNorm1d: ("instance_norm",),
    nn.InstanceNorm2d: ("instance_norm",),
    nn.InstanceNorm3d: ("instance_norm",),
    nn.LocalResponseNorm: ("pow", "avg_pool3d"),
    nn.Embedding: ("embedding",),
    nn.EmbeddingBag: ("embedding_bag",),
    nn.LSTM: _LSTM,
    nn.GRU: _GRU,
    nn.RNN: _RNN,
    nn.LSTMCell: ("lstm_cell", "linear"),
    nn.GRUCell: ("gru_cell", "linear"),
    nn.RNNCell: ("rnn_tanh_cell", "linear"),
    nn.MultiheadAttention: ("_native_multi_head_attention", "linear"),
    nn.GELU: ("gelu",),
    nn.ReLU: ("relu",),
    nn.SiLU: ("silu",),
    nn.Tanh: ("tanh",),
    nn.Sigmoid: ("sigmoid",),
    nn.Softmax: ("softmax",),
    nn.Softmax2d: ("softmax",),
    nn.Softmin: ("softmax",),
    nn.LogSoftmax: ("log_softmax",),
    nn.Softplus: ("softplus",),
    nn.CosineSimilarity: ("cosine_similarity",),
    nn.PairwiseDistance: ("norm",),
    nn.TripletMarginWithDistanceLoss: ("norm",),
    nn.MultiLabelSoftMarginLoss: ("sum",),
    nn.CrossEntropyLoss: ("cross_entropy_loss", "log_softmax"),
    nn.NLLLoss: ("nll_loss",),
    nn.MSELoss: ("mse_loss",),
    nn.L1Loss: ("l1_loss",),
    nn.SmoothL1Loss: ("smooth_l1_loss",),
    nn.HuberLoss: ("huber_loss",),
    nn.KLDivLoss: ("kl_div",),
    nn.BCELoss: ("binary_cross_entropy",),
    nn.BCEWithLogitsLoss: ("binary_cross_entropy_with_logits",),
    nn.PoissonNLLLoss: ("poisson_nll_loss",),
    nn.CosineEmbeddingLoss: ("cosine_embedding_loss",),
    nn.HingeEmbeddingLoss: ("hinge_embedding_loss",),
    nn.MarginRankingLoss: ("margin_ranking_loss",),
    nn.MultiLabelMarginLoss: ("multilabel_margin_loss",),
    nn.SoftMarginLoss: ("soft_margin_loss",),
    nn.MultiMarginLoss: ("multi_margin_loss",),
    nn.TripletMarginLoss: ("triplet_margin_loss",),
    nn.CTCLoss: ("ctc_loss",),
    nn.Upsample: ("upsample_nearest2d",),
    nn.UpsamplingNearest2d: ("upsample_nearest2d",),
    nn.UpsamplingBilinear2d: ("upsample_bilinear2d",),
    nn.ReflectionPad1d: ("reflection_pad1d",),
    nn.ReflectionPad2d: ("reflection_pad2d",),
    nn.ReflectionPad3d: ("reflection_pad3d",),
    nn.ReplicationPad1d: ("replication_pad1d",),
    nn.ReplicationPad2d: ("replication_pad2d",),
    nn.ReplicationPad3d: ("replication_pad3d",),
    nn.AvgPool3d: ("avg_pool3d",),
    nn.MaxPool3d: ("max_pool3d",),
    nn.AdaptiveAvgPool3d: ("adaptive_avg_pool3d",),
    nn.AdaptiveMaxPool3d: ("adaptive_max_pool3d",),
}
if hasattr(nn, "RMSNorm"):
    MODULES[nn.RMSNorm] = ("rms_norm",)

# Normalization layers and ops: policy O2 keeps them in float32, as Apex's O2 does (their
# parameters stay float32; the ops compute in float32).
NORMALIZATION_MODULES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
NORMALIZATION_OPS: frozenset[str] = frozenset(
    {
        "batch_norm",
        "instance_norm",
        "layer_norm",
        "native_layer_norm",
        "group_norm",
        "rms_norm",
        "local_response_norm",
        "native_batch_norm",
    }
)
# Norms whose kernels take a low-precision input with float32 weights and running statistics
# and compute in float32 inside (CPU, and CUDA's native and cuDNN batch norm): policy O2 feeds
# them the low-precision activation as it comes (rule "follow") instead of casting it to
# float32 and the result back, as Apex's O2 (keep_batchnorm_fp32) does. Measured on CPU
# against cast -> float32 norm -> cast: output and input gradient equal bit for bit, weight
# gradients and running statistics within float32 rounding. Not layer norm: torch's CPU
# mixed-dtype layer norm computes its weight and bias gradients with bfloat16-sized errors
# (2e-2 relative, measured), so O2 keeps it in float32 between two casts.
MIXED_PRECISION_NORM_OPS: frozenset[str] = frozenset(
    {"batch_norm", "native_batch_norm", "instance_norm"}
)


# Kernels that take one floating dtype for their floating tensor inputs and refuse a mix
# ("scatter(): Expected self.dtype to be equal to src.dtype"), where autocast lists none of
# them (CUDA's promote list has scatter_add and index_put). A policy that would leave them to
# follow their inputs promotes them instead: where the inputs agree nothing changes, and where
# a plan (or a dtype the torch.compile backend's trace baked as float32) makes them differ,
# the widest wins rather than the kernel failing.
ONE_DTYPE_OPS: frozenset[str] = frozenset(
    {
        "scatter",
        "scatter_add",
        "scatter_reduce",
        "index_add",
        "index_copy",
        "index_put",
        "index_reduce",
        "masked_scatter",
        "put",
    }
)


def aten_name_of(key: Callable | type) -> str | None:
    """The aten op a Python callable or a module type runs, by name (None if unknown)."""
    if isinstance(key, type):
        for cls in key.__mro__:
            if cls in MODULES:
                return MODULES[cls][0].split(".")[0]
        return None
    for table in (FUNCTIONS, OPERATORS):
        if key in table:
            return table[key][0].split(".")[0]
    if isinstance(key, torch._ops.OpOverload):
        return key._schema.name.split("::", 1)[-1]
    if isinstance(key, torch._ops.OpOverloadPacket):
        return key._qualified_op_name.split("::", 1)[-1]
    name = getattr(key, "__name__", None)
    return name if isinstance(name, str) and not name.startswith("<") else None
