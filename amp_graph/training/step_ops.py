"""The operations a training-step graph calls: one function per node kind.

:mod:`amp_graph.training.step_graph` puts calls to these into the step graph of an
:class:`amp_graph.Graph`, so that each stage of the step (zero the gradients, scale the
loss, unscale and check, clip, step, update the scale, step the schedulers) is one
readable node. They hold no state of their own.

A step with a loss scaler (float16) uses ``unscale``/``unscale_and_clip``,
``optimizer_step`` and ``update_scale``; a step without one (bfloat16, AMP off) uses
``check_finite``/``clip_and_check_finite``, ``step_if_finite`` and ``end_step`` of a
:class:`~amp_graph.scaler.NonFiniteGuard`, which skip inf/nan steps just the same.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from amp_graph.scaler import GradScaler
from amp_graph.scaler.nonfinite_guard import NonFiniteGuard
from amp_graph.training.fused_step import FusedStep
from amp_graph.training.master_weights import MasterWeights


def zero_grad(optimizer: torch.optim.Optimizer) -> None:
    """Drop the optimizer's gradients (``set_to_none``), before the step's first backward."""
    optimizer.zero_grad(set_to_none=True)


def zero_grad_in_place(optimizer: torch.optim.Optimizer) -> None:
    """Zero the optimizer's gradients where they are (a captured step's graph writes them at
    the addresses it was captured with; the first step allocates them)."""
    optimizer.zero_grad(set_to_none=False)


def scale_loss(scaler: GradScaler, loss: torch.Tensor, micro_batches: int) -> torch.Tensor:
    """The loss that ``backward`` sees: averaged over micro-batches, times the loss scale."""
    if micro_batches != 1:
        loss = loss / micro_batches
    return scaler.scale(loss)


def average_loss(loss: torch.Tensor, micro_batches: int) -> torch.Tensor:
    """The loss that ``backward`` sees without loss scaling: averaged over micro-batches."""
    return loss / micro_batches


def backward(loss: torch.Tensor) -> None:
    """The backward pass ``build`` asked for with ``loss.backward()``."""
    loss.backward()


def build_output(leaves: Sequence[Any], output_spec: tuple[Sequence[int], Any]) -> Any:
    """What ``build`` returned, rebuilt from the captured graph's flat outputs:
    ``output_spec`` is (the positions of its leaves, its pytree spec)."""
    positions, spec = output_spec
    return pytree.tree_unflatten([leaves[i] for i in positions], spec)


def cast_weights(
    root: nn.Module, names: Sequence[str], dtypes: Sequence[torch.dtype]
) -> list[torch.Tensor]:
    """Cast each named parameter of ``root`` once for the whole step.

    Every micro-batch reads these copies; each one's backward still flows through the cast
    into the float32 ``.grad``, so gradients accumulate in float32.
    """
    return [operator.attrgetter(n)(root).to(d) for n, d in zip(names, dtypes, strict=True)]


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


def optimizer_step(
    scaler: GradScaler, optimizer: torch.optim.Optimizer, fused_step: FusedStep | None = None
) -> Any:
    """Step unless a gradient was inf/nan (then the weights are left untouched), through
    ``fused_step`` (torch's kernel call without torch.optim's per-call Python) when given."""
    return scaler.step(optimizer, step_fn=fused_step)


def master_to_model(master: MasterWeights) -> None:
    """O2: copy the float32 master weights into the model's low-precision parameters."""
    master.master_to_model()


def check_finite(guard: NonFiniteGuard, optimizer: torch.optim.Optimizer) -> None:
    """Record whether a gradient is inf/nan (no loss scale to undo)."""
    guard.check(optimizer)


def clip_and_check_finite(
    guard: NonFiniteGuard, optimizer: torch.optim.Optimizer, max_norm: float
) -> torch.Tensor:
    """Clip the total 2-norm; a non-finite norm records inf/nan (no separate check pass)."""
    return guard.clip_and_check(optimizer, max_norm)


def step_if_finite(
    guard: NonFiniteGuard, optimizer: torch.optim.Optimizer, fused_step: FusedStep | None = None
) -> Any:
    """Step unless a gradient was inf/nan; on the device with a fused optimizer, through
    ``fused_step`` (torch's kernel call without torch.optim's per-call Python) when given."""
    return guard.step(optimizer, step_fn=fused_step)


def end_step(guard: NonFiniteGuard) -> None:
    """Count a skipped step and reset the inf/nan flag."""
    guard.end_step()


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
