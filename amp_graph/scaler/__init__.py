"""Dynamic loss scaling for float16 training: a drop-in for :class:`torch.amp.GradScaler`.

:class:`GradScaler` has torch's methods, defaults, errors and semantics (``scale``,
``unscale_``, ``step``, ``update``, the getters and setters, ``state_dict``, pickling) and adds:

* hysteresis, ``min_scale`` and ``max_scale`` (off by default, as in torch);
* :attr:`GradScaler.last_step_taken` (a device tensor) and :attr:`GradScaler.skipped_steps`;
* :meth:`GradScaler.nonfinite_grads` and one logged warning after many consecutive skips;
* no host synchronization in ``step()`` with optimizers that take ``grad_scale``/``found_inf``
  (torch's fused Adam, AdamW, SGD), one with any other optimizer;
* sharded gradients (DTensors: FSDP2, tensor parallelism) checked shard by shard and agreed over
  their mesh, and ``found_inf`` agreed over ``process_group`` when one is given (no other
  collective);
* :meth:`GradScaler.unscale_and_clip_grad_norm_`, which gets the norm from the unscale pass;
* :func:`pipeline_loss`: the scaled ``loss_fn`` of a ``torch.distributed.pipelining``
  schedule, with every stage able to unscale and skip together.

Its parts, one job each: :mod:`~amp_graph.scaler.scale_state` (the scale and its update),
:mod:`~amp_graph.scaler.grad_check` and :mod:`~amp_graph.scaler.sharding` (gradients ->
``found_inf``, across ranks), :mod:`~amp_graph.scaler.skip_monitor` (skips and diagnosis),
:mod:`~amp_graph.scaler.errors` (torch's errors), :mod:`~amp_graph.scaler.pipelining` (the
pipeline schedules' loss), :mod:`~amp_graph.scaler.fused_sgd_first_step` (no uninitialized
momentum after a skipped first step of fused SGD); :mod:`~amp_graph.scaler.grad_scaler` is the
facade. :class:`NonFiniteGuard` (:mod:`~amp_graph.scaler.nonfinite_guard`) is the same check
without a scale, for steps that scale no loss (bfloat16, float32). The work on gradients is
done by the ``amp_graph`` custom ops (:mod:`amp_graph.ops`).
See ``docs/scaler.md`` for the full story and every deliberate difference from torch.

Example::

    >>> import torch
    >>> from amp_graph.scaler import GradScaler
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> scaler = GradScaler("cpu", init_scale=1024.0, named_parameters=model)
    >>> loss = model(torch.ones(2, 4)).sum()
    >>> scaler.scale(loss).backward()
    >>> model.bias.grad[0] = float("inf")           # an overflow
    >>> scaler.step(opt) is None, bool(scaler.last_step_taken)
    (True, False)
    >>> scaler.nonfinite_grads()
    ['bias']
    >>> scaler.update(); scaler.get_scale(), scaler.skipped_steps
    (512.0, 1)
"""

from amp_graph.scaler.errors import ScalerArgumentError, ScalerStateError
from amp_graph.scaler.grad_scaler import GradScaler, StaticGradScaler
from amp_graph.scaler.nonfinite_guard import NonFiniteGuard
from amp_graph.scaler.pipelining import PipelineLoss, pipeline_loss

__all__ = [
    "GradScaler",
    "NonFiniteGuard",
    "PipelineLoss",
    "ScalerArgumentError",
    "ScalerStateError",
    "StaticGradScaler",
    "pipeline_loss",
]
