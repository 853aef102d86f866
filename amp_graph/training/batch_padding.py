"""A batch smaller than a captured one, padded up to it: ``enable_cuda_graph(pad_batches=...)``.

The last batch of an epoch is usually smaller. Without padding it gets a graph of its own
(``warmup_steps`` eager calls, then a capture: seen once per epoch, it runs eagerly for the
first epochs). With ``pad_batches`` the user gives one fill value per tensor input, and a
batch that fits a captured graph (every tensor input has the batch along dim 0, the same
rows in each, fewer than the graph's; everything else equal) is padded to the nearest such
graph's rows and replayed. The fill must make the padded rows count for nothing (targets at
``cross_entropy``'s ``ignore_index=-100``, a zero weight or mask); what the step returns is
cut back to the real rows where its dim 0 is the padded size.

What padding would get wrong is refused when the step is set up: BatchNorm in training mode
(the padded rows would enter its batch statistics) and gradient accumulation (each
micro-batch's mean would weigh the real rows of the padded one differently).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from amp_graph.frontends.graphed_calls import CudaGraphError, signature_of

PadValue = bool | int | float


def checked_pad_values(values: Any) -> tuple[PadValue, ...] | None:
    """``pad_batches`` as a tuple of numbers (one number stands for every tensor input)."""
    if values is None:
        return None
    flat = (values,) if isinstance(values, numbers.Number) else values
    if isinstance(flat, str | bytes) or not isinstance(flat, Iterable):
        raise ValueError(_PAD_HELP + f"; got {values!r}")
    flat = tuple(flat)
    if not flat or not all(isinstance(v, bool | int | float) for v in flat):
        raise ValueError(_PAD_HELP + f"; got {values!r}")
    return flat


_PAD_HELP = (
    "enable_cuda_graph: pad_batches is one fill value per tensor input of build, in order "
    "(e.g. (0.0, -100) for inputs and the targets cross_entropy ignores), or one number for all"
)


def refuse_padding(modules: Iterable[nn.Module], accumulation_steps: int) -> None:
    """What padded rows would change: BatchNorm's batch statistics, and the weighting of a
    step split into micro-batches."""
    if accumulation_steps > 1:
        raise CudaGraphError(
            f"enable_cuda_graph: pad_batches with gradient accumulation ({accumulation_steps} "
            "micro-batches): the padded rows would fall into the last micro-batches, whose "
            "means would weigh the real rows differently from an unpadded step. Drop "
            "pad_batches (a smaller batch then gets a graph of its own) or accumulation."
        )
    for module in modules:
        for name, sub in module.named_modules():
            if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.training:
                raise CudaGraphError(
                    f"enable_cuda_graph: pad_batches with {type(sub).__name__} "
                    f"({name or 'the model'}) in training mode: the padded rows would enter "
                    "its batch statistics. Drop pad_batches (a smaller batch then gets a "
                    "graph of its own), or use a DataLoader with drop_last=True."
                )


@dataclass(frozen=True)
class PaddedBatch:
    """A call's arguments padded from ``rows`` to ``to`` rows along dim 0."""

    args: tuple
    rows: int
    to: int

    def cut(self, outputs: Any) -> Any:
        """``outputs`` with every tensor whose dim 0 is the padded size cut to the real rows."""

        def cut_one(t: torch.Tensor) -> torch.Tensor:
            return t[: self.rows] if t.dim() and t.shape[0] == self.to else t

        return pytree.tree_map_only(torch.Tensor, cut_one, outputs)


def fitting_rows(leaves: Sequence[Any], statics: Sequence[Any]) -> int | None:
    """The rows a captured graph reading ``statics`` would pad ``leaves`` to, or None where it
    does not fit: the same inputs, each tensor alike but for more rows along dim 0 (the same
    rows in every tensor), every other input equal."""
    if len(leaves) != len(statics):
        return None
    batch: tuple[int, int] | None = None  # (rows, captured rows)
    for leaf, static in zip(leaves, statics, strict=True):
        if not isinstance(leaf, torch.Tensor) or not isinstance(static, torch.Tensor):
            if isinstance(leaf, torch.Tensor) or signature_of([leaf]) != signature_of([static]):
                return None
            continue
        alike = (
            leaf.dim() > 0
            and static.dim() == leaf.dim()
            and leaf.shape[1:] == static.shape[1:]
            and (leaf.dtype, leaf.device, leaf.requires_grad)
            == (static.dtype, static.device, static.requires_grad)
        )
        # a batch as large as the graph's (the common call) fails at its first tensor
        smaller = alike and leaf.shape[0] < static.shape[0]
        if not smaller or batch not in (None, (leaf.shape[0], static.shape[0])):
            return None
        batch = (leaf.shape[0], static.shape[0])
    return batch[1] if batch is not None else None


def padded_batch(
    args: tuple, values: tuple[PadValue, ...], captured: Iterable[Sequence[Any]]
) -> PaddedBatch | None:
    """``args`` padded to the fewest rows among the captured graphs' inputs (``captured``:
    each graph's static inputs, flat) that fit them (:func:`fitting_rows`), or None."""
    leaves, spec = pytree.tree_flatten(args)
    fits = [n for statics in captured if (n := fitting_rows(leaves, statics)) is not None]
    if not fits:
        return None
    to = min(fits)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    fills = values * len(tensors) if len(values) == 1 else values
    if len(fills) != len(tensors):
        raise ValueError(
            f"enable_cuda_graph: pad_batches has {len(values)} fill values, but build takes "
            f"{len(tensors)} tensor inputs: give one per tensor input, in order, or one for all"
        )
    fill = iter(fills)
    padded = [_padded(x, to, next(fill)) if isinstance(x, torch.Tensor) else x for x in leaves]
    return PaddedBatch(tuple(pytree.tree_unflatten(padded, spec)), tensors[0].shape[0], to)


def _padded(x: torch.Tensor, rows: int, value: PadValue) -> torch.Tensor:
    integral = not (x.dtype.is_floating_point or x.dtype.is_complex)
    if integral and not float(value).is_integer():
        raise ValueError(
            f"enable_cuda_graph: pad_batches fills a {x.dtype} input with {value!r}, which it "
            "cannot hold: give an integer fill value for it"
        )
    fill = x.new_full((rows - x.shape[0], *x.shape[1:]), value)
    return torch.cat([x.detach(), fill]).requires_grad_(x.requires_grad)


__all__ = [
    "PaddedBatch",
    "checked_pad_values",
    "fitting_rows",
    "padded_batch",
    "refuse_padding",
]
