"""``amp_graph.Graph``: OneFlow's ``nn.Graph`` style, the whole training step as one graph.

::

    class TrainGraph(amp_graph.Graph):
        def __init__(self, model, loss_fn, optimizer):
            super().__init__()
            self.model, self.loss_fn = model, loss_fn
            self.add_optimizer(optimizer)
            self.config.enable_amp(True, policy="O1", dtype=torch.float16)
            self.set_grad_scaler(amp_graph.GradScaler())

        def build(self, x, y):
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            return loss

    g = TrainGraph(model, loss_fn, opt)
    loss = g(x, y)   # captured and compiled on the first call; one training step per call
    print(g)         # the step graph: casts, loss scaling, unscale/check, step, update

The first call captures ``build`` with the same front end as :func:`amp_graph.compile`
(``torch.export``, aten ops, under torch.autocast): ``loss.backward()`` is recorded, not run,
so the captured graph is the forward and returns each loss. The AMP passes rewrite it, and a
step graph wraps it whose nodes zero the gradients, run the micro-batches, scale each loss
and run its backward, unscale and check the gradients (the scaler's fused kernel), clip,
step every optimizer (skipped on overflow), update the scale and step the schedulers.
Without loss scaling (bfloat16, fp8, AMP off) a
:class:`~amp_graph.scaler.NonFiniteGuard` checks the gradients instead: no unscale, no
scale to update, the same skips. ``config.enable_compile()`` hands the build graph to
``torch.compile``. A Graph without ``add_optimizer`` is an evaluation graph: no backward,
no scaler, run under ``torch.no_grad()``.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from amp_graph.scaler import GradScaler, NonFiniteGuard
from amp_graph.training import cuda_graph_step as cuda_graphs
from amp_graph.training.graph_config import GraphConfig
from amp_graph.training.optimizer_state import load_optimizer_states, optimizer_states
from amp_graph.training.step_builder import StepBuilder


class Graph:
    """Base class: subclass it, register modules and optimizers, write ``build``.

    The facade users read: registration, ``config``, ``build``, calling, the state. What
    turns ``build`` into step graphs (capture, O2's masters, the step around the build, CUDA
    graph replay) is its :class:`~amp_graph.training.step_builder.StepBuilder`.
    """

    # what captures and replays CUDA graphs (tests on the CPU substitute a stand-in)
    _step_capture: Any = cuda_graphs.CudaGraphCapture

    def __init__(self) -> None:
        object.__setattr__(self, "_modules", OrderedDict())
        self.config = GraphConfig()
        self._optimizers: list[torch.optim.Optimizer] = []
        self._schedulers: list[Any] = []
        self._scaler: GradScaler | None = None
        self._guard = NonFiniteGuard()  # checks gradients when no loss is scaled
        self._builder = StepBuilder(self)
        self._last: fx.GraphModule | None = None
        self._step = 0

    # ---- registration -----------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        registers = isinstance(value, nn.Module) and not name.startswith("_")
        registered = self.__dict__.get("_modules", {})
        changes = (registers or name in registered) and registered.get(name) is not value
        if changes and "_builder" in self.__dict__ and self._builder.started:
            self._refuse_late(
                f"{name} = {type(value).__name__}(...)",
                "the captured build reads the modules registered then, and would go on "
                "running and training those; to load new weights, use "
                f"self.{name}.load_state_dict(...) or the Graph's load_state_dict",
            )
        if registers:
            if "_modules" not in self.__dict__:
                raise RuntimeError("call super().__init__() in your Graph's __init__ first")
            self._modules[name] = value
        elif name in registered:
            del self._modules[name]
        object.__setattr__(self, name, value)

    def add_optimizer(self, optimizer: torch.optim.Optimizer, *, lr_sch: Any = None) -> None:
        """Step ``optimizer`` (and ``lr_sch``, if given) once per call of the graph."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"add_optimizer takes a torch.optim.Optimizer; got {type(optimizer).__name__}"
            )
        if lr_sch is not None and not callable(getattr(lr_sch, "step", None)):
            raise TypeError(f"lr_sch must have a step() method (an LR scheduler); got {lr_sch!r}")
        if lr_sch is not None and _step_needs_arguments(lr_sch):
            raise TypeError(
                f"lr_sch: {type(lr_sch).__name__}.step needs an argument (ReduceLROnPlateau's "
                "metric), and the Graph steps its schedulers with none, after the optimizer "
                "step. Call lr_sch.step(metric) yourself after each call of the Graph, and "
                "register only the optimizer: add_optimizer(optimizer)."
            )
        if "_builder" in self.__dict__ and self._builder.started:  # a training capture or not
            self._refuse_late(
                "add_optimizer",
                "the captured build and its step graph step the optimizers registered then "
                "(and under O2 point them at the float32 masters)",
            )
        self._optimizers.append(optimizer)
        if lr_sch is not None:
            self._schedulers.append(lr_sch)

    def set_grad_scaler(self, scaler: GradScaler) -> None:
        """Scale losses with ``scaler`` (an amp_graph.GradScaler or StaticGradScaler)."""
        if not isinstance(scaler, GradScaler):
            raise TypeError(
                "set_grad_scaler takes an amp_graph.GradScaler or amp_graph.StaticGradScaler "
                f"(its fused check runs inside the step graph); got {type(scaler).__name__}"
            )
        if scaler is not self._scaler and "_builder" in self.__dict__ and self._builder.built:
            self._refuse_late(
                "set_grad_scaler",
                "the step graph checks the gradients with the scaler (or the non-finite "
                "guard) of the first call; to change the scaler's state, use "
                "g.grad_scaler.load_state_dict",
            )
        self._scaler = scaler

    def _refuse_late(self, what: str, why: str) -> None:
        """``what``, called after the first call, would go silently unused: say ``why``."""
        raise RuntimeError(
            f"{type(self).__name__}.{what} after the first call: {why}. Call it in "
            "__init__, before the first call, or make a new Graph."
        )

    def build(self, *args: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} must define build(self, ...): the forward pass, and for a "
            "training graph loss.backward(), returning the loss"
        )

    # ---- what it holds ----------------------------------------------------------------

    @property
    def training(self) -> bool:
        return bool(self._optimizers)

    @property
    def step_graph(self) -> fx.GraphModule | None:
        """The step graph of the last call (None before the first call)."""
        return self._last

    @property
    def build_graph(self) -> fx.GraphModule | None:
        """The captured and rewritten ``build`` (forward and losses, with amp_graph's casts);
        under :meth:`GraphConfig.enable_compile`, the graph handed to torch.compile."""
        if self._last is None:
            return None
        build = self._last.get_submodule("build")
        return getattr(build, "_orig_mod", build)

    @property
    def grad_scaler(self) -> GradScaler | None:
        """The loss scaler the step graph uses (the one set with :meth:`set_grad_scaler`,
        float16). None where no loss is scaled (bfloat16, AMP off): there a
        :class:`~amp_graph.scaler.NonFiniteGuard` still skips every step with inf/nan
        gradients (see :attr:`skipped_steps`); and before the first call."""
        return self._builder.scaler_in_use

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because a gradient was inf/nan (by the scaler or the guard).
        Reading it synchronizes once."""
        scaler = self.grad_scaler
        return self._guard.skipped_steps if scaler is None else scaler.skipped_steps

    @property
    def skipped_steps_counter(self) -> torch.Tensor | int:
        """:attr:`skipped_steps` without a host read: a device copy of the count (an int
        before the first step)."""
        scaler = self.grad_scaler
        return self._guard.skipped_steps_counter if scaler is None else scaler.skipped_steps_counter

    @property
    def registered_modules(self) -> dict[str, nn.Module]:
        """The modules assigned to the graph (``self.model = model``), by name."""
        return dict(self._modules)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers added with :meth:`add_optimizer`, in order."""
        return list(self._optimizers)

    @property
    def lr_schedulers(self) -> list[Any]:
        """The LR schedulers added with :meth:`add_optimizer`, in order."""
        return list(self._schedulers)

    @property
    def steps(self) -> int:
        """Calls made so far (the step counter in state_dict)."""
        return self._step

    # ---- calling ----------------------------------------------------------------------

    def capture(self, *args: Any) -> fx.GraphModule:
        """Capture and rewrite ``build`` for these inputs now, and return the step graph
        (nothing is computed, no step is counted). Calling the graph does this on its own."""
        self._last = self._step_for(args)[0]
        return self._last

    def __call__(self, *args: Any) -> Any:
        replayer = self._initialized()._builder.replayer
        padded = replayer.padded(args) if replayer and self.training else None
        args = args if padded is None else padded.args
        step, leaves = self._step_for(args)
        self._last = step
        monitor = self.config.monitor
        run = step if monitor is None else monitor.graph_for_step(step, owner=self, inputs=args)
        if self._builder.replayer is not None:  # a logging step is a captured graph of its own
            run = self._builder.replay(run, monitor)
        if not self.training:
            with torch.no_grad():
                return run(*leaves)
        out = run(*leaves)
        if self._builder.replayer is not None:  # not in the step graph: a replay runs no Python
            for scheduler in self._schedulers:
                scheduler.step()
        self._step += 1
        if monitor is not None:
            monitor.after_step(self, out)
        return out if padded is None else padded.cut(out)

    def _step_for(self, args: tuple) -> tuple[fx.GraphModule, list]:
        return self._initialized()._builder.step_for(args)

    def _initialized(self) -> Graph:
        if "_builder" not in self.__dict__:
            raise RuntimeError("call super().__init__() in your Graph's __init__")
        return self

    # ---- state ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Modules (float32 masters under O2), optimizers (their state allocated before the
        first step, for DCP to fill: :mod:`~amp_graph.training.optimizer_state`), schedulers,
        scaler, step counter, and the count of steps skipped without a scaler."""
        master = self._builder.master
        scaler = self._scaler if self.grad_scaler is None else self.grad_scaler
        return {
            "modules": {
                name: module.state_dict() if master is None else master.module_state(module)
                for name, module in self._modules.items()
            },
            "optimizers": optimizer_states(self._optimizers),  # fillable in place (DCP)
            "schedulers": [s.state_dict() for s in self._schedulers],
            "scaler": None if scaler is None else scaler.state_dict(),
            "nonfinite_guard": self._guard.state_dict(),
            "step": self._step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; resuming reproduces an uninterrupted run."""
        missing = {"modules", "optimizers", "schedulers", "step"} - set(state)
        if missing:
            raise KeyError(f"not an amp_graph.Graph state_dict: missing {sorted(missing)}")
        if set(state["modules"]) != set(self._modules):
            raise KeyError(
                f"state_dict has modules {sorted(state['modules'])}, the graph "
                f"{sorted(self._modules)}"
            )
        master = self._builder.master
        for name, module in self._modules.items():
            if master is None:
                module.load_state_dict(state["modules"][name])
            else:
                master.load_module_state(module, state["modules"][name])
        load_optimizer_states(self._optimizers, state["optimizers"])
        for scheduler, scheduler_state in zip(self._schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(scheduler_state)
        scaler = self._scaler if self.grad_scaler is None else self.grad_scaler
        if state.get("scaler") is not None and scaler is not None:
            scaler.load_state_dict(state["scaler"])
        if state.get("nonfinite_guard") is not None:
            self._guard.load_state_dict(state["nonfinite_guard"])
        self._step = int(state["step"])
        self._builder.state_loaded()

    def __repr__(self) -> str:
        head = f"{type(self).__name__}({', '.join(self._modules)}; {self.config})"
        if self._last is None:
            return f"{head}\n  (not compiled yet: the first call captures build)"
        parts = [head, "step graph:", self._last.code.strip()]
        if self.training:
            parts += ["build graph:", self.build_graph.code.strip()]
        return "\n".join(parts)


def _step_needs_arguments(scheduler: Any) -> bool:
    """Whether ``scheduler.step()`` cannot be called without arguments."""
    try:
        signature = inspect.signature(scheduler.step)
    except (TypeError, ValueError):  # a builtin without a signature: let the call say
        return False
    return any(
        p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        for p in signature.parameters.values()
    )


__all__ = ["Graph", "GraphConfig"]
