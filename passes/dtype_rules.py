"""Output dtypes without example inputs: a small, sound rule table.

When a graph input has no example value, its dtype is ``UNKNOWN`` and FakeTensor
propagation cannot run. These rules derive output dtypes from input dtypes for the ops
where that is certain, and answer ``UNKNOWN`` everywhere else. ``UNKNOWN`` is always safe:
a cast whose input dtype is unknown becomes a conditional cast (torch.autocast's own
eligibility test at run time), and no cast is removed on an unproven dtype.
"""

from __future__ import annotations

import builtins
from typing import Any

import torch
import torch.fx as fx

from amp_graph.policy import base_name

from .meta import NOT_TENSOR, UNKNOWN, AmpInfo, DtypeFact, Role, cast_fact, tensor_facts

# Output dtype is the first argument's, whatever it is (views, indexing, copies).
FIRST_ARG = frozenset(
    {
        "view",
        "reshape",
        "permute",
        "transpose",
        "flatten",
        "unflatten",
        "squeeze",
        "unsqueeze",
        "expand",
        "expand_as",
        "repeat",
        "narrow",
        "select",
        "t",
        "getitem",
        "contiguous",
        "clone",
        "detach",
        "flip",
        "roll",
        "tril",
        "triu",
        "masked_fill",
        "movedim",
        "swapaxes",
        "view_as",
        "reshape_as",
        "index_select",
        "gather",
        "identity",
        "pad",
        "constant_pad_nd",
    }
)
# Output dtype is the first argument's when that is floating (losses take integer targets).
FLOAT_FIRST_ARG = frozenset(
    {
        "cross_entropy_loss",
        "log_softmax",
        "softmax",
        "nll_loss",
        "mse_loss",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "kl_div",
        "binary_cross_entropy_with_logits",
        "dropout",
        "relu",
        "gelu",
        "silu",
        "tanh",
        "sigmoid",
        "hardtanh",
        "leaky_relu",
        "elu",
        "mish",
        "hardswish",
        "hardsigmoid",
        "relu6",
        "selu",
        "celu",
        "softplus",
        "max_pool1d",
        "max_pool2d",
        "max_pool3d",
        "avg_pool1d",
        "avg_pool2d",
        "adaptive_avg_pool1d",
        "adaptive_avg_pool2d",
        "mean",
        "sum",
        "exp",
        "log",
        "sqrt",
        "rsqrt",
        "sin",
        "cos",
        "neg",
        "abs",
        "pow",
    }
)
# Output dtype is that of the floating inputs, when they all agree.
ELEMENTWISE = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "maximum",
        "minimum",
        "where",
        "lerp",
        "clamp",
        "clip",
        "layer_norm",
        "group_norm",
        "rms_norm",
        "matmul",
        "linear",
        "bmm",
        "mm",
        "baddbmm",
        "addmm",
        "scaled_dot_product_attention",
        "conv1d",
        "conv2d",
        "conv3d",
        "einsum",
        "cat",
        "stack",
        "prelu",
        "batch_norm",
    }
)
# Ops that raise unless their floating inputs share one dtype: if they ran, that is it.
SAME_DTYPE_REQUIRED = frozenset(
    {
        "linear",
        "matmul",
        "mm",
        "bmm",
        "addmm",
        "baddbmm",
        "addbmm",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "einsum",
        "scaled_dot_product_attention",
        "prelu",
        "_cudnn_rnn",
        "mkldnn_rnn_layer",
    }
)
COMPARISONS = frozenset(
    {
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "isnan",
        "isinf",
        "isfinite",
        "logical_and",
        "logical_or",
        "logical_not",
    }
)
INDEX_RESULTS = frozenset({"argmax", "argmin", "argsort", "nonzero"})
_CAST_METHODS = {
    "float": torch.float32,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "double": torch.float64,
    "long": torch.int64,
    "int": torch.int32,
    "short": torch.int16,
    "bool": torch.bool,
    "byte": torch.uint8,
    "char": torch.int8,
}


def user_cast_dtype(node: fx.Node, input_facts: list[DtypeFact]) -> DtypeFact:
    """The dtype a cast written in the model produces, or UNKNOWN."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name in _CAST_METHODS:
        return _CAST_METHODS[name]
    for arg in [*node.args[1:], *node.kwargs.values()]:
        if isinstance(arg, torch.dtype):
            return arg
    if name in ("to", "type_as") and len(input_facts) > 1:
        return input_facts[1]  # x.to(other) / x.type_as(other)
    if name == "to" and input_facts:  # x.to(device) keeps the dtype
        return input_facts[0]
    return UNKNOWN


def rule_out_dtype(node: fx.Node, amp: AmpInfo, args_facts: Any) -> DtypeFact:
    """The output dtype of ``node`` given its (already cast) input facts, or UNKNOWN."""
    tensors = tensor_facts(args_facts)
    if amp.role is Role.OTHER:
        tensor_attrs = ("T", "mT", "H", "mH", "data")
        if node.target is builtins.getattr and node.args[1] in tensor_attrs and tensors:
            return tensors[0]
        return NOT_TENSOR
    if amp.role is Role.CAST:  # inserted: casts convert castable inputs only
        dtype = node.args[1]
        if not isinstance(dtype, torch.dtype):
            return UNKNOWN  # widened at run time (widest_castable_dtype)
        return cast_fact(args_facts[0][0] if args_facts and args_facts[0] else UNKNOWN, dtype)
    if amp.role is Role.USER_CAST:
        return user_cast_dtype(node, tensors)
    if amp.role is Role.INPLACE:
        return tensors[0] if tensors else UNKNOWN
    op = base_name(amp.aten) if amp.aten else ""
    if op == "embedding" and len(tensors) >= 2:
        return tensors[1]  # the table's dtype; the indices are integers
    if op in COMPARISONS:
        return torch.bool
    if op in INDEX_RESULTS:
        return torch.int64
    known_floating = {f for f in tensors if f is not UNKNOWN and f.is_floating_point}
    if op in SAME_DTYPE_REQUIRED and len(known_floating) == 1 and node.op != "call_module":
        return known_floating.pop()
    if not tensors or tensors[0] is UNKNOWN:
        return UNKNOWN
    first = tensors[0]
    if op in FIRST_ARG or (op in FLOAT_FIRST_ARG and first.is_floating_point):
        return first
    floating = [f for f in tensors if f is UNKNOWN or f.is_floating_point]
    if op in ELEMENTWISE and len(set(floating)) == 1 and first.is_floating_point:
        return first
    return UNKNOWN
