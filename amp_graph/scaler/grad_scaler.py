"""``GradScaler`` and ``StaticGradScaler``: the facade over the scaler's three parts.

The facade keeps torch's per-optimizer protocol (``scale`` -> ``unscale_`` -> ``step`` ->
``update``, with torch's errors when it is broken) and hands each piece of work to the part whose
job it is:

* :class:`~amp_graph.scaler.scale_state.ScaleState`: the scale, its trackers and their update;
* :class:`~amp_graph.scaler.grad_check.GradientCheck`: gradients -> ``found_inf``, unscaling,
  agreement across ranks;
* :class:`~amp_graph.scaler.skip_monitor.SkipMonitor`: names, non-finite gradients, the
  consecutive-skip warning.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import warnings
import weakref
from collections import abc
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from amp_graph.ops import scaler_ops as ops
from amp_graph.scaler import errors, fused_sgd_first_step
from amp_graph.scaler.grad_check import CheckResult, GradientCheck, Partition
from amp_graph.scaler.scale_state import ScaleState
from amp_graph.scaler.skip_monitor import NamedParameters, SkipMonitor

__all__ = ["GradScaler", "StaticGradScaler"]


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclasses.dataclass
class _OptimizerState:
    """Per-optimizer progress within one iteration (between two ``update()`` calls)."""

    optimizer: weakref.ref[torch.optim.Optimizer]
    stage: _Stage = _Stage.READY
    check: CheckResult | None = None


def _mark_step_attempted(optimizer: torch.optim.Optimizer) -> None:
    """Record on this optimizer instance that its step ran this iteration (skipped on purpose).

    LR schedulers wrap ``optimizer.step`` to set ``optimizer._opt_called`` and warn
    "Detected call of `lr_scheduler.step()` before `optimizer.step()`" when it is unset at their
    first ``step()``. A skipped step is a step: set the flag the wrapper would have set.
    """
    optimizer._opt_called = True  # type: ignore[attr-defined]


class GradScaler:
    """Dynamic loss scaler with torch's API, defaults and errors, plus hysteresis, clamps,
    diagnosis and sync-free fused stepping.

    Args:
        device: device type or device of the scale (``"cuda"``, ``"cpu"``...). ``None`` (default)
            takes the device of the first tensor given to :meth:`scale`. ``"cuda"`` without CUDA
            warns and disables the scaler, like torch.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as in
            :class:`torch.amp.GradScaler` (same defaults). With ``enabled=False`` every method is
            a pass-through.
        hysteresis: consecutive overflowing iterations tolerated before the scale backs off
            (Megatron-style; ``1``, the default, backs off at every overflow, like torch). Any
            finite iteration restores the allowance.
        min_scale: the scale never backs off below this (default: no floor, like torch).
        max_scale: the scale never grows above this (default: no ceiling, like torch).
        process_group: a group over which ``found_inf`` is MAX-reduced so that its ranks step or
            skip together. Default ``None``: no collective, except that sharded gradients
            (DTensors: FSDP2, tensor parallelism) are always agreed over their mesh. See
            ``docs/scaler.md`` for which parallel setups need it.
        named_parameters: a module, or ``(name, parameter)`` pairs, used to name parameters in
            :meth:`nonfinite_grads` and in the consecutive-skip warning.
        warn_after_skipped_steps: log one warning (naming the non-finite gradients) when this many
            consecutive iterations overflowed; ``None`` never warns.
    """

    # Whether unscale_ accepts float16 gradients (torch's: no; StaticGradScaler(1.0): yes).
    _unscales_fp16 = False

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
        max_scale: float | None = None,
        process_group: dist.ProcessGroup | None = None,
        named_parameters: NamedParameters | None = None,
        warn_after_skipped_steps: int | None = 50,
    ) -> None:
        self._enabled = enabled
        cuda = device is not None and torch.device(device).type == "cuda"
        if cuda and enabled and not torch.cuda.is_available():
            warnings.warn(
                "amp_graph.GradScaler is enabled on 'cuda', but CUDA is not available. Disabling.",
                stacklevel=2,
            )
            self._enabled = False
        self._scale_state = ScaleState(
            init_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            hysteresis,
            min_scale,
            max_scale,
        )
        if self._enabled:
            self._scale_state.validate()
        self._check = GradientCheck(process_group)
        self._skips = SkipMonitor(warn_after_skipped_steps)
        if named_parameters is not None:
            self._skips.register(named_parameters)
        self._optimizer_states: dict[int, _OptimizerState] = {}
        self._last_optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self._last_step_taken: torch.Tensor | None = None

    # ---- scale ---------------------------------------------------------------------------

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Multiply a tensor, or an iterable of tensors (nested lists/tuples kept), by the scale.

        Returns ``outputs`` unchanged when disabled. No host synchronization.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            scale = self._scale_state.lazy_init(outputs.device)
            return outputs * scale.to(device=outputs.device, non_blocking=True)

        per_device: dict[torch.device, torch.Tensor] = {}

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if value.device not in per_device:
                    scale = self._scale_state.lazy_init(value.device)
                    per_device[value.device] = scale.to(value.device, non_blocking=True)
                return value * per_device[value.device]
            if isinstance(value, abc.Iterable):
                mapped = map(apply, value)
                return type(value)(mapped) if isinstance(value, (list, tuple)) else mapped
            raise ValueError(errors.OUTPUTS)

        return apply(outputs)

    # ---- unscale -------------------------------------------------------------------------

    def _optimizer_state(self, optimizer: torch.optim.Optimizer) -> _OptimizerState:
        state = self._optimizer_states.get(id(optimizer))
        if state is None or state.optimizer() is not optimizer:
            state = _OptimizerState(weakref.ref(optimizer))
            self._optimizer_states[id(optimizer)] = state
        return state

    def _begin_unscale(self, optimizer: torch.optim.Optimizer, funcname: str) -> _OptimizerState:
        self._scale_state.tensors(funcname)
        state = self._optimizer_state(optimizer)
        if state.stage is _Stage.UNSCALED:
            raise RuntimeError(errors.UNSCALE_TWICE)
        if state.stage is _Stage.STEPPED:
            raise RuntimeError(errors.UNSCALE_AFTER_STEP)
        return state

    def _unscale(
        self, optimizer: torch.optim.Optimizer, funcname: str, *, allow_fp16: bool, norm: bool
    ) -> tuple[CheckResult, list[Partition]]:
        state = self._begin_unscale(optimizer, funcname)
        scale_state = self._scale_state
        parts = self._check.collect(optimizer, allow_fp16=allow_fp16, norm=norm)
        assert scale_state.scale is not None
        result = self._check.run(
            parts, scale_state.scale.device, scale_state.inv_scale(funcname), norm=norm
        )
        state.check, state.stage = result, _Stage.UNSCALED
        return result, parts

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale and record whether any was inf/nan.

        Optional: :meth:`step` unscales when this was not called. Call at most once per
        optimizer per iteration, after all gradients are accumulated. Float16 gradients are
        refused, as by torch. No host synchronization; collectives only over
        ``process_group`` and the meshes of sharded gradients.
        """
        if not self._enabled:
            return
        self._unscale(optimizer, "unscale_", allow_fp16=self._unscales_fp16, norm=False)

    def unscale_and_clip_grad_norm_(
        self, optimizer: torch.optim.Optimizer, max_norm: float
    ) -> torch.Tensor:
        """Unscale the optimizer's gradients and clip their total 2-norm to ``max_norm``.

        Same result as ``unscale_(optimizer)`` followed by
        ``torch.nn.utils.clip_grad_norm_(params, max_norm)``, but the norm comes out of the
        unscale pass (float32 sum of squares; summed over the shards of sharded gradients), so
        no separate pass reads the gradients for it. Returns the total norm (a device tensor;
        inf/nan after an overflow). If ``unscale_`` was already called this iteration, falls
        back to ``clip_grad_norm_``.
        """
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not self._enabled:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        self._scale_state.tensors("unscale_and_clip_grad_norm_")
        if self._optimizer_state(optimizer).stage is _Stage.UNSCALED:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        result, parts = self._unscale(
            optimizer,
            "unscale_and_clip_grad_norm_",
            allow_fp16=self._unscales_fp16,
            norm=True,
        )
        assert result.sum_of_squares is not None
        total_norm = result.sum_of_squares.sqrt()
        # torch.nn.utils.clip_grad_norm_'s rule: multiply by min(max_norm / (norm + 1e-6), 1).
        clip_coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
        with torch.no_grad():
            for part in parts:
                torch._foreach_mul_(part.grads, clip_coef.to(part.device, non_blocking=True))
        return total_norm

    # ---- step ----------------------------------------------------------------------------

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        *args: Any,
        step_fn: Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Unscale (unless :meth:`unscale_` ran) and run ``optimizer.step(*args, **kwargs)``
        unless a gradient was inf/nan (on this rank, or on a rank it agrees with).
        ``step_fn``: what to call instead of ``optimizer.step`` (same contract, the
        ``grad_scale``/``found_inf`` attributes included), e.g. a
        :class:`~amp_graph.training.fused_step.FusedStep`.

        Returns what ``optimizer.step`` returned, or ``None`` when skipped (torch's contract).
        :attr:`last_step_taken` records the outcome as a device tensor.

        Host synchronization: none when the optimizer takes ``grad_scale``/``found_inf`` itself
        (``_step_supports_amp_scaling``, e.g. ``torch.optim.Adam(..., fused=True)``); there the
        grads are only checked (read, not written) and the optimizer unscales and skips on the
        device. Any other optimizer: exactly one (reading ``found_inf`` to decide whether to
        call ``optimizer.step``). Fused SGD with momentum: on a group's first step, a skip
        leaves the momentum buffers torch allocated zero, which the next step reads as no buffer
        (:mod:`~amp_graph.scaler.fused_sgd_first_step`); with ``dampening`` that step alone
        costs one host read instead.
        """
        run = optimizer.step if step_fn is None else step_fn
        if not self._enabled:
            self._last_step_taken = torch.ones((), dtype=torch.bool)
            return run(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError(errors.CLOSURE)
        self._scale_state.tensors("step")
        state = self._optimizer_state(optimizer)
        if state.stage is _Stage.STEPPED:
            raise RuntimeError(errors.STEP_TWICE)

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._step_fused(optimizer, state, run, *args, **kwargs)

        if state.stage is _Stage.READY:
            self.unscale_(optimizer)
        assert state.check is not None
        if not state.check.decided:
            raise errors.ScalerStateError(
                errors.with_fix(errors.NO_CHECKS_FOR_OPTIMIZER, errors.FIX_NO_CHECKS)
            )
        found_inf = state.check.found_inf
        self._last_step_taken = found_inf == 0
        retval = None
        if found_inf.item() == 0:  # the one host synchronization of this path
            retval = run(*args, **kwargs)
        else:
            _mark_step_attempted(optimizer)
        state.stage = _Stage.STEPPED
        return retval

    def _step_fused(
        self,
        optimizer: torch.optim.Optimizer,
        state: _OptimizerState,
        run: Callable[..., Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            raise NotImplementedError(
                f"{type(optimizer).__name__}.step takes the deprecated `grad_scaler` argument; "
                "amp_graph.GradScaler only supports the grad_scale/found_inf attribute protocol."
            )
        scale, _ = self._scale_state.tensors("step")
        if state.stage is _Stage.READY and scale.device.type == "cpu":
            # On the CPU nothing waits on a host read, and torch's unscale pass over many small
            # tensors is several times faster than the read-only check: unscale, then let the
            # optimizer skip on found_inf alone. Float16 gradients are fine here, as with torch.
            self._unscale(optimizer, "step", allow_fp16=True, norm=False)
        if state.stage is _Stage.READY:
            # Read-only check: the optimizer divides by grad_scale inside its fused kernel.
            parts = self._check.collect(optimizer, allow_fp16=True)
            state.check = self._check.run(parts, scale.device, None)
            grad_scale = scale * getattr(optimizer, "grad_scale", 1)
        else:
            grad_scale = getattr(optimizer, "grad_scale", None)
        assert state.check is not None
        found_inf = state.check.found_inf
        # Fused SGD groups about to allocate momentum buffers, which a skip leaves uninitialized.
        first = fused_sgd_first_step.first_step_groups(optimizer)
        if first and not fused_sgd_first_step.zero_is_exact(first) and found_inf.item() != 0:
            # (that host read: only on such a first step, with dampening)
            _mark_step_attempted(optimizer)
            state.stage = _Stage.STEPPED
            self._last_step_taken = found_inf == 0
            return None
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            retval = run(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        if first:
            fused_sgd_first_step.zero_skipped_buffers(optimizer, first, found_inf)
        state.stage = _Stage.STEPPED
        self._last_step_taken = found_inf == 0
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
        scale, trackers = self._scale_state.tensors("update")
        if new_scale is not None:
            self._scale_state.set_scale(new_scale)
        else:
            found_infs = [
                s.check.found_inf
                for s in self._optimizer_states.values()
                if s.check is not None and s.check.decided
            ]
            if not found_infs:
                raise errors.ScalerStateError(
                    errors.with_fix(
                        errors.NO_CHECKS_BEFORE_UPDATE,
                        "Call scaler.step(optimizer) (or scaler.unscale_(optimizer)) first.",
                    )
                )
            found = found_infs[0] if len(found_infs) == 1 else torch.stack(found_infs).amax()
            self._scale_state.update(found)
            self._skips.poll(scale, trackers, self.nonfinite_grads)
        self._last_optimizers = [s.optimizer for s in self._optimizer_states.values()]
        self._optimizer_states = {}

    # ---- diagnosis -----------------------------------------------------------------------

    def register_parameter_names(self, named_parameters: NamedParameters) -> None:
        """Name parameters for :meth:`nonfinite_grads` (a module or ``(name, param)`` pairs)."""
        self._skips.register(named_parameters)

    def nonfinite_grads(self) -> list[str]:
        """Names of the parameters whose ``.grad`` holds inf or nan right now.

        Looks at the parameters of the optimizers of the current iteration, or of the last one
        after :meth:`update`; call it before ``zero_grad()``. Names come from
        ``named_parameters`` (or :meth:`register_parameter_names`), else
        ``optimizer[k].param_groups[g][i] (shape, dtype)``. Synchronizes once per device.
        """
        refs = [s.optimizer for s in self._optimizer_states.values()] or self._last_optimizers
        return self._skips.nonfinite_grads([o for o in (r() for r in refs) if o is not None])

    @property
    def skipped_steps(self) -> int:
        """Iterations whose ``update()`` saw an overflow (a skipped optimizer step), ever.
        Reading it synchronizes once."""
        return self._tracker(ops.SKIPPED_STEPS)

    @property
    def skipped_steps_counter(self) -> torch.Tensor | int:
        """The count behind :attr:`skipped_steps` as it stands: a device tensor (a copy: no
        host read) or, before the first step (or disabled), the int it starts from."""
        state = self._scale_state
        if not self._enabled or state.trackers is None:
            return int(state.init_trackers[ops.SKIPPED_STEPS]) if self._enabled else 0
        return state.trackers[ops.SKIPPED_STEPS].clone()

    def pre_step_state(self) -> dict[str, torch.Tensor | None]:
        """The device tensors :meth:`state_dict` reads (scale, trackers), copied without a
        host read; None before the first step. :meth:`state_dict_from` turns them back into
        a state dict: the state of the scaler as it was when they were copied."""
        state = self._scale_state
        if not self._enabled or state.scale is None or state.trackers is None:
            return {"scale": None, "trackers": None}
        return {"scale": state.scale.clone(), "trackers": state.trackers.clone()}

    def state_dict_from(self, copied: dict[str, torch.Tensor | None]) -> dict[str, Any]:
        """:meth:`state_dict` with scale and trackers from :meth:`pre_step_state`'s copy."""
        out = self.state_dict()
        if copied["scale"] is None or copied["trackers"] is None or not out:
            return out
        trackers = copied["trackers"].tolist()
        out["scale"] = float(copied["scale"].item())
        out["_growth_tracker"] = int(trackers[ops.GROWTH_TRACKER])
        out["_hysteresis_tracker"] = int(trackers[ops.HYSTERESIS_TRACKER])
        out["_skipped_steps"] = int(trackers[ops.SKIPPED_STEPS])
        out["_consecutive_skips"] = int(trackers[ops.CONSECUTIVE_SKIPS])
        return out

    @property
    def consecutive_skipped_steps(self) -> int:
        """Overflowing iterations in a row up to the last ``update()``. Synchronizes once."""
        return self._tracker(ops.CONSECUTIVE_SKIPS)

    def _tracker(self, slot: int) -> int:
        return self._scale_state.tracker(slot) if self._enabled else 0

    # ---- getters and setters -------------------------------------------------------------

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Synchronizes."""
        return self._scale_state.get_scale() if self._enabled else 1.0

    def get_growth_factor(self) -> float:
        """The growth factor."""
        return self._scale_state.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1, else the constructor's error)."""
        self._set(growth_factor=float(new_factor))

    def get_backoff_factor(self) -> float:
        """The backoff factor."""
        return self._scale_state.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1), else the constructor's error)."""
        self._set(backoff_factor=float(new_factor))

    def get_growth_interval(self) -> int:
        """The growth interval."""
        return self._scale_state.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (>= 1, else the constructor's error)."""
        self._set(growth_interval=int(new_interval))

    def get_hysteresis(self) -> int:
        """Consecutive overflows tolerated before backing off."""
        return self._scale_state.hysteresis

    def set_hysteresis(self, new_hysteresis: int) -> None:
        """Set the hysteresis (>= 1, else the constructor's error); takes effect from the next
        finite iteration."""
        self._set(hysteresis=int(new_hysteresis))

    def _set(self, **values: Any) -> None:
        # checked as the constructor checks them: when enabled (torch checks nothing when not)
        self._scale_state.set_hyperparameters(values, validate=self._enabled)

    def get_min_scale(self) -> float:
        """The floor of backoff (0.0 for none)."""
        return self._scale_state.min_scale

    def get_max_scale(self) -> float:
        """The ceiling of growth (inf for none)."""
        return self._scale_state.max_scale

    def set_process_group(self, process_group: dist.ProcessGroup | None) -> None:
        """Set the group ``found_inf`` is reduced over (``None``: none), e.g. after unpickling."""
        self._check.process_group = process_group
        self._check.process_group_lost = False

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
        return self._scale_state.state_dict() if self._enabled else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` or from ``torch.amp.GradScaler``
        (the entries torch lacks keep this scaler's values). No-op when disabled."""
        if self._enabled:
            self._scale_state.load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle at an iteration boundary only. Parameter names and the host mirror are not
        pickled (re-register names after unpickling); a process group other than the world
        group must be set again (:meth:`set_process_group`)."""
        if self._enabled and self._optimizer_states:
            raise errors.ScalerStateError(errors.PICKLE_MID_ITERATION)
        state = self.__dict__.copy()
        state.update(_last_optimizers=[], _last_step_taken=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class StaticGradScaler(GradScaler):
    """A fixed loss scale that still checks gradients and skips non-finite steps.

    Same API as :class:`GradScaler`; :meth:`update` keeps the scale (and counts skipped steps).
    With a scale of exactly 1 nothing is divided, so float16 gradients are accepted: a pure
    checker. (amp_graph.Graph, where loss scaling does not apply, checks with its own
    :class:`amp_graph.scaler.nonfinite_guard.NonFiniteGuard`.)

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
        self._unscales_fp16 = float(scale) == 1.0

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration (count skips); the scale stays fixed."""
        if new_scale is not None and self._enabled:
            raise ValueError("StaticGradScaler has a fixed scale; use GradScaler to change it.")
        super().update()
