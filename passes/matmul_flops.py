"""The FLOPs of a graph's matrix products, from its example values (a read, not a pass).

What a training step spends at least: its GEMMs and convolutions. ``recompute_casts``
weighs its recasts' time against the step this makes at the device's measured matmul rate
(``Policy(recompute_casts="auto")``: the recomputes may take only a small share of it).

Counted, forward only, two FLOPs per multiply-add: ``linear``, ``matmul``, ``mm``, ``bmm``,
``addmm``, ``baddbmm``, ``addbmm``, ``convolution`` (and the ``conv*d`` / ``conv_transpose*d``
spellings), ``scaled_dot_product_attention``, the fp8 policy's ``amp_graph::fp8_linear`` at
half its FLOPs (Hopper runs float8 products at twice bf16's rate, and the step is timed
at bf16's), and the same inside the graph modules it calls (a checkpointed block's, once
however often it is called). Everything else (the memory-bound ops, ``einsum``, other
custom kernels) is left out, so the count is a lower bound: a step estimated from it is no
longer than the real one, and a share of it is conservative. Symbolic sizes count at
their hint; a cast the passes inserted (no example value) has its source's shape; a node
without an example value otherwise counts zero.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .meta import VAL, behind_reads, is_dtype_cast, size_hint
from .state_casts import state_attribute

__all__ = ["forward_matmul_flops"]

aten = torch.ops.aten

# the operands' args indices, and the second operand's dimension that is the contraction
# (a linear's weight is (out, in); the others' second operand is (..., k, n))
_PRODUCTS = {
    aten.linear.default: (0, 1, -1),
    aten.matmul.default: (0, 1, -2),
    aten.mm.default: (0, 1, -2),
    aten.bmm.default: (0, 1, -2),
    aten.addmm.default: (1, 2, -2),
    aten.baddbmm.default: (1, 2, -2),
    aten.addbmm.default: (1, 2, -2),
}
_FP8_LINEAR = "amp_graph::fp8_linear"  # (x, weight, ...): a linear's operands
_CONVOLUTIONS = {
    aten.convolution.default,
    aten._convolution.default,
    aten.conv1d.default,
    aten.conv2d.default,
    aten.conv3d.default,
    aten.conv_transpose1d.default,
    aten.conv_transpose2d.input,
    aten.conv_transpose3d.input,
}
_TRANSPOSED = {
    aten.conv_transpose1d.default,
    aten.conv_transpose2d.input,
    aten.conv_transpose3d.input,
}


def _numel(value: Any) -> int | None:
    return size_hint(value.numel()) if isinstance(value, torch.Tensor) else None


def _val(arg: Any) -> Any:
    """``arg``'s example value; a cast the passes inserted has none, and takes its
    source's shape."""
    while isinstance(arg, fx.Node):
        arg = behind_reads(arg)
        if (value := arg.meta.get(VAL)) is not None:
            return value
        if not is_dtype_cast(arg):
            return None
        arg = arg.args[0]
    return None


def _contraction(node: fx.Node, first: int, second: int, second_dim: int) -> int | None:
    """The product's contraction length, from whichever operand has an example value (a
    cast a pass inserted has none): the first's last dimension, or the second's
    ``second_dim`` (its only one, where it is a vector)."""
    value = _val(node.args[first])
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return size_hint(value.shape[-1])
    value = _val(node.args[second])
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return size_hint(value.shape[second_dim if value.dim() > 1 else -1])
    return None


def _node_flops(node: fx.Node) -> int:
    target, out = node.target, node.meta.get(VAL)
    out_numel = _numel(out)
    if out_numel is None:
        return 0
    if isinstance(target, torch._ops.OpOverload) and target.name() == _FP8_LINEAR:
        return out_numel * (_contraction(node, 0, 1, -1) or 0)  # half of 2 per multiply-add
    if target in _PRODUCTS:
        k = _contraction(node, *_PRODUCTS[target])
        if k and target is aten.addbmm.default:  # sums over the batch too
            k *= size_hint(_val(node.args[2]).shape[0]) or 0
        return 2 * out_numel * (k or 0)
    if target in _CONVOLUTIONS:
        source, weight = _val(node.args[0]), _val(node.args[1])
        transposed = target in _TRANSPOSED or (
            target in (aten.convolution.default, aten._convolution.default) and bool(node.args[6])
        )
        weight_numel = _numel(weight)
        if not weight_numel or not isinstance(weight, torch.Tensor):
            return 0
        per_output = weight_numel // (size_hint(weight.shape[0]) or 1)
        # a transposed convolution's weight is (in, out/groups, k...): one product per input
        counted = _numel(source) if transposed else out_numel
        return 2 * (counted or 0) * per_output
    if target is aten.scaled_dot_product_attention.default:
        query, key = _val(node.args[0]), _val(node.args[1])
        q_numel = _numel(query)
        if not q_numel or not isinstance(key, torch.Tensor) or key.dim() < 2:
            return 0
        keys = size_hint(key.shape[-2]) or 0
        return 4 * q_numel * keys  # QK^T and PV, each 2 * (B H Lq D) * Lk
    return 0


def forward_matmul_flops(gm: fx.GraphModule) -> int:
    """The forward FLOPs of ``gm``'s matrix products (see the module docstring), its
    submodules' included."""
    total = 0
    for node in gm.graph.nodes:
        if node.op == "call_function":
            total += _node_flops(node)
        elif node.op in ("call_module", "get_attr"):  # a block: checkpoint(get_attr, ...)
            child = state_attribute(gm, str(node.target))
            if isinstance(child, fx.GraphModule):
                total += forward_matmul_flops(child)
    return total
