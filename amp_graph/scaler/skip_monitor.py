"""Skip monitoring and diagnosis (one job: tell the user what overflowed, and when it persists).

:class:`SkipMonitor` names parameters, lists those whose gradients are non-finite
(:meth:`SkipMonitor.nonfinite_grads`) and logs one warning per streak of
``warn_after_skipped_steps`` consecutive overflowing iterations, learning the device counters
without waiting for them.
"""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from amp_graph.ops import scaler_ops as ops
from amp_graph.scaler import sharding

logger = logging.getLogger(__name__)

NamedParameters = torch.nn.Module | Iterable[tuple[str, torch.Tensor]]


class SkipMonitor:
    """Names parameters, finds non-finite gradients, warns about long runs of skipped steps.

    Guarantees: :meth:`poll` never waits for the device (on CUDA it reads a host copy only once
    its event has completed, and does nothing while a CUDA graph is being captured).
    """

    def __init__(self, warn_after_skipped_steps: int | None) -> None:
        if warn_after_skipped_steps is not None and warn_after_skipped_steps < 1:
            raise ValueError(
                f"warn_after_skipped_steps must be >= 1 or None, got {warn_after_skipped_steps}"
            )
        self.warn_after = warn_after_skipped_steps
        self._names: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        # Host mirror of [trackers..., scale] (see poll) and the event of its last copy.
        self._status_host: torch.Tensor | None = None
        self._status_event: torch.cuda.Event | None = None
        self._streak_warned = False

    # ---- names ----------------------------------------------------------------------------

    def register(self, named_parameters: NamedParameters) -> None:
        """Name parameters (a module or ``(name, param)`` pairs)."""
        pairs = (
            named_parameters.named_parameters()
            if isinstance(named_parameters, torch.nn.Module)
            else named_parameters
        )
        for name, param in pairs:
            self._names[id(param)] = (weakref.ref(param), name)

    def name_of(self, param: torch.Tensor, where: str) -> str:
        entry = self._names.get(id(param))
        if entry is not None and entry[0]() is param:
            return entry[1]
        return f"{where} (shape {tuple(param.shape)}, {param.dtype})"

    # ---- diagnosis ------------------------------------------------------------------------

    def nonfinite_grads(self, optimizers: list[torch.optim.Optimizer]) -> list[str]:
        """Names of the parameters of ``optimizers`` whose ``.grad`` holds inf or nan now
        (this rank's shard of a sharded gradient). Synchronizes once per device."""
        by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = defaultdict(list)
        for k, optimizer in enumerate(optimizers):
            for g, group in enumerate(optimizer.param_groups):
                for i, param in enumerate(group["params"]):
                    if param.grad is None:
                        continue
                    grad = param.grad._values() if param.grad.is_sparse else param.grad
                    grad = sharding.local_shard(grad).local
                    name = self.name_of(param, f"optimizer[{k}].param_groups[{g}][{i}]")
                    by_device[grad.device].append((name, grad))
        names: list[str] = []
        with torch.no_grad():
            for items in by_device.values():
                bad = torch.stack([~torch.isfinite(grad).all() for _, grad in items]).tolist()
                names.extend(name for (name, _), flag in zip(items, bad, strict=True) if flag)
        return list(dict.fromkeys(names))

    # ---- the consecutive-skip warning ------------------------------------------------------

    def poll(
        self, scale: torch.Tensor, trackers: torch.Tensor, names: Callable[[], list[str]]
    ) -> None:
        """Warn once per streak of ``warn_after`` consecutive overflows (after an update).

        The host learns the counters from a copy into a host mirror: on CUDA the copy is
        non-blocking into pinned memory and is read only once its event has completed (never
        waited on), so the warning may come an iteration late but costs no synchronization. On
        CPU the mirror is filled synchronously (no device to wait for). During CUDA graph
        capture nothing happens (a replayed graph runs no Python, so captured steps cannot
        warn).
        """
        if self.warn_after is None:
            return
        on_cuda = scale.device.type == "cuda"
        if on_cuda and torch.cuda.is_current_stream_capturing():
            return
        if self._status_host is None:
            self._status_host = torch.empty(ops.NUM_TRACKERS + 1, dtype=torch.float64)
            if on_cuda:
                self._status_host = self._status_host.pin_memory()
        if self._status_event is not None:
            if not self._status_event.query():
                return  # the previous copy has not landed yet: look again next update()
            self._status_event = None
            self._on_status(self._status_host.tolist(), names)
        status = torch.cat([trackers.double(), scale.double().reshape(1)])
        self._status_host.copy_(status, non_blocking=on_cuda)
        if on_cuda:
            self._status_event = torch.cuda.Event()
            self._status_event.record()
        else:
            self._on_status(self._status_host.tolist(), names)

    def _on_status(self, status: list[float], names: Callable[[], list[str]]) -> None:
        consecutive = int(status[ops.CONSECUTIVE_SKIPS])
        assert self.warn_after is not None
        if consecutive < self.warn_after:
            self._streak_warned = False
            return
        if self._streak_warned:
            return
        self._streak_warned = True
        found = names()
        logger.warning(
            "GradScaler: %d consecutive iterations had inf/nan gradients and skipped their "
            "optimizer step (scale is now %g). Parameters with non-finite gradients now: %s. "
            "A loss scale that keeps shrinking points at a model that produces inf/nan itself "
            "(not a scaling problem).",
            consecutive,
            status[ops.NUM_TRACKERS],
            ", ".join(found) if found else "none",
        )

    def __getstate__(self) -> dict[str, Any]:
        """Names (weak references) and the host mirror are not pickled: re-register names."""
        state = self.__dict__.copy()
        state.update(_names={}, _status_host=None, _status_event=None)
        return state
