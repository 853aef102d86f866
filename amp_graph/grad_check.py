"""Keep inf/nan gradients off the weights of a step that scales no loss (bfloat16, float32).

Loss scaling is for float16. A :class:`amp_graph.Graph` computing in bfloat16, or with AMP
off, still skips every step whose gradients are not finite; :class:`NonFiniteGuard` does it
with as little work as we could measure (``benchmarks/grad_check_bench.py``, BENCHMARKS.md):

* **The check** is one fused call per device over the optimizer's gradients. On the CPU,
  torch's ``_amp_foreach_non_finite_check_and_unscale_`` with a scale of 1: a single
  vectorized C++ loop, although it writes each value back (``x * 1 == x``, bit for bit).
  Measured against the read-only alternatives it is the fastest on small models and with
  many small gradients (1,000 of them: several times faster than per-tensor ``aminmax``),
  and within noise of ``aminmax`` on larger ones; ``_foreach_norm(inf)`` and
  post-accumulate-grad hooks (a Python call per gradient) are slower everywhere. On CUDA,
  amp_graph's read-only kernel ``amp_graph::non_finite_check_`` (half the bytes; not
  measured on a GPU yet).
* **With clipping there is no check pass**: the total norm that clipping computes anyway is
  inf/nan exactly when a gradient is (or when the norm overflows float32, gradients beyond
  ~1e19, which also skips the step).
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
    >>> from amp_graph.grad_check import NonFiniteGuard
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
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from amp_graph.kernels import ops

log = logging.getLogger(__name__)

__all__ = ["NonFiniteGuard"]


def _grads_by_device(optimizer: torch.optim.Optimizer) -> dict[torch.device, list[torch.Tensor]]:
    grads: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is not None:
                grads[grad.device].append(grad._values() if grad.is_sparse else grad)
    return grads


def check_finite_(grads: list[torch.Tensor], found_inf: torch.Tensor) -> None:
    """Set ``found_inf`` (a float32 scalar on the grads' device) to 1 if a grad is inf/nan.

    The values of ``grads`` are unchanged (on the CPU they are rewritten as themselves).
    """
    if not grads:
        return
    if found_inf.device.type == "cpu":
        one = torch.ones((), dtype=torch.float32)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, one)
    else:
        ops.non_finite_check_(grads, found_inf)


class NonFiniteGuard:
    """Checks an iteration's gradients and skips the optimizer steps if any is inf/nan.

    One iteration: :meth:`check` (or :meth:`clip_and_check`) for every optimizer, then
    :meth:`step` for every optimizer, then :meth:`end_step`. Every optimizer skips if any of
    them found inf/nan (and every rank, when ``torch.distributed`` is initialized).
    """

    def __init__(self) -> None:
        self._flags: dict[torch.device, torch.Tensor] = {}  # this iteration's, per device
        self._found_inf: torch.Tensor | None = None  # all devices (and ranks) combined
        self._skipped: torch.Tensor | None = None  # int64 count on the flags' device
        self._initial_skipped = 0
        self._last_step_taken: torch.Tensor | None = None
        self._warned_host_read: set[int] = set()

    # ---- the iteration ------------------------------------------------------------------

    def _flag(self, device: torch.device) -> torch.Tensor:
        flag = self._flags.get(device)
        if flag is None:
            flag = self._flags[device] = torch.zeros((), dtype=torch.float32, device=device)
        return flag

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        """Record whether any of the optimizer's gradients is inf/nan. No synchronization."""
        with torch.no_grad():
            for device, grads in _grads_by_device(optimizer).items():
                check_finite_(grads, self._flag(device))

    def clip_and_check(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip the total 2-norm of the optimizer's gradients to ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` does, and record a non-finite norm as inf/nan.
        Returns the norm (a device tensor). No synchronization."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        with torch.no_grad():
            flag = self._flag(norm.device)
            flag.masked_fill_(torch.isfinite(norm).logical_not(), 1.0)
        return norm

    def found_inf(self) -> torch.Tensor:
        """This iteration's flag (1.0: skip), combined over devices and ranks."""
        if self._found_inf is None:
            flags = list(self._flags.values())
            if not flags:  # no gradients at all: nothing to apply, nothing non-finite
                flags = [self._flag(torch.device("cpu"))]
            found = flags[0]
            if len(flags) > 1:
                found = torch.stack([f.to(found.device, non_blocking=True) for f in flags]).amax()
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(found, op=dist.ReduceOp.MAX)
            self._found_inf = found
        return self._found_inf

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` unless this iteration found inf/nan; returns its result, or
        None when skipped. No synchronization with an optimizer that takes ``found_inf``,
        once its state exists; one host read otherwise."""
        found = self.found_inf()
        self._last_step_taken = found == 0
        takes_found_inf = getattr(optimizer, "_step_supports_amp_scaling", False)
        if takes_found_inf and not _allocates_uninitialized_state(optimizer):
            optimizer.found_inf = found  # type: ignore[attr-defined]
            try:
                return optimizer.step(*args, **kwargs)
            finally:
                del optimizer.found_inf  # type: ignore[attr-defined]
        if not takes_found_inf:
            self._note_host_read(optimizer)
        if found.item() == 0:  # the one host read of this path
            return optimizer.step(*args, **kwargs)
        optimizer._opt_called = True  # type: ignore[attr-defined]  # a skip is a step (schedulers)
        return None

    def end_step(self) -> None:
        """Count a skipped iteration and clear the flags for the next one."""
        found = self.found_inf()
        if self._skipped is None:
            self._skipped = torch.tensor(self._initial_skipped, device=found.device)
        self._skipped.add_(found.to(self._skipped.device, non_blocking=True).long())
        for flag in self._flags.values():
            flag.zero_()
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
        return self._last_step_taken

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
    """Whether a skipped fused step would leave garbage in the optimizer's state.

    torch's fused SGD allocates missing momentum buffers with ``empty_like`` and fills them
    in its kernel, which a skipped step never runs: the next step would read uninitialized
    memory. (Fused Adam, AdamW and Adagrad initialize their state before the kernel.)
    """
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    state = optimizer.state
    return any(
        group["momentum"] != 0 and p.grad is not None and "momentum_buffer" not in state.get(p, {})
        for group in optimizer.param_groups
        for p in group["params"]
    )
