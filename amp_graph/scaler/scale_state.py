"""The loss scale, its trackers and the rule that updates them (one job: the scale).

:class:`ScaleState` owns the float32 ``scale`` tensor and the int64 ``trackers`` tensor
``[growth, hysteresis, skipped, consecutive]`` (slots ``ops.*_TRACKER``), both created on the
device of the first scaled tensor, the hyperparameters of the update rule, and their
``state_dict``. The update itself is one ``amp_graph::update_scale_`` call on the device: no host
synchronization.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from amp_graph.ops import scaler_ops as ops
from amp_graph.scaler import errors


class ScaleState:
    """Scale, trackers and update rule of a dynamic loss scaler.

    Guarantees: ``scale`` stays within ``[min_scale, max_scale]`` and finite; ``update`` never
    synchronizes; ``state_dict`` / ``load_state_dict`` / pickling round-trip every value
    (hysteresis allowance and skip counters included).
    """

    # Where the loss is scaled on another rank (a later pipeline stage): the device on which
    # any method creates the tensors at its first use, not only scale(). A class default, so
    # that scalers pickled before it existed load.
    first_use_device: torch.device | None = None

    def __init__(
        self,
        init_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
        min_scale: float | None,
        max_scale: float | None,
    ) -> None:
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.min_scale = 0.0 if min_scale is None else float(min_scale)
        self.max_scale = math.inf if max_scale is None else float(max_scale)
        # Host values until the first scale(): then the tensors below take over.
        self.init_scale = float(init_scale)
        self.init_trackers = [0, self.hysteresis, 0, 0]
        self.scale: torch.Tensor | None = None
        self.trackers: torch.Tensor | None = None

    def validate(self) -> None:
        """Raise for hyperparameters torch refuses (its errors) or that cannot work (ValueError)."""
        if not self.growth_factor > 1.0:
            raise errors.ScalerArgumentError(
                f"{errors.GROWTH_FACTOR} Got growth_factor={self.growth_factor}."
            )
        if not self.backoff_factor < 1.0:
            raise errors.ScalerArgumentError(
                f"{errors.BACKOFF_FACTOR} Got backoff_factor={self.backoff_factor}."
            )
        checks = [
            (self.backoff_factor > 0.0, f"backoff_factor must be > 0, got {self.backoff_factor}"),
            (
                self.growth_interval >= 1,
                f"growth_interval must be >= 1, got {self.growth_interval}",
            ),
            (self.hysteresis >= 1, f"hysteresis must be >= 1, got {self.hysteresis}"),
            (
                0.0 <= self.min_scale <= self.max_scale,
                f"need 0 <= min_scale <= max_scale, got {self.min_scale}, {self.max_scale}",
            ),
            (
                self.min_scale <= self.init_scale <= self.max_scale
                and 0 < self.init_scale < math.inf,
                f"init_scale {self.init_scale} must be finite, > 0 and within "
                f"[min_scale, max_scale] = [{self.min_scale}, {self.max_scale}]",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def set_hyperparameters(self, values: dict[str, Any], *, validate: bool) -> None:
        """Set attributes of the update rule (``{"growth_factor": 3.0}``), all or none: with
        ``validate``, a value :meth:`validate` refuses raises its error and nothing changes."""
        old = {name: getattr(self, name) for name in values}
        vars(self).update(values)
        if not validate:
            return
        try:
            self.validate()
        except ValueError:
            vars(self).update(old)
            raise

    # ---- the tensors ---------------------------------------------------------------------

    def lazy_init(self, device: torch.device) -> torch.Tensor:
        """The scale tensor, created on ``device`` at the first call (torch's rule)."""
        if self.scale is None:
            self.scale = torch.full((), self.init_scale, dtype=torch.float32, device=device)
            self.trackers = torch.tensor(self.init_trackers, dtype=torch.int64, device=device)
        return self.scale

    def create_on_first_use(self, device: torch.device) -> None:
        """Let every method create the tensors on ``device``: for a rank whose gradients
        were scaled by another rank's ``scale()`` (an earlier pipeline stage)."""
        self.first_use_device = device

    def tensors(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, trackers)``; torch's error when no ``scale()`` created them yet (unless
        :meth:`create_on_first_use` named their device)."""
        if self.scale is None and self.first_use_device is not None:
            self.lazy_init(self.first_use_device)
        if self.scale is None or self.trackers is None:
            raise errors.ScalerStateError(
                errors.with_fix(
                    errors.NOT_SCALED.format(funcname=funcname),
                    errors.FIX_NOT_SCALED.format(funcname=funcname),
                )
            )
        return self.scale, self.trackers

    def inv_scale(self, funcname: str) -> torch.Tensor:
        """``1 / scale`` as float32, the reciprocal taken in float64 like torch."""
        scale, _ = self.tensors(funcname)
        return scale.double().reciprocal().float()

    # ---- update ----------------------------------------------------------------------------

    def update(self, found_inf: torch.Tensor) -> None:
        """One step of the rule (``found_inf > 0``: overflow) on the device."""
        scale, trackers = self.tensors("update")
        ops.update_scale_(
            scale,
            trackers,
            found_inf,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
            self.hysteresis,
            self.min_scale,
            self.max_scale,
        )

    def set_scale(self, new_scale: float | torch.Tensor) -> None:
        """``update(new_scale)``: torch's checks and messages for a tensor ``new_scale``."""
        scale, _ = self.tensors("update")
        if isinstance(new_scale, (int, float)):
            scale.fill_(float(new_scale))
            return
        if (
            new_scale.device.type != scale.device.type
            or new_scale.numel() != 1
            or new_scale.requires_grad
        ):
            raise errors.ScalerArgumentError(
                f"{errors.NEW_SCALE} Got {new_scale.numel()} element(s) on "
                f"{new_scale.device}, requires_grad={new_scale.requires_grad}; the scale lives "
                f"on {scale.device}."
            )
        scale.copy_(new_scale.reshape(()))

    # ---- reads (each synchronizes once on a device) ----------------------------------------

    def get_scale(self) -> float:
        return self.init_scale if self.scale is None else float(self.scale.item())

    def tracker(self, slot: int) -> int:
        if self.trackers is None:
            return int(self.init_trackers[slot])
        return int(self.trackers[slot].item())

    def host_trackers(self) -> list[int]:
        return list(self.init_trackers) if self.trackers is None else self.trackers.tolist()

    # ---- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        trackers = self.host_trackers()
        return {
            "scale": self.get_scale(),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": int(trackers[ops.GROWTH_TRACKER]),
            "hysteresis": self.hysteresis,
            "_hysteresis_tracker": int(trackers[ops.HYSTERESIS_TRACKER]),
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "_skipped_steps": int(trackers[ops.SKIPPED_STEPS]),
            "_consecutive_skips": int(trackers[ops.CONSECUTIVE_SKIPS]),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ours or torch's. Entries torch's lacks keep their values (the hysteresis
        allowance and the skip counters included). All or nothing: a value the constructor
        refuses raises its error and nothing is loaded. A scale outside ``[min_scale,
        max_scale]`` (torch's, loaded into a scaler with a floor or a ceiling) is clamped into
        it, with a warning: the update rule would never take it there."""
        if len(state_dict) == 0:
            raise RuntimeError(errors.EMPTY_STATE_DICT)
        values = {
            "growth_factor": float(state_dict["growth_factor"]),
            "backoff_factor": float(state_dict["backoff_factor"]),
            "growth_interval": int(state_dict["growth_interval"]),
            "hysteresis": int(state_dict.get("hysteresis", self.hysteresis)),
            "min_scale": float(state_dict.get("min_scale", self.min_scale)),
            "max_scale": float(state_dict.get("max_scale", self.max_scale)),
        }
        loaded = float(state_dict["scale"])
        if not 0 < loaded < math.inf:
            raise ValueError(
                f"load_state_dict: the state dict's scale must be finite and > 0, got {loaded}; "
                "nothing was loaded."
            )
        scale = min(max(loaded, values["min_scale"]), values["max_scale"])
        current = self.host_trackers()
        trackers = [
            int(state_dict["_growth_tracker"]),
            int(state_dict.get("_hysteresis_tracker", current[ops.HYSTERESIS_TRACKER])),
            int(state_dict.get("_skipped_steps", current[ops.SKIPPED_STEPS])),
            int(state_dict.get("_consecutive_skips", current[ops.CONSECUTIVE_SKIPS])),
        ]
        try:
            self.set_hyperparameters({**values, "init_scale": scale}, validate=True)
        except ValueError as error:
            raise type(error)(
                f"load_state_dict: the state dict holds a value the constructor refuses, so "
                f"nothing was loaded: {error}"
            ) from None
        if scale != loaded:
            warnings.warn(
                f"GradScaler.load_state_dict: the loaded scale {loaded} is outside this "
                f"scaler's [min_scale, max_scale] = [{self.min_scale}, {self.max_scale}]; "
                f"using {scale}. Construct the scaler with bounds that hold the saved scale to "
                "keep it.",
                stacklevel=3,
            )
        self.init_trackers = trackers
        if self.scale is not None and self.trackers is not None:
            self.scale.fill_(self.init_scale)
            self.trackers.copy_(torch.tensor(self.init_trackers, dtype=torch.int64))

    def __getstate__(self) -> dict[str, Any]:
        """Pickled as host values; the tensors are re-created by the next ``scale()``."""
        state = self.__dict__.copy()
        state.update(init_scale=self.get_scale(), init_trackers=self.host_trackers())
        state.update(scale=None, trackers=None)
        return state
