"""Whether a value is a DTensor (FSDP2's sharded parameters and gradients, tensor
parallelism), without importing torch.distributed where torch was built without it."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(value: object) -> bool:
    """``value`` is a ``torch.distributed.tensor.DTensor`` (False for plain tensors at once,
    and everywhere on a torch built without distributed). Cheap enough for a per-gradient
    check: the type is looked up once per process."""
    if type(value) is torch.Tensor:
        return False
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(value, dtensor)


__all__ = ["is_dtensor"]
