"""Loss scaling under ``torch.distributed.pipelining`` (one job: a schedule's ``loss_fn``,
scaled, with every stage ready to unscale what it receives).

torch's schedules (``ScheduleGPipe``, ``Schedule1F1B``, the interleaved ones) call backward
themselves, on what the last stage's ``loss_fn`` returns, so the loss cannot be scaled by the
training loop. :func:`pipeline_loss` wraps ``loss_fn`` so that it returns the scaled loss. The
gradient each earlier stage receives is then scaled too, by the same scale, and every stage
unscales and checks its own parameters' gradients with its own :class:`GradScaler`.

What makes that correct, and what :func:`pipeline_loss` checks:

* Every stage must take the same skip decision, or the stages' parameters stop belonging to
  one model. The scaler's ``process_group`` must hold every rank this stage's gradients must
  agree with: the pipeline group, and the meshes of DTensor parameters (tensor parallelism,
  FSDP2). ``dist.group.WORLD`` always does. Without it, :func:`pipeline_loss` raises.
* The stages' scales stay equal: the same ``init_scale`` and hyperparameters on every stage,
  and the same agreed ``found_inf`` at every ``update()``.
* A stage that never calls ``loss_fn`` (all but the last) never calls ``scale()``, which is
  what creates the scale in torch's scaler. :func:`pipeline_loss` marks the scaler so that its
  scale is created on the stage's device by whichever method uses it first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from amp_graph.ops.dtensors import is_dtensor
from amp_graph.scaler.errors import ScalerArgumentError
from amp_graph.scaler.grad_scaler import GradScaler

LossFn = Callable[..., torch.Tensor]

NO_GROUP = (
    "pipeline_loss: the scaler has no process_group, so a stage whose gradients overflow "
    "would skip its step alone while the other stages step, and the stages would no longer "
    "hold one model. Construct every stage's scaler with "
    "GradScaler(process_group=dist.group.WORLD)."
)


class PipelineLoss:
    """A schedule's ``loss_fn`` returning ``scaler.scale(loss_fn(output, target))``.

    Give it to the schedule on every stage (torch's schedules take ``loss_fn`` on every
    rank; only the last stage calls it). The ``losses`` a schedule fills are scaled:
    :meth:`unscale` turns them back into the losses, also after ``scaler.update()``.
    """

    def __init__(self, scaler: GradScaler, loss_fn: LossFn) -> None:
        self.scaler = scaler
        self.loss_fn = loss_fn
        self._scale_used: torch.Tensor | None = None  # the scale the last call multiplied by

    def __call__(self, output: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        loss = self.loss_fn(output, target, **kwargs)
        scaled = self.scaler.scale(loss)
        if scaled is not loss:
            # a copy: update() changes the scale in place, before the losses are read
            self._scale_used = self.scaler._scale_state.lazy_init(loss.device).clone()
        return scaled

    def unscale(self, losses: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """The losses of the last ``schedule.step``, divided by the scale they were scaled by
        (no host synchronization). A non-finite loss stays non-finite."""
        if self._scale_used is None:
            return [loss.detach() for loss in losses]
        return [loss.detach() / self._scale_used.to(loss.device) for loss in losses]


def pipeline_loss(scaler: GradScaler, loss_fn: LossFn, stage: Any) -> PipelineLoss:
    """``loss_fn`` for a ``torch.distributed.pipelining`` schedule, scaled by ``scaler``.

    Call it on every stage, with that stage's ``PipelineStage`` and its own scaler (each
    constructed with the same arguments), and train each stage as usual::

        scaler = amp_graph.GradScaler(process_group=dist.group.WORLD)
        loss_fn = amp_graph.scaler.pipeline_loss(scaler, F.cross_entropy, stage)
        schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
        for x, y in data:
            optimizer.zero_grad()
            losses = []
            schedule.step(x, target=y, losses=losses)  # each rank passes what it holds
            scaler.step(optimizer)   # unscale + check, agreed with every other stage
            scaler.update()

    Raises :class:`~amp_graph.scaler.ScalerArgumentError` where the scaler's ``process_group``
    misses a rank this stage must agree with (see the module's docstring).
    """
    device = getattr(stage, "device", None)
    if device is None or not hasattr(stage, "submod"):
        raise TypeError(
            "pipeline_loss: stage must be the torch.distributed.pipelining PipelineStage of "
            f"this rank, got {type(stage).__name__}."
        )
    if scaler.is_enabled():
        _check_agreement(scaler, stage)
        scaler._scale_state.create_on_first_use(torch.device(device))
    return PipelineLoss(scaler, loss_fn)


def _check_agreement(scaler: GradScaler, stage: Any) -> None:
    """Raise unless the scaler's group holds the pipeline group and every rank of the meshes
    of this stage's DTensor parameters."""
    group = scaler._check.process_group
    if group is None:
        raise ScalerArgumentError(NO_GROUP)
    needed = set(dist.get_process_group_ranks(stage.group or dist.group.WORLD))
    for param in stage.submod.parameters():
        if is_dtensor(param):
            needed.update(param.device_mesh.mesh.flatten().tolist())
    held = set(dist.get_process_group_ranks(group))
    if not needed <= held:
        raise ScalerArgumentError(
            f"pipeline_loss: the scaler's process_group holds ranks {sorted(held)}, but this "
            f"stage's skip decision must also be agreed with ranks {sorted(needed - held)} "
            "(the other pipeline stages, and the meshes of its DTensor parameters). Pass "
            "GradScaler(process_group=dist.group.WORLD)."
        )
