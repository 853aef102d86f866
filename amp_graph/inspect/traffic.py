"""What the process group's collectives move: bytes all-gathered and reduce-scattered.

Counted on the collectives themselves, below autograd (a ``TorchDispatchMode`` sees c10d's
ops as FSDP2 calls them): each all-gather's output and each reduce-scatter's input, in the
dtype they travel in. Used by the FSDP2 tests and ``benchmarks/held_memory.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


def _nbytes(value: Any) -> int:
    leaves = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in leaves)


class CollectiveBytes(TorchDispatchMode):
    """While active: ``all_gather`` and ``reduce_scatter``, the bytes this rank's
    collectives moved (all-gather outputs, reduce-scatter inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.all_gather = 0
        self.reduce_scatter = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__
        if "allgather" in name:  # c10d.allgather_, c10d._allgather_base_: output first
            self.all_gather += _nbytes(args[0])
        elif "reduce_scatter" in name:  # c10d.reduce_scatter_(_tensor_coalesced)_: input second
            self.reduce_scatter += _nbytes(args[1])
        return func(*args, **(kwargs or {}))


__all__ = ["CollectiveBytes"]
