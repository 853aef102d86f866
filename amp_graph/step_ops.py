"""The operations a training-step graph calls: one function per node kind.

``passes.training`` inserts calls to these into the step graph of an
:class:`amp_graph.Graph`, so that each stage of the step (zero the gradients, scale the
loss, unscale and check, clip, step, update the scale, step the schedulers) is one
readable node. They hold no state of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from amp_graph.master_weights import MasterWeights
from amp_graph.scaler import GradScaler


def zero_grad(optimizer: torch.optim.Optimizer) -> None:
    """Drop the optimizer's gradients (``set_to_none``), before the step's first backward."""
    optimizer.zero_grad(set_to_none=True)


def scale_loss(scaler: GradScaler, loss: torch.Tensor, micro_batches: int) -> torch.Tensor:
    """The loss that ``backward`` sees: averaged over micro-batches, times the loss scale."""
    if micro_batches != 1:
        loss = loss / micro_batches
    return scaler.scale(loss)


def master_grads(master: MasterWeights) -> None:
    """O2: move the low-precision gradients onto the float32 master weights."""
    master.grads_to_master()


def unscale(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """Divide the gradients by the scale and record inf/nan (the fused kernel)."""
    scaler.unscale_(optimizer)


def unscale_and_clip(
    scaler: GradScaler, optimizer: torch.optim.Optimizer, max_norm: float
) -> torch.Tensor:
    """Unscale, check and clip the total 2-norm in one pass over the gradients."""
    return scaler.unscale_and_clip_grad_norm_(optimizer, max_norm)


def optimizer_step(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> Any:
    """Step unless a gradient was inf/nan (then the weights are left untouched)."""
    return scaler.step(optimizer)


def master_to_model(master: MasterWeights) -> None:
    """O2: copy the float32 master weights into the model's low-precision parameters."""
    master.master_to_model()


def update_scale(scaler: GradScaler) -> None:
    """Grow or back off the loss scale from this step's overflows."""
    scaler.update()


def scheduler_step(scheduler: Any) -> None:
    """Advance a learning-rate scheduler by one step."""
    scheduler.step()


def mean_of(values: Sequence[Any]) -> Any:
    """The mean of the micro-batches' returns (losses), element-wise for tuples."""
    first = values[0]
    if isinstance(first, (tuple, list)):
        return type(first)(mean_of([v[i] for v in values]) for i in range(len(first)))
    return torch.stack([torch.as_tensor(v) for v in values]).mean(0)
