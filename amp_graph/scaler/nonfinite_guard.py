"""Keep inf/nan gradients off the weights of a step that scales no loss (bfloat16, float32).

Loss scaling is for float16. A :class:`amp_graph.Graph` computing in bfloat16, or with AMP
off, still skips every step whose gradients are not finite. :class:`NonFiniteGuard` does it
with the scaler's own checker, :class:`~amp_graph.scaler.grad_check.GradientCheck`, read-only
(one gradient checker, one rule for which ranks agree):

* **The check** is one fused call per (device, shard groups) partition of the optimizer's
  gradients (``GradientCheck``: amp_graph's read-only kernel on CUDA, torch's fused check with
  a scale of 1 on the CPU; ``benchmarks/grad_check_bench.py``).
* **Which ranks agree**: the ranks holding the other shards of DTensor gradients (FSDP2,
  tensor parallelism), over their mesh, automatically; and ``process_group`` when one is given.
  Never the world group unasked: ranks that step different numbers of times never block.
* **With clipping there is no separate check pass**: one pass checks and returns the sum of
  squares (summed over shards), and a non-finite total norm also skips the step (gradients
  beyond ~1e19 overflow it).
* **The skip** happens on the device: torch's fused optimizers (``fused=True``: Adam, AdamW,
  SGD, Adagrad) take ``found_inf`` and leave weights and state untouched when it is set, so
  the step never reads the flag on the host. Any other optimizer needs one host read per step
  to decide whether to call ``step()``. So does fused SGD with momentum while it has
  parameters without a momentum buffer (its first step): a skipped step would leave the
  buffers it has just allocated with ``empty_like`` uninitialized, so that step is only run
  when it is known to be finite.

No loss is scaled and no gradient is changed. The counters (:attr:`NonFiniteGuard.skipped_steps`)
live on the device; reading them synchronizes.

Example::

    >>> import torch
    >>> from amp_graph.scaler import NonFiniteGuard
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    >>> guard = NonFiniteGuard()
    >>> model(torch.ones(1, 2)).sum().backward()
    >>> model.bias.grad[0] = float("nan")
    >>> guard.check(opt); guard.step(opt); guard.end_step()
    >>> guard.skipped_steps, bool(guard.last_step_taken)
    (1, False)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from amp_graph.scaler.fused_sgd_first_step import first_step_groups
from amp_graph.scaler.grad_check import GradientCheck

log = logging.getLogger(__name__)

__all__ = ["NonFiniteGuard"]


class NonFiniteGuard:
    """Checks an iteration's gradients and skips the optimizer steps if any is inf/nan.

    One iteration: :meth:`check` (or :meth:`clip_and_check`) for every optimizer, then
    :meth:`step` for every optimizer, then :meth:`end_step`. Every optimizer skips if any of
    them found inf/nan, and so does every rank that agrees with this one (see the module doc).

    Args:
        process_group: a group whose ranks must skip together (pipeline stages, hand-rolled
            sharding, DDP with gradients checked before their all-reduce). ``None`` (default):
            no collective beyond the meshes of DTensor gradients.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self._check = GradientCheck(process_group)
        self._found: list[torch.Tensor] = []  # this iteration's flags, one per check
        self._found_inf: torch.Tensor | None = None  # all of them combined
        self._skipped: torch.Tensor | None = None  # int64 count on the flags' device
        self._initial_skipped = 0
        self._last_found: torch.Tensor | None = None  # the flag the last step() obeyed
        self._warned_host_read: set[int] = set()

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group whose ranks skip together (besides DTensor meshes), or None."""
        return self._check.process_group

    def set_process_group(self, process_group: dist.ProcessGroup | None) -> None:
        """Set the group whose ranks skip together (``None``: none beyond DTensor meshes)."""
        self._check.process_group = process_group
        self._check.process_group_lost = False

    # ---- the iteration ------------------------------------------------------------------

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        """Record whether any of the optimizer's gradients is inf/nan. No synchronization;
        collectives only as the module doc says."""
        parts = self._check.collect(optimizer, allow_fp16=True)
        device = parts[0].device if parts else self._flag_device()
        self._found.append(self._check.run(parts, device, None).found_inf)

    def clip_and_check(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip the total 2-norm of the optimizer's gradients to ``max_norm`` with the rule of
        ``torch.nn.utils.clip_grad_norm_`` (the norm of all shards of sharded gradients), and
        record inf/nan gradients or a non-finite norm. Returns the norm (a device tensor).
        No synchronization."""
        parts = self._check.collect(optimizer, allow_fp16=True, norm=True)
        device = parts[0].device if parts else self._flag_device()
        one = torch.ones((), dtype=torch.float32, device=device)
        result = self._check.run(parts, device, one, norm=True)
        assert result.sum_of_squares is not None
        total_norm = result.sum_of_squares.sqrt()
        clip_coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
        with torch.no_grad():
            for part in parts:
                torch._foreach_mul_(part.grads, clip_coef.to(part.device, non_blocking=True))
            # The norm is the same on every rank that summed it: no new disagreement.
            result.found_inf.masked_fill_(torch.isfinite(total_norm).logical_not(), 1.0)
        self._found.append(result.found_inf)
        return total_norm

    def _flag_device(self) -> torch.device:
        return self._found[0].device if self._found else torch.device("cpu")

    def found_inf(self) -> torch.Tensor:
        """This iteration's flag (1.0: skip), combined over optimizers (and agreeing ranks)."""
        if self._found_inf is None:
            flags = self._found or [torch.zeros((), dtype=torch.float32)]
            found = flags[0]
            if len(flags) > 1:
                found = torch.stack([f.to(found.device, non_blocking=True) for f in flags]).amax()
            self._found_inf = found
        return self._found_inf

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        *args: Any,
        step_fn: Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``optimizer.step()`` unless this iteration found inf/nan; returns its result, or
        None when skipped. No synchronization with an optimizer that takes ``found_inf``,
        once its state exists; one host read otherwise. ``step_fn``: what to call instead of
        ``optimizer.step`` (same contract, ``found_inf`` attribute included), e.g. a
        :class:`~amp_graph.training.fused_step.FusedStep`."""
        found = self.found_inf()
        self._last_found = found  # not compared here: one op fewer per step
        run = optimizer.step if step_fn is None else step_fn
        takes_found_inf = getattr(optimizer, "_step_supports_amp_scaling", False)
        if takes_found_inf and not _allocates_uninitialized_state(optimizer):
            optimizer.found_inf = found  # type: ignore[attr-defined]
            try:
                return run(*args, **kwargs)
            finally:
                del optimizer.found_inf  # type: ignore[attr-defined]
        if not takes_found_inf:
            self._note_host_read(optimizer)
        if found.item() == 0:  # the one host read of this path
            return run(*args, **kwargs)
        optimizer._opt_called = True  # type: ignore[attr-defined]  # a skip is a step (schedulers)
        return None

    def end_step(self) -> None:
        """Count a skipped iteration and clear the flags for the next one."""
        found = self.found_inf()
        if self._skipped is None:
            self._skipped = torch.tensor(self._initial_skipped, device=found.device)
        self._skipped.add_(found.to(self._skipped.device, non_blocking=True).long())
        self._found.clear()
        self._found_inf = None

    def _note_host_read(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self._warned_host_read:
            return
        self._warned_host_read.add(id(optimizer))
        log.info(
            "%s takes no found_inf: each step reads the inf/nan flag on the host (a device "
            "synchronization on GPUs). torch's fused optimizers (fused=True) skip on the device.",
            type(optimizer).__name__,
        )

    # ---- results and state --------------------------------------------------------------

    @property
    def last_step_taken(self) -> torch.Tensor | None:
        """Whether the last :meth:`step` stepped: a 0-dim bool device tensor (None before)."""
        return None if self._last_found is None else self._last_found == 0

    @property
    def skipped_steps_counter(self) -> torch.Tensor | int:
        """The count behind :attr:`skipped_steps` as it stands: the device tensor (a copy:
        no host read) or, before the first step, the int it starts from."""
        return self._initial_skipped if self._skipped is None else self._skipped.clone()

    @property
    def skipped_steps(self) -> int:
        """Iterations skipped for inf/nan gradients, ever. Reading it synchronizes once."""
        if self._skipped is None:
            return self._initial_skipped
        return int(self._skipped.item())

    def state_dict(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._initial_skipped = int(state["skipped_steps"])
        self._skipped = None


def _allocates_uninitialized_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a skipped fused step would leave garbage in the optimizer's state: torch's fused
    SGD with momentum on a group's first step (:mod:`amp_graph.scaler.fused_sgd_first_step`)."""
    return bool(first_step_groups(optimizer))
