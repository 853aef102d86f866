"""Test helper: a dispatch probe that sees the scaled matmuls inside amp_graph's fp8 ops."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class ScaledMatmulProbe(TorchDispatchMode):
    """Records every aten._scaled_mm (operand dtypes), looking inside amp_graph's opaque ops
    by running their CPU kernels under this mode (a mode otherwise sees only the op)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._scaled_mm.default:
            self.calls.append((args[0].dtype, args[1].dtype))
        if func.namespace == "amp_graph":
            with self:
                keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
                return func.redispatch(keys, *args, **kwargs)
        return func(*args, **kwargs)
