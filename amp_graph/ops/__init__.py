"""The ops the graphs call: the ``torch.ops.amp_graph.*`` custom ops and their kernels.

* :mod:`~amp_graph.ops.scaler_ops` - the scaler's fused non-finite check, unscale and scale
  update; their CUDA kernels are :mod:`~amp_graph.ops.cuda_extension` (``csrc/``), their CPU
  path :mod:`~amp_graph.ops.cpu_extension`;
* :mod:`~amp_graph.ops.recompute_ops` - ``recomputed_cast`` / ``recomputed_quantize``, the casts
  that backward computes again instead of keeping, and their saved-tensor hooks (which casts to
  recompute is decided by the pass :mod:`amp_graph.passes.recompute_casts`);
* :mod:`~amp_graph.ops.fp8_ops` - the ``amp_graph::fp8_*`` ops and :func:`linear`;
  :mod:`~amp_graph.ops.fp8_cpu_matmul` chooses the CPU's float8 matmul;
* :mod:`~amp_graph.ops.tensor_stats` - the monitor's per-tensor statistics op (the pass that
  places it is :mod:`amp_graph.passes.instrument`, the runtime :mod:`amp_graph.monitoring`).

Importing this package registers the scaler ops; nothing is compiled until a CUDA tensor
reaches one of them.
"""

from amp_graph.ops.cuda_extension import ExtensionStatus, extension_status
from amp_graph.ops.scaler_ops import (
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
