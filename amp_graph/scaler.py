"""Dynamic loss scaling for float16 training: a drop-in for :class:`torch.amp.GradScaler`.

:class:`GradScaler` has torch's methods and semantics (``scale``, ``unscale_``, ``step``,
``update``, the getters and setters, ``state_dict``, pickling) and adds:

* hysteresis, ``min_scale`` and ``max_scale``;
* :attr:`GradScaler.last_step_taken` (a device tensor) and :attr:`GradScaler.skipped_steps`;
* :meth:`GradScaler.nonfinite_grads` and one logged warning after many consecutive skips;
* no host synchronization in ``step()`` with optimizers that take ``grad_scale``/``found_inf``
  (torch's fused Adam, AdamW, SGD), one with any other optimizer;
* ``found_inf`` all-reduced (MAX) over ``process_group`` so every rank skips together;
* :meth:`GradScaler.unscale_and_clip_grad_norm_`, which gets the norm from the unscale pass.

The work on gradients is done by the ``amp_graph`` custom ops (:mod:`amp_graph.kernels`).
See ``docs/scaler.md`` for the full story.

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

from __future__ import annotations

import dataclasses
import enum
import inspect
import logging
import math
import warnings
import weakref
from collections import abc, defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from amp_graph.kernels import ops

logger = logging.getLogger(__name__)

__all__ = ["GradScaler", "StaticGradScaler"]

NamedParameters = torch.nn.Module | Iterable[tuple[str, torch.Tensor]]


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclasses.dataclass
class _OptimizerState:
    """Per-optimizer progress within one iteration (between two ``update()`` calls)."""

    optimizer: weakref.ref[torch.optim.Optimizer]
    stage: _Stage = _Stage.READY
    found_inf: torch.Tensor | None = None  # on the scale's device, all-reduced


def _mark_step_attempted(optimizer: torch.optim.Optimizer) -> None:
    """Record on this optimizer instance that its step ran this iteration (skipped on purpose).

    LR schedulers wrap ``optimizer.step`` to set ``optimizer._opt_called`` and warn
    "Detected call of `lr_scheduler.step()` before `optimizer.step()`" when it is unset at their
    first ``step()``. A skipped step is a step: set the flag the wrapper would have set.
    """
    optimizer._opt_called = True  # type: ignore[attr-defined]


class GradScaler:
    """Dynamic loss scaler with torch's API, hysteresis, clamps and sync-free fused stepping.

    Args:
        device: device type or device of the scale (``"cuda"``, ``"cpu"``...). ``None`` (default)
            takes the device of the first tensor given to :meth:`scale`. ``"cuda"`` without CUDA
            warns and disables the scaler, like torch.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as in
            :class:`torch.amp.GradScaler`. With ``enabled=False`` every method is a pass-through.
        hysteresis: consecutive overflowing iterations tolerated before the scale backs off
            (Megatron-style; ``1`` backs off at every overflow, like torch). Any finite iteration
            restores the allowance.
        min_scale: the scale never backs off below this (default: no floor).
        max_scale: the scale never grows above this (default ``2**24``; ``None``: no ceiling).
        process_group: group over which ``found_inf`` is all-reduced (MAX). Default: the world
            group when ``torch.distributed`` is initialized, else no reduction.
        named_parameters: a module, or ``(name, parameter)`` pairs, used to name parameters in
            :meth:`nonfinite_grads` and in the consecutive-skip warning.
        warn_after_skipped_steps: log one warning (naming the non-finite gradients) when this many
            consecutive iterations overflowed; ``None`` never warns.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = 2.0**24,
        process_group: dist.ProcessGroup | None = None,
        named_parameters: NamedParameters | None = None,
        warn_after_skipped_steps: int | None = 50,
    ) -> None:
        self._enabled = enabled
        self._device: torch.device | None = None
        if device is not None:
            self._device = torch.device(device)
            if self._device.type == "cuda" and enabled and not torch.cuda.is_available():
                warnings.warn(
                    "amp_graph.GradScaler is enabled on 'cuda', but CUDA is not available. "
                    "Disabling.",
                    stacklevel=2,
                )
                self._enabled = False
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._hysteresis = int(hysteresis)
        self._min_scale = 0.0 if min_scale is None else float(min_scale)
        self._max_scale = math.inf if max_scale is None else float(max_scale)
        self._warn_after = warn_after_skipped_steps
        if self._enabled:
            self._validate(init_scale)
        self._process_group = process_group
        # Lazily created on the first scale(): float32 scale and int64 trackers (ops.*_TRACKER).
        self._init_scale = float(init_scale)
        self._init_trackers = [0, self._hysteresis, 0, 0]
        self._scale: torch.Tensor | None = None
        self._trackers: torch.Tensor | None = None
        self._per_optimizer_states: dict[int, _OptimizerState] = {}
        self._last_optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self._last_step_taken: torch.Tensor | None = None
        self._param_names: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        # Host mirror of the trackers and scale for the consecutive-skip warning (see _poll_skips).
        self._status_host: torch.Tensor | None = None
        self._status_event: torch.cuda.Event | None = None
        self._streak_warned = False
        if named_parameters is not None:
            self.register_parameter_names(named_parameters)

    def _validate(self, init_scale: float) -> None:
        checks = [
            (self._growth_factor > 1.0, f"growth_factor must be > 1, got {self._growth_factor}"),
            (
                0.0 < self._backoff_factor < 1.0,
                f"backoff_factor must be in (0, 1), got {self._backoff_factor}",
            ),
            (
                self._growth_interval >= 1,
                f"growth_interval must be >= 1, got {self._growth_interval}",
            ),
            (self._hysteresis >= 1, f"hysteresis must be >= 1, got {self._hysteresis}"),
            (
                0.0 <= self._min_scale <= self._max_scale,
                f"need 0 <= min_scale <= max_scale, got {self._min_scale}, {self._max_scale}",
            ),
            (
                self._min_scale <= init_scale <= self._max_scale and init_scale > 0,
                f"init_scale {init_scale} must be > 0 and within "
                f"[min_scale, max_scale] = [{self._min_scale}, {self._max_scale}]",
            ),
            (
                self._warn_after is None or self._warn_after >= 1,
                f"warn_after_skipped_steps must be >= 1 or None, got {self._warn_after}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    # ---- names ---------------------------------------------------------------------------

    def register_parameter_names(self, named_parameters: NamedParameters) -> None:
        """Name parameters for :meth:`nonfinite_grads` (a module or ``(name, param)`` pairs)."""
        pairs = (
            named_parameters.named_parameters()
            if isinstance(named_parameters, torch.nn.Module)
            else named_parameters
        )
        for name, param in pairs:
            self._param_names[id(param)] = (weakref.ref(param), name)

    def _name_of(self, param: torch.Tensor, where: str) -> str:
        entry = self._param_names.get(id(param))
        if entry is not None and entry[0]() is param:
            return entry[1]
        return f"{where} (shape {tuple(param.shape)}, {param.dtype})"

    # ---- scale ---------------------------------------------------------------------------

    def _lazy_init(self, device: torch.device) -> None:
        # Like torch: the scale lives on the device of the first tensor scaled.
        self._device = device
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=self._device)
        self._trackers = torch.tensor(self._init_trackers, dtype=torch.int64, device=self._device)

    def _require_initialized(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scale is None or self._trackers is None:
            raise RuntimeError(
                f"GradScaler.{funcname}() was called before any scaler.scale(loss): the scale is "
                "created by the first scale() call of the iteration."
            )
        return self._scale, self._trackers

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Multiply a tensor, or an iterable of tensors (nested lists/tuples kept), by the scale.

        Returns ``outputs`` unchanged when disabled. No host synchronization.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init(outputs.device)
            assert self._scale is not None
            return outputs * self._scale.to(device=outputs.device, non_blocking=True)

        per_device: dict[torch.device, torch.Tensor] = {}

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if self._scale is None:
                    self._lazy_init(value.device)
                assert self._scale is not None
                if value.device not in per_device:
                    per_device[value.device] = self._scale.to(value.device, non_blocking=True)
                return value * per_device[value.device]
            if isinstance(value, abc.Iterable):
                mapped = map(apply, value)
                return type(value)(mapped) if isinstance(value, (list, tuple)) else mapped
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    # ---- check / unscale -----------------------------------------------------------------

    def _state(self, optimizer: torch.optim.Optimizer) -> _OptimizerState:
        state = self._per_optimizer_states.get(id(optimizer))
        if state is None or state.optimizer() is not optimizer:
            state = _OptimizerState(weakref.ref(optimizer))
            self._per_optimizer_states[id(optimizer)] = state
        return state

    def _grads_by_device(
        self, optimizer: torch.optim.Optimizer
    ) -> dict[torch.device, list[torch.Tensor]]:
        grads: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                if grad.is_sparse:
                    # Duplicate indices of a float16 grad may overflow when summed: check the
                    # coalesced values, as torch does.
                    if grad.dtype is torch.float16:
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                grads[grad.device].append(grad)
        return grads

    def _check_grads(
        self,
        grads: dict[torch.device, list[torch.Tensor]],
        inv_scale: torch.Tensor | None,
        norm: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the fused op over ``grads`` (from :meth:`_grads_by_device`), per device: check
        only when ``inv_scale`` is None, else check and unscale (and sum squares when ``norm``).
        Returns ``found_inf`` on the scale's device, all-reduced, and the sum of squares."""
        scale, _ = self._require_initialized("unscale_")
        found_parts: list[torch.Tensor] = []
        norm_parts: list[torch.Tensor] = []
        with torch.no_grad():
            for device, device_grads in grads.items():
                found = torch.zeros((), dtype=torch.float32, device=device)
                if inv_scale is None:
                    ops.non_finite_check_(device_grads, found)
                else:
                    inv = inv_scale.to(device, non_blocking=True)
                    if norm:
                        sum_sq = ops.non_finite_check_unscale_and_norm_(device_grads, found, inv)
                        norm_parts.append(sum_sq.to(scale.device, non_blocking=True))
                    else:
                        ops.non_finite_check_and_unscale_(device_grads, found, inv)
                found_parts.append(found.to(scale.device, non_blocking=True))
        found_inf = _sum(found_parts) if found_parts else _zero(scale.device)
        self._all_reduce(found_inf)
        sum_of_squares = None
        if norm:
            sum_of_squares = _sum(norm_parts) if norm_parts else _zero(scale.device)
        return found_inf, sum_of_squares

    def _all_reduce(self, found_inf: torch.Tensor) -> None:
        """MAX-reduce ``found_inf`` over the process group, so that all ranks skip together."""
        if dist.is_available() and dist.is_initialized():
            group = self._process_group if self._process_group is not None else dist.group.WORLD
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)

    def _begin_unscale(self, optimizer: torch.optim.Optimizer) -> _OptimizerState:
        self._require_initialized("unscale_")
        state = self._state(optimizer)
        if state.stage is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state.stage is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        return state

    def _inv_scale(self) -> torch.Tensor:
        scale, _ = self._require_initialized("unscale_")
        # Reciprocal in float64 like torch (float32 division can be imprecise).
        return scale.double().reciprocal().float()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale and record whether any was inf/nan.

        Optional: :meth:`step` unscales when this was not called. Call at most once per
        optimizer per iteration, after all gradients are accumulated. No host synchronization
        (one all-reduce of a scalar when distributed).
        """
        if not self._enabled:
            return
        state = self._begin_unscale(optimizer)
        grads = self._grads_by_device(optimizer)
        state.found_inf, _ = self._check_grads(grads, self._inv_scale())
        state.stage = _Stage.UNSCALED

    def unscale_and_clip_grad_norm_(
        self, optimizer: torch.optim.Optimizer, max_norm: float
    ) -> torch.Tensor:
        """Unscale the optimizer's gradients and clip their total 2-norm to ``max_norm``.

        Same result as ``unscale_(optimizer)`` followed by
        ``torch.nn.utils.clip_grad_norm_(params, max_norm)``, but the norm comes out of the
        unscale pass (sum of squares in float32), so no separate pass reads the gradients for it.
        Returns the total norm (a device tensor; inf/nan after an overflow). If ``unscale_`` was
        already called this iteration, falls back to ``clip_grad_norm_``.
        """
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not self._enabled:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        self._require_initialized("unscale_and_clip_grad_norm_")
        if self._state(optimizer).stage is _Stage.UNSCALED:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        state = self._begin_unscale(optimizer)
        grads = self._grads_by_device(optimizer)
        state.found_inf, sum_of_squares = self._check_grads(grads, self._inv_scale(), norm=True)
        state.stage = _Stage.UNSCALED
        assert sum_of_squares is not None
        total_norm = sum_of_squares.sqrt()
        # torch.nn.utils.clip_grad_norm_'s rule: multiply by min(max_norm / (norm + 1e-6), 1).
        clip_coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
        with torch.no_grad():
            for device, device_grads in grads.items():
                torch._foreach_mul_(device_grads, clip_coef.to(device, non_blocking=True))
        return total_norm

    # ---- step ----------------------------------------------------------------------------

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` ran) and run ``optimizer.step(*args, **kwargs)``
        unless a gradient was inf/nan on any rank.

        Returns what ``optimizer.step`` returned, or ``None`` when skipped (torch's contract).
        :attr:`last_step_taken` records the outcome as a device tensor.

        Host synchronization: none when the optimizer takes ``grad_scale``/``found_inf`` itself
        (``_step_supports_amp_scaling``, e.g. ``torch.optim.Adam(..., fused=True)``); there the
        grads are only checked (read, not written) and the optimizer unscales and skips on the
        device. Any other optimizer: exactly one (reading ``found_inf`` to decide whether to
        call ``optimizer.step``).
        """
        if not self._enabled:
            self._last_step_taken = torch.ones((), dtype=torch.bool)
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._require_initialized("step")
        state = self._state(optimizer)
        if state.stage is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._step_fused(optimizer, state, *args, **kwargs)

        if state.stage is _Stage.READY:
            self.unscale_(optimizer)
        assert state.found_inf is not None
        self._last_step_taken = state.found_inf == 0
        retval = None
        if state.found_inf.item() == 0:  # the one host synchronization of this path
            retval = optimizer.step(*args, **kwargs)
        else:
            _mark_step_attempted(optimizer)
        state.stage = _Stage.STEPPED
        return retval

    def _step_fused(
        self, optimizer: torch.optim.Optimizer, state: _OptimizerState, *args: Any, **kwargs: Any
    ) -> Any:
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            raise NotImplementedError(
                f"{type(optimizer).__name__}.step takes the deprecated `grad_scaler` argument; "
                "amp_graph.GradScaler only supports the grad_scale/found_inf attribute protocol."
            )
        scale, _ = self._require_initialized("step")
        if state.stage is _Stage.READY and scale.device.type == "cpu":
            # On the CPU nothing waits on a host read, and torch's unscale pass over many small
            # tensors is several times faster than the read-only check: unscale, then let the
            # optimizer skip on found_inf alone.
            self.unscale_(optimizer)
        if state.stage is _Stage.READY:
            # Read-only check: the optimizer divides by grad_scale inside its fused kernel.
            state.found_inf, _ = self._check_grads(self._grads_by_device(optimizer), None)
            grad_scale = scale * getattr(optimizer, "grad_scale", 1)
        else:
            grad_scale = getattr(optimizer, "grad_scale", None)
        assert state.found_inf is not None
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = state.found_inf  # type: ignore[attr-defined]
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        state.stage = _Stage.STEPPED
        self._last_step_taken = state.found_inf == 0
        return retval

    @property
    def last_step_taken(self) -> torch.Tensor | None:
        """Whether the last :meth:`step` stepped: a 0-dim bool tensor on the scale's device
        (reading it with ``bool()`` synchronizes), ``None`` before the first step."""
        return self._last_step_taken

    # ---- update --------------------------------------------------------------------------

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale from this iteration's overflows (or set it to ``new_scale``).

        Call once per iteration after every ``step``. Overflow in any optimizer: the hysteresis
        allowance drops and, when spent, the scale backs off (not below ``min_scale``); else after
        ``growth_interval`` finite iterations it grows (not above ``max_scale``). Runs on the
        device (``amp_graph::update_scale_``); no host synchronization.
        """
        if not self._enabled:
            return
        scale, trackers = self._require_initialized("update")
        if new_scale is not None:
            if isinstance(new_scale, (int, float)):
                scale.fill_(float(new_scale))
            else:
                if new_scale.numel() != 1 or new_scale.requires_grad:
                    raise ValueError(
                        "new_scale must be a float or a one-element tensor without grad."
                    )
                scale.copy_(new_scale.reshape(()))
        else:
            found_infs = [
                s.found_inf for s in self._per_optimizer_states.values() if s.found_inf is not None
            ]
            if not found_infs:
                raise RuntimeError(
                    "No inf checks were recorded prior to update(): call scaler.step(optimizer) "
                    "(or scaler.unscale_(optimizer)) first."
                )
            found = _sum(found_infs)
            ops.update_scale_(
                scale,
                trackers,
                found,
                self._growth_factor,
                self._backoff_factor,
                self._growth_interval,
                self._hysteresis,
                self._min_scale,
                self._max_scale,
            )
            self._poll_skips()
        self._last_optimizers = [s.optimizer for s in self._per_optimizer_states.values()]
        self._per_optimizer_states = {}

    def _poll_skips(self) -> None:
        """Warn once per streak of ``warn_after_skipped_steps`` consecutive overflows.

        The host learns the device counters from a copy into a host mirror: on CUDA the copy is
        non-blocking into pinned memory and is read only once its event has completed (never
        waited on), so the warning may come an iteration late but costs no synchronization. On
        CPU the mirror is filled synchronously (no device to wait for).
        """
        if self._warn_after is None:
            return
        scale, trackers = self._require_initialized("update")
        on_cuda = scale.device.type == "cuda"
        if self._status_host is None:
            self._status_host = torch.empty(ops.NUM_TRACKERS + 1, dtype=torch.float64)
            if on_cuda:
                self._status_host = self._status_host.pin_memory()
        if self._status_event is not None:
            if not self._status_event.query():
                return  # the previous copy has not landed yet: look again next update()
            self._status_event = None
            self._on_status(self._status_host.tolist())
        status = torch.cat([trackers.double(), scale.double().reshape(1)])
        self._status_host.copy_(status, non_blocking=on_cuda)
        if on_cuda:
            self._status_event = torch.cuda.Event()
            self._status_event.record()
        else:
            self._on_status(self._status_host.tolist())

    def _on_status(self, status: list[float]) -> None:
        consecutive = int(status[ops.CONSECUTIVE_SKIPS])
        assert self._warn_after is not None
        if consecutive < self._warn_after:
            self._streak_warned = False
            return
        if self._streak_warned:
            return
        self._streak_warned = True
        names = self.nonfinite_grads()
        logger.warning(
            "GradScaler: %d consecutive iterations had inf/nan gradients and skipped their "
            "optimizer step (scale is now %g). Parameters with non-finite gradients now: %s. "
            "A loss scale that keeps shrinking points at a model that produces inf/nan itself "
            "(not a scaling problem).",
            consecutive,
            status[ops.NUM_TRACKERS],
            ", ".join(names) if names else "none",
        )

    # ---- diagnosis -----------------------------------------------------------------------

    def nonfinite_grads(self) -> list[str]:
        """Names of the parameters whose ``.grad`` holds inf or nan right now.

        Looks at the parameters of the optimizers of the current iteration, or of the last one
        after :meth:`update`; call it before ``zero_grad()``. Names come from
        ``named_parameters`` (or :meth:`register_parameter_names`), else
        ``optimizer[k].param_groups[g][i] (shape, dtype)``. Synchronizes once per device.
        """
        refs = [s.optimizer for s in self._per_optimizer_states.values()] or self._last_optimizers
        entries: list[tuple[str, torch.Tensor]] = []
        for k, ref in enumerate(refs):
            optimizer = ref()
            if optimizer is None:
                continue
            for g, group in enumerate(optimizer.param_groups):
                for i, param in enumerate(group["params"]):
                    if param.grad is None:
                        continue
                    grad = param.grad._values() if param.grad.is_sparse else param.grad
                    name = self._name_of(param, f"optimizer[{k}].param_groups[{g}][{i}]")
                    entries.append((name, grad))
        names: list[str] = []
        by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = defaultdict(list)
        for name, grad in entries:
            by_device[grad.device].append((name, grad))
        with torch.no_grad():
            for items in by_device.values():
                bad = torch.stack([~torch.isfinite(grad).all() for _, grad in items]).tolist()
                names.extend(name for (name, _), flag in zip(items, bad, strict=True) if flag)
        return list(dict.fromkeys(names))

    @property
    def skipped_steps(self) -> int:
        """Iterations whose ``update()`` saw an overflow (a skipped optimizer step), ever.
        Reading it synchronizes once."""
        return self._tracker(ops.SKIPPED_STEPS)

    @property
    def consecutive_skipped_steps(self) -> int:
        """Overflowing iterations in a row up to the last ``update()``. Synchronizes once."""
        return self._tracker(ops.CONSECUTIVE_SKIPS)

    def _tracker(self, slot: int) -> int:
        if not self._enabled:
            return 0
        if self._trackers is None:
            return int(self._init_trackers[slot])
        return int(self._trackers[slot].item())

    # ---- getters and setters -------------------------------------------------------------

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Synchronizes."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def get_growth_factor(self) -> float:
        """The growth factor."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor."""
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        """The backoff factor."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor."""
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        """The growth interval."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval."""
        self._growth_interval = int(new_interval)

    def get_hysteresis(self) -> int:
        """Consecutive overflows tolerated before backing off."""
        return self._hysteresis

    def set_hysteresis(self, new_hysteresis: int) -> None:
        """Set the hysteresis; takes effect from the next finite iteration."""
        if new_hysteresis < 1:
            raise ValueError(f"hysteresis must be >= 1, got {new_hysteresis}")
        self._hysteresis = int(new_hysteresis)

    def get_min_scale(self) -> float:
        """The floor of backoff (0.0 for none)."""
        return self._min_scale

    def get_max_scale(self) -> float:
        """The ceiling of growth (inf for none)."""
        return self._max_scale

    def _get_growth_tracker(self) -> int:
        return self._tracker(ops.GROWTH_TRACKER)

    def is_enabled(self) -> bool:
        """Whether this scaler scales at all."""
        return self._enabled

    # ---- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's five entries (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) plus ``hysteresis``, ``_hysteresis_tracker``,
        ``min_scale``, ``max_scale``, ``_skipped_steps``, ``_consecutive_skips``. Empty when
        disabled. Call after :meth:`update`. Synchronizes once."""
        if not self._enabled:
            return {}
        trackers = self._init_trackers if self._trackers is None else self._trackers.tolist()
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": int(trackers[ops.GROWTH_TRACKER]),
            "hysteresis": self._hysteresis,
            "_hysteresis_tracker": int(trackers[ops.HYSTERESIS_TRACKER]),
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "_skipped_steps": int(trackers[ops.SKIPPED_STEPS]),
            "_consecutive_skips": int(trackers[ops.CONSECUTIVE_SKIPS]),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` or from ``torch.amp.GradScaler``
        (the entries torch lacks keep this scaler's values). No-op when disabled."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler."
            )
        self._init_scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._hysteresis = int(state_dict.get("hysteresis", self._hysteresis))
        self._min_scale = float(state_dict.get("min_scale", self._min_scale))
        self._max_scale = float(state_dict.get("max_scale", self._max_scale))
        self._init_trackers = [
            int(state_dict["_growth_tracker"]),
            int(state_dict.get("_hysteresis_tracker", self._hysteresis)),
            int(state_dict.get("_skipped_steps", 0)),
            int(state_dict.get("_consecutive_skips", 0)),
        ]
        if self._scale is not None and self._trackers is not None:
            self._scale.fill_(self._init_scale)
            self._trackers.copy_(torch.tensor(self._init_trackers, dtype=torch.int64))

    def __getstate__(self) -> dict[str, Any]:
        """Pickle at an iteration boundary only. The process group, parameter names and the
        host mirror are not pickled (re-register names after unpickling)."""
        state = self.__dict__.copy()
        if self._enabled:
            if self._per_optimizer_states:
                raise RuntimeError(
                    "A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update()."
                )
            sd = self.state_dict()
            state["_init_scale"] = sd["scale"]
            state["_init_trackers"] = [
                sd["_growth_tracker"],
                sd["_hysteresis_tracker"],
                sd["_skipped_steps"],
                sd["_consecutive_skips"],
            ]
        state.update(
            _scale=None,
            _trackers=None,
            _process_group=None,
            _param_names={},
            _last_optimizers=[],
            _last_step_taken=None,
            _status_host=None,
            _status_event=None,
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class StaticGradScaler(GradScaler):
    """A fixed loss scale that still checks gradients and skips non-finite steps.

    Same API as :class:`GradScaler`; :meth:`update` keeps the scale (and counts skipped steps).

    Example::

        >>> scaler = StaticGradScaler(128.0)
        >>> scaler.get_scale()
        128.0
    """

    def __init__(
        self,
        scale: float,
        *,
        device: str | torch.device | None = None,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
        named_parameters: NamedParameters | None = None,
        warn_after_skipped_steps: int | None = 50,
    ) -> None:
        super().__init__(
            device,
            init_scale=scale,
            enabled=enabled,
            min_scale=scale,
            max_scale=scale,
            process_group=process_group,
            named_parameters=named_parameters,
            warn_after_skipped_steps=warn_after_skipped_steps,
        )

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration (count skips); the scale stays fixed."""
        if new_scale is not None and self._enabled:
            raise ValueError("StaticGradScaler has a fixed scale; use GradScaler to change it.")
        super().update()


def _zero(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float32, device=device)


def _sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.stack(tensors).sum()
