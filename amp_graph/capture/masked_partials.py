"""A vocabulary-parallel embedding's pending reduction survives capture.

``RowwiseParallel`` on an ``nn.Embedding`` (torchtitan's, Megatron's vocabulary-parallel
embedding) gives a DTensor whose placement is a masked partial (``_MaskPartial``): each rank
looked up only the rows it holds, and the placement carries the mask of the indices it does
not hold, which the reduction that follows applies and then releases.

On torch 2.15 the tracer snapshots every traced value for its node's ``meta["val"]`` by
``detach()``, and DTensor's sharding rules for ``detach`` do not take a masked partial: the
snapshot redistributes it to a replicated tensor, which applies the mask and releases it. The
embedding's real reduction then finds no mask (an ``AssertionError`` in
``_MaskPartial._reduce_shard_value``) and the capture fails. On torch 2.13 the snapshot keeps
the placement.

:func:`masked_partials_kept` answers that ``detach`` itself, with the same local tensor and
the same spec (so the same mask), as a detach means: a view without autograd history. The
graph is unchanged; only the snapshot stops consuming the mask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from amp_graph.ops.dtensors import is_dtensor


def _masked_partial(value: Any) -> bool:
    return is_dtensor(value) and any(
        type(p).__name__ == "_MaskPartial" for p in value._spec.placements
    )


class _KeepMaskedPartials(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.detach.default and _masked_partial(args[0]):
            value = args[0]
            return type(value)(value._local_tensor.detach(), value._spec, requires_grad=False)
        return func(*args, **kwargs)


def has_dtensors(model: nn.Module, inputs: Any = ()) -> bool:
    """Any parameter, buffer or input of ``model`` is a DTensor (a tensor-parallel or FSDP2
    model; the torch.compile backend's graphs take the parameters as inputs)."""
    return any(is_dtensor(t) for t in (*model.parameters(), *model.buffers())) or any(
        is_dtensor(leaf) for leaf in pytree.tree_leaves(inputs)
    )


@contextlib.contextmanager
def masked_partials_kept(model: nn.Module, inputs: Any = ()) -> Iterator[None]:
    """While capturing ``model(*inputs)``: a ``detach`` of a masked-partial DTensor keeps
    its mask. Nothing is pushed where no DTensor is in sight (the mode would cost a Python
    call per op of the capture)."""
    if not has_dtensors(model, inputs):
        yield
        return
    with _KeepMaskedPartials():
        yield


__all__ = ["masked_partials_kept"]
