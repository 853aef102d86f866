"""Fused gradient kernels: the ``amp_graph`` custom ops and their CUDA extension.

Importing this package registers the ops (``torch.ops.amp_graph.*``); nothing is compiled until a
CUDA tensor reaches one of them (see :mod:`amp_graph.kernels.extension`).
"""

from amp_graph.kernels.extension import ExtensionStatus, extension_status
from amp_graph.kernels.scaler_ops import (
    non_finite_check_,
    non_finite_check_and_unscale_,
    non_finite_check_unscale_and_norm_,
    update_scale_,
)

__all__ = [
    "ExtensionStatus",
    "extension_status",
    "non_finite_check_",
    "non_finite_check_and_unscale_",
    "non_finite_check_unscale_and_norm_",
    "update_scale_",
]
