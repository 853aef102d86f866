"""What a forward leaves alive for backward, counted so that no mechanism can hide it.

Saved-tensor hooks see only what autograd saves through them; a checkpoint's or a
selective-checkpoint cache's tensors, a cast cache, or a tensor kept by a closure escape
them. :class:`HeldForBackward` instead holds a weak reference to every tensor an aten op
makes while it is active (a ``TorchDispatchMode``, below autograd), and once the forward
returns counts the distinct storages still alive, leaving out those the caller names
(the parameters).

>>> import torch
>>> from amp_graph.inspect.held import held_for_backward
>>> lin = torch.nn.Linear(4, 4)
>>> held, out = held_for_backward(lambda: lin(torch.randn(2, 4)).relu(), lin.parameters())
>>> held > 0
True
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class HeldForBackward(TorchDispatchMode):
    """Weakly references every tensor an aten op makes while active; :meth:`held_bytes`
    sums the distinct storages still alive."""

    def __init__(self) -> None:
        super().__init__()
        self._made: list[weakref.ref] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor) and not value.is_meta:
                self._made.append(weakref.ref(value))
        return out

    def held_bytes(self, exclude: Iterable[torch.Tensor] = ()) -> int:
        """Bytes of the distinct live storages made while active, ``exclude`` 's left out."""
        excluded = {_storage_key(t) for t in exclude}
        storages: dict[int, int] = {}
        for ref in self._made:
            tensor = ref()
            if tensor is None:
                continue
            key = _storage_key(tensor)
            if key not in excluded:
                storages[key] = tensor.untyped_storage().nbytes()
        return sum(storages.values())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2's sharded parameter's) local shard; a tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def fsdp_deferred_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """FSDP2's last all-gather output, where FSDP2 defers freeing it to its next all-gather
    (``world_size > 1``; in eager runs too, in some interleavings): its communication
    state, not something backward keeps."""
    get_state = getattr(model, "_get_fsdp_state", None)
    deferred = get_state()._comm_ctx.all_gather_state if callable(get_state) else None
    return [] if deferred is None else [deferred.all_gather_result.all_gather_output]


def held_for_backward(
    forward: Callable[[], Any], exclude: Iterable[torch.Tensor] = (), model: Any = None
) -> tuple[int, Any]:
    """Run ``forward()`` and return (bytes it left alive, its output), storages of
    ``exclude`` (the model's parameters and buffers) not counted, nor those of
    :func:`fsdp_deferred_buffers` of ``model`` (an FSDP2 root) after the forward."""
    mode = HeldForBackward()
    with mode:
        out = forward()
    transient = fsdp_deferred_buffers(model) if model is not None else []
    return mode.held_bytes([*(_local(t) for t in exclude), *transient]), out


__all__ = ["HeldForBackward", "fsdp_deferred_buffers", "held_for_backward"]
