"""Colours and classes shared by the drawings and the HTML tables.

Every drawn node gets one *dtype class*: ``fp32``, ``fp16``, ``bf16``, ``int`` (integer and
bool tensors) or ``other`` (float64, non-tensor values, dtypes not proven). Ops are
classed by the dtype they compute in (their ``compute_dtype``), other nodes by the dtype
they return. The strong colours are :data:`DTYPE_COLORS`, so tables and
drawings agree; node fills are light tints of them so that labels stay readable.
"""

from __future__ import annotations

from typing import Any

import torch

from amp_graph.passes.meta import AmpInfo, Role, tensor_facts

DTYPE_COLORS = {"fp32": "#4e79a7", "fp16": "#f28e2b", "bf16": "#e15759", "?": "#bab0ac"}
"""The strong colour of each dtype, shared by the tables, the drawings and the legend."""

DTYPE_CLASSES = ("fp32", "fp16", "bf16", "int", "other")

STROKE: dict[str, str] = {
    "fp32": DTYPE_COLORS["fp32"],
    "fp16": DTYPE_COLORS["fp16"],
    "bf16": DTYPE_COLORS["bf16"],
    "int": "#59a14f",
    "other": "#9d9d9d",
}


def tint(color: str, amount: float = 0.72) -> str:
    """``color`` mixed with white: ``tint("#4e79a7")`` is a light blue."""
    rgb = [int(color[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in rgb)


FILL: dict[str, str] = {name: tint(color) for name, color in STROKE.items()}

CAST_FILL = "#ffd43b"  # casts are gold hexagons, whatever their dtype; the border is the dtype
STATUS_COLORS = {"added": "#2f9e44", "removed": "#868e96", "changed": "#7048e8"}
STATUS_MARK = {"added": "+", "removed": "-", "changed": "~"}
EDGE_COLOR = "#7a7a7a"
CLUSTER_COLOR = "#adb5bd"

_CLASS_OF_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def class_of(dtype: Any) -> str:
    """The dtype class of one dtype fact (a torch.dtype, a marker, or a pytree of them)."""
    leaves = tensor_facts(dtype)
    for leaf in leaves:  # a tuple of outputs is classed by its first floating member
        if leaf in _CLASS_OF_DTYPE:
            return _CLASS_OF_DTYPE[leaf]
    for leaf in leaves:
        if isinstance(leaf, torch.dtype) and not leaf.is_floating_point and not leaf.is_complex:
            return "int"
    return "other"


def node_class(amp: AmpInfo) -> str:
    """The dtype class a node is drawn in: compute dtype for ops that cast, else output."""
    if amp.role is Role.OP and amp.compute_dtype is not None:
        return class_of(amp.compute_dtype)
    return class_of(amp.out_dtype)
