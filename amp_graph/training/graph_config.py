"""``graph.config``: what a :class:`~amp_graph.training.nn_graph.Graph` is asked to do, as in
OneFlow's ``nn.Graph`` (``config.enable_amp(True)``): AMP, gradient clipping and
accumulation, the agreement on skipped steps, torch.compile, CUDA graphs, a monitor.

Each setter checks its argument where the user calls it. What the capture decides (AMP, its
policy and dtype; torch.compile) is fixed by the first call: setting another value later raises
at the setter. What only the step graph around the capture decides (clipping, accumulation,
the process group) may change at any time: the next call builds the step graphs again around
the same captures (no new capture), and under CUDA graphs captures them again.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

from amp_graph.frontends.compile_modes import check_inductor_mode
from amp_graph.frontends.policy_request import check_request
from amp_graph.monitoring.core import Monitor
from amp_graph.policy import Policy, nearest
from amp_graph.training import cuda_graph_step as cuda_graphs

# What enable_compile passes on: torch.compile's keyword arguments.
COMPILE_OPTIONS = tuple(p for p in inspect.signature(torch.compile).parameters if p != "model")

# setter -> what the first call built from it (said when a later call would change it)
FIXED_BY_CAPTURE = {
    "enable_amp": "AMP, its policy and dtype decide the captured graph's casts (and under O2 "
    "the dtype the model's parameters are stored in)",
    "enable_compile": "torch.compile wraps the captured build, and the capture decided what "
    "backward keeps for it",
}


class GraphConfig:
    """``graph.config``: AMP, gradient clipping and accumulation, compilation, as in OneFlow."""

    def __init__(self) -> None:
        self.revision = 0  # counts changes of the settings (the Graph compares it each call)
        self._fixed: set[str] = set()  # setters whose value the Graph has built on
        self.amp = False
        self.policy: Policy | str = "O1"
        self.dtype: torch.dtype | None = None
        self.clip_max_norm: float | None = None
        self.accumulation_steps = 1
        self.compile = False
        self.compile_options: dict[str, Any] = {}
        self.process_group: dist.ProcessGroup | None = None
        self.monitor: Monitor | None = None
        self.cuda_graph: cuda_graphs.CudaGraphOptions | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        # any change of a setting, through a setter or not, is seen by the next call
        object.__setattr__(self, name, value)
        if not name.startswith("_") and name != "revision":
            object.__setattr__(self, "revision", self.__dict__.get("revision", 0) + 1)

    def fix(self, *setters: str) -> None:
        """The Graph has built on these setters' values (``enable_amp``, ``enable_compile``):
        from now on they refuse another value (:data:`FIXED_BY_CAPTURE` says why)."""
        self._fixed.update(setters)

    def capture_settings(self) -> tuple:
        """What a capture of ``build`` depends on."""
        return (self.amp, self.policy, self.dtype, self.compile, self.cuda_graph is not None)

    def step_settings(self) -> tuple:
        """What the step graph around a capture depends on, beside the capture."""
        return (self.clip_max_norm, self.accumulation_steps, self.process_group)

    def _refuse_late(self, setter: str, current: dict[str, Any], new: dict[str, Any]) -> None:
        """Raise if ``setter`` would change a value the Graph has built on."""
        if setter not in self._fixed or all(current[k] == new[k] for k in new):
            return
        raise RuntimeError(
            f"config.{setter}({_said(new)}) after the first call, which built the step with "
            f"{_said(current)}: {FIXED_BY_CAPTURE[setter]}, so the new value would be silently "
            f"unused. Call config.{setter} in __init__, before the first call, or make a new "
            "Graph for the other setting (under O2 over a fresh model: the first call stored "
            "the model's parameters in low precision)."
        )

    def enable_amp(
        self, mode: bool = True, *, policy: Policy | str = "O1", dtype: torch.dtype | None = None
    ) -> None:
        """Compute per ``policy`` (O1 by default) in ``dtype`` (the device default if None).

        The policy means what it means for :func:`amp_graph.compile`, except that module
        paths start at the Graph (``"model.head"`` for ``self.model = model``): overrides
        that match no module raise ValueError at the first call, naming the nearest path.
        """
        check_request(policy, dtype)  # unknown names and bad dtypes fail here
        current = {"mode": self.amp, "policy": self.policy, "dtype": self.dtype}
        self._refuse_late(
            "enable_amp", current, {"mode": bool(mode), "policy": policy, "dtype": dtype}
        )
        self.amp, self.policy, self.dtype = bool(mode), policy, dtype

    def set_gradient_clipping(self, max_norm: float | None) -> None:
        """Clip the total 2-norm of each optimizer's gradients (after unscaling). May change
        between calls: the next call builds its step graph again (no new capture)."""
        if max_norm is not None and not max_norm > 0:
            raise ValueError(
                f"max_norm must be positive, or None to disable clipping; got {max_norm}"
            )
        self.clip_max_norm = None if max_norm is None else float(max_norm)

    def set_process_group(self, process_group: dist.ProcessGroup | None) -> None:
        """Ranks of ``process_group`` skip an inf/nan step together when no loss is scaled
        (bfloat16, float32; a GradScaler takes its own ``process_group``). ``None`` (default):
        no collective beyond the mesh of DTensor gradients (FSDP2), which is always agreed
        over. Needed where ranks hold different gradients that DTensor does not describe:
        pipeline stages, hand-rolled sharding. May change between calls."""
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                "set_process_group takes a torch.distributed.ProcessGroup (e.g. "
                f"dist.new_group(ranks)) or None; got {type(process_group).__name__}"
            )
        self.process_group = process_group

    def set_gradient_accumulation_steps(self, steps: int) -> None:
        """Split each call's batch into ``steps`` micro-batches; one optimizer step per call.
        May change between calls (the new micro-batch size is captured on its first call)."""
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"gradient accumulation steps is a positive int; got {steps!r}")
        self.accumulation_steps = steps

    def enable_compile(self, enabled: bool = True, /, **options: Any) -> None:
        """Hand the build graph (forward, casts and backward) to ``torch.compile`` (inductor
        unless ``backend=`` says otherwise), as OneFlow's ``nn.Graph`` compiles its graph.

        ``options`` are torch.compile's keyword arguments (``backend``, ``mode``,
        ``dynamic``, ``fullgraph``, ``options``, ...; ``mode`` is one of torch.compile's
        modes, checked here, and ``"reduce-overhead"`` is refused for a model off CUDA, as
        ``amp_graph.compile`` refuses it (:mod:`amp_graph.frontends.compile_modes`);
        ``enable_compile(False)`` turns it off). The step around the build (gradient
        check, optimizer step, master weights) stays eager, as in a hand-written loop.
        Set it before the first call: later, another value raises.
        """
        for name in options:
            if name not in COMPILE_OPTIONS:
                raise TypeError(
                    f"enable_compile got an unknown option {name!r}; torch.compile takes "
                    f"{list(COMPILE_OPTIONS)}.{nearest(name, COMPILE_OPTIONS)}"
                )
        check_inductor_mode(options.get("mode"), "enable_compile")
        current = {"enabled": self.compile, "options": self.compile_options}
        self._refuse_late("enable_compile", current, {"enabled": bool(enabled), "options": options})
        self.compile, self.compile_options = bool(enabled), dict(options)

    def enable_cuda_graph(
        self,
        mode: bool = True,
        *,
        warmup_steps: int = 3,
        max_graphs: int = 8,
        pad_batches: Any = None,
        set_to_none: bool = False,
    ) -> None:
        """Run the whole step (forward, backward, unscale and check, clipping, optimizer
        steps, O2 masters, scale update) as one CUDA graph, replayed each call.

        Per input signature (sizes, dtypes, the values of non-tensor inputs): the first
        ``warmup_steps`` calls run eagerly on a side stream, the next captures the step and
        replays it; later calls copy the batch into the captured inputs and replay. At most
        ``max_graphs`` graphs are held (least recently used dropped), sharing one memory
        pool; each capture logs a line. What a call returns is a copy (kept safely across
        replays). Gradients are zeroed in place (the graphs share them; each step pays a
        zeroing pass and an add per gradient, and holds them beside its activations) unless
        ``set_to_none=True``: then, as in the uncaptured step, they are set to None before
        the backward, each graph writes gradients of its own where its forward's
        activations were, and ``.grad`` is pointed at the gradients of the graph that ran
        last (each graph after the first holds its own: 4 bytes per float32 parameter).
        LR schedulers step on the host after each call, changing a
        tensor learning rate in place. A monitor's logging steps are a graph of their own
        (captured after ``warmup_steps`` logging steps), writing their statistics into one
        buffer that each step copies out on the device.

        ``pad_batches=(0.0, -100)`` (a fill per tensor input): a smaller batch, the last of
        an epoch, is padded up to a captured graph's and replayed (``training.batch_padding``).

        Refused at the first call, with the cause and the way out: a CPU model or CPU
        tensors in the step, an optimizer without ``fused=True``/``capturable=True``, a float
        learning rate that a scheduler drives, a ``build`` reading device values on the host
        (``.item()``, boolean masks), torch.compile modes with CUDA graphs of their own, and
        distributed steps (not captured yet). Set it before the first call.
        """
        self.cuda_graph = (
            cuda_graphs.CudaGraphOptions(warmup_steps, max_graphs, pad_batches, set_to_none)
            if mode
            else None
        )

    def enable_monitor(self, every: int = 100, **options: Any) -> Monitor:
        """Measure the build's chosen nodes every ``every`` steps (one call of the graph is a
        step); ``options`` as :func:`amp_graph.monitor` takes them. Returns the monitor
        (also ``graph.config.monitor``). Under :meth:`enable_compile` a logging step runs the
        instrumented build eagerly; the other steps run the compiled one."""
        self.attach_monitor(Monitor(every, **options))
        assert self.monitor is not None
        return self.monitor

    def attach_monitor(self, monitor: Monitor) -> None:
        """Use ``monitor`` (what :func:`amp_graph.monitor` does for a Graph)."""
        monitor.attach(self, "monitor", "Graph")

    def __repr__(self) -> str:
        amp = f"amp={self.amp}" + (f" ({self.policy}, {self.dtype})" if self.amp else "")
        compiled = f", compile={self.compile_options or True}" if self.compile else ""
        captured = f", cuda_graph={self.cuda_graph}" if self.cuda_graph else ""
        return (
            f"GraphConfig({amp}, clip_max_norm={self.clip_max_norm}, "
            f"accumulation_steps={self.accumulation_steps}{compiled}{captured})"
        )


def _said(values: dict[str, Any]) -> str:
    """``values`` as keyword arguments read: ``mode=True, dtype=torch.bfloat16``."""
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


__all__ = ["COMPILE_OPTIONS", "FIXED_BY_CAPTURE", "GraphConfig"]
