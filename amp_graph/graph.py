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

The first call traces ``build`` with ``torch.fx`` (``loss.backward()`` included), runs the AMP
passes on it, scales each loss before its backward, and wraps it into a step graph whose
nodes zero the gradients, run the micro-batches, unscale and check the gradients (the
scaler's fused kernel), clip, step every optimizer (skipped on overflow), update the scale
and step the schedulers. A Graph without ``add_optimizer`` is an evaluation graph: no
backward, no scaler, run under ``torch.no_grad()``.
"""

from __future__ import annotations

import inspect
import keyword
import logging
import operator
import warnings
from collections import OrderedDict
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from amp_graph.compiler import (
    COMPILE_META,
    CompileRecord,
    _attach_example_inputs,
    _copy_graph_module,
    check_dtype,
    default_dtype,
    drop_string_annotations,
    model_device_type,
)
from amp_graph.master_weights import MasterWeights
from amp_graph.passes import run_passes
from amp_graph.passes.training import StepPlan, backward_nodes, build_step_graph, scale_losses
from amp_graph.policy import Policy, resolve_policy
from amp_graph.scaler import GradScaler, StaticGradScaler

log = logging.getLogger(__name__)


class GraphConfig:
    """``graph.config``: AMP, gradient clipping and accumulation, as in OneFlow."""

    def __init__(self) -> None:
        self.amp = False
        self.policy: Policy | str = "O1"
        self.dtype: torch.dtype | None = None
        self.clip_max_norm: float | None = None
        self.accumulation_steps = 1

    def enable_amp(
        self, mode: bool = True, *, policy: Policy | str = "O1", dtype: torch.dtype | None = None
    ) -> None:
        """Compute per ``policy`` (O1 by default) in ``dtype`` (the device default if None)."""
        if isinstance(policy, str):
            Policy.preset(policy)  # unknown names fail here, naming the nearest
        elif not isinstance(policy, Policy):
            raise TypeError(f"policy is a preset name or an amp_graph.Policy; got {policy!r}")
        if dtype is not None:
            check_dtype(dtype)
        self.amp, self.policy, self.dtype = bool(mode), policy, dtype

    def set_gradient_clipping(self, max_norm: float | None) -> None:
        """Clip the total 2-norm of each optimizer's gradients (after unscaling)."""
        if max_norm is not None and not max_norm > 0:
            raise ValueError(
                f"max_norm must be positive, or None to disable clipping; got {max_norm}"
            )
        self.clip_max_norm = None if max_norm is None else float(max_norm)

    def set_gradient_accumulation_steps(self, steps: int) -> None:
        """Split each call's batch into ``steps`` micro-batches; one optimizer step per call."""
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"gradient accumulation steps is a positive int; got {steps!r}")
        self.accumulation_steps = steps

    def __repr__(self) -> str:
        amp = f"amp={self.amp}" + (f" ({self.policy}, {self.dtype})" if self.amp else "")
        return (
            f"GraphConfig({amp}, clip_max_norm={self.clip_max_norm}, "
            f"accumulation_steps={self.accumulation_steps})"
        )


class _Root(nn.Module):
    """The nn.Module that owns the Graph's modules during tracing and in the step graph."""


def _signature(args: tuple) -> tuple:
    """What a compiled step is specialized on: structure, dtypes and devices (not shapes)."""

    def one(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", value.dtype, value.device.type, value.dim())
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, tuple(one(v) for v in value))
        return ("value", type(value).__name__)

    return tuple(one(a) for a in args)


class Graph:
    """Base class: subclass it, register modules and optimizers, write ``build``."""

    def __init__(self) -> None:
        object.__setattr__(self, "_modules", OrderedDict())
        self.config = GraphConfig()
        self._optimizers: list[torch.optim.Optimizer] = []
        self._schedulers: list[Any] = []
        self._scaler: GradScaler | None = None
        self._compiled: dict[tuple, fx.GraphModule] = {}
        self._last: fx.GraphModule | None = None
        self._master: MasterWeights | None = None
        self._step = 0
        self._scaler_in_use: GradScaler | None = None
        self._init_called = True

    # ---- registration -----------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, nn.Module) and not name.startswith("_"):
            if "_modules" not in self.__dict__:
                raise RuntimeError("call super().__init__() in your Graph's __init__ first")
            self._modules[name] = value
        elif name in self.__dict__.get("_modules", {}):
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
        self._scaler = scaler

    def build(self, *args: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} must define build(self, ...): the forward pass, and for a "
            "training graph loss.backward(), returning the loss"
        )

    # ---- compile and run --------------------------------------------------------------

    @property
    def training(self) -> bool:
        return bool(self._optimizers)

    @property
    def step_graph(self) -> fx.GraphModule | None:
        """The step graph of the last call (None before the first call)."""
        return self._last

    @property
    def build_graph(self) -> fx.GraphModule | None:
        """The captured and rewritten ``build`` (forward, casts, scaled backward)."""
        if self._last is None:
            return None
        return self._last.get_submodule("build") if self.training else self._last

    @property
    def grad_scaler(self) -> GradScaler | None:
        """The scaler the step graph uses: the one set with :meth:`set_grad_scaler`, or, where
        loss scaling does not apply (bfloat16, AMP off), a fixed scale of 1 that still skips
        steps with inf/nan gradients. None before the first call of a training graph."""
        return self._scaler_in_use

    @property
    def steps(self) -> int:
        """Calls made so far (the step counter in state_dict)."""
        return self._step

    def __call__(self, *args: Any) -> Any:
        if not self.__dict__.get("_init_called"):
            raise RuntimeError("call super().__init__() in your Graph's __init__")
        key = _signature(args)
        if key not in self._compiled:
            if self._compiled:
                log.info(
                    "%s: inputs changed structure or dtype; capturing build again",
                    type(self).__name__,
                )
            self._compiled[key] = self._compile(args)
        self._last = self._compiled[key]
        if not self.training:
            with torch.no_grad():
                return self._last(*args)
        if self.config.accumulation_steps > 1:
            self._check_divisible(args)
        out = self._last(*args)
        self._step += 1
        return out

    def _check_divisible(self, args: tuple) -> None:
        n = self.config.accumulation_steps
        for value in args:
            if isinstance(value, torch.Tensor) and value.shape[0] % n:
                raise ValueError(
                    f"gradient accumulation splits each input into {n} micro-batches along "
                    f"dim 0, but an input has {value.shape[0]} rows; use a batch size divisible "
                    f"by {n}"
                )

    def _active_scaler(self, dtype: torch.dtype) -> GradScaler:
        """The scaler the step uses. Scaling only matters for float16; otherwise a fixed
        scale of 1 still keeps steps with non-finite gradients off the weights."""
        fp16 = self.config.amp and dtype == torch.float16
        if self._scaler is not None and not fp16:
            warnings.warn(
                f"{type(self).__name__}: the GradScaler set with set_grad_scaler does nothing "
                f"here (AMP {'on with ' + str(dtype) if self.config.amp else 'off'}): loss scaling "
                "is for float16. Steps with inf/nan gradients are still skipped.",
                stacklevel=3,
            )
            return StaticGradScaler(1.0)
        if self._scaler is None:
            return StaticGradScaler(1.0)
        return self._scaler

    def _capture(self, root: _Root, args: tuple) -> fx.GraphModule:
        params = list(inspect.signature(self.build).parameters.values())
        if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
            raise TypeError("build(self, ...) takes positional arguments only (no *args/**kwargs)")
        if len(params) != len(args):
            raise TypeError(
                f"build takes {len(params)} inputs; the graph was called with {len(args)}"
            )
        names = [
            p.name if p.name.isidentifier() and not keyword.iskeyword(p.name) else f"arg{i}"
            for i, p in enumerate(params)
        ]
        namespace: dict[str, Any] = {"__build": self.build}
        exec(  # a forward with build's own argument names, so the graph reads like build
            f"def forward(self, {', '.join(names)}):\n    return __build({', '.join(names)})\n",
            namespace,
        )
        # fx traces type(root).forward: give this root a class of its own with that forward
        root.__class__ = type(
            f"{type(self).__name__}Root", (_Root,), {"forward": namespace["forward"]}
        )
        tracer = fx.Tracer()
        try:
            graph = tracer.trace(root)
        except Exception as error:
            raise RuntimeError(
                f"{type(self).__name__}.build could not be captured with torch.fx: {error}. "
                "build must be traceable (no Python control flow on tensor values)."
            ) from error
        gm = fx.GraphModule(root, graph, class_name=f"{type(self).__name__}Build")
        drop_string_annotations(gm)
        return gm

    def _compile(self, args: tuple) -> fx.GraphModule:
        root = _Root()
        for name, module in self._modules.items():
            root.add_module(name, module)
        build = self._capture(root, args)
        backwards = backward_nodes(build)
        if self.training and not backwards:
            raise RuntimeError(
                f"{type(self).__name__}.build never calls loss.backward(), but an optimizer is "
                "registered with add_optimizer; call loss.backward() in build (or register no "
                "optimizer for an evaluation graph)"
            )
        if not self.training and backwards:
            raise RuntimeError(
                f"{type(self).__name__}.build calls backward() but no optimizer is registered; "
                "add one with self.add_optimizer(...) or remove the backward call"
            )
        # the device autocast would use: the parameters', else the inputs'
        device = model_device_type(root, args)
        dtype = self.config.dtype or default_dtype(device)
        if self.config.amp:
            policy = resolve_policy(self.config.policy, device)
            if policy.name.startswith("O2") and self.training and self._master is None:
                self._master = MasterWeights.create(self._modules, self._optimizers, dtype)
            _attach_example_inputs(build, list(args))
            original = _copy_graph_module(build)
            result = run_passes(build, policy, dtype)
            build.meta[COMPILE_META] = CompileRecord(
                policy,
                dtype,
                device,
                result.stats,
                result.seconds,
                bool(result.stats.get("exact_dtypes")),
                original,
            )
        if not self.training:
            return build
        scaler = self._active_scaler(dtype)
        build.scaler = scaler
        scale_losses(build, "scaler", self.config.accumulation_steps)
        step_root = nn.Module()
        step_root.scaler = scaler
        plan = StepPlan(
            inputs=[n.name for n in build.graph.nodes if n.op == "placeholder"],
            micro_batches=self.config.accumulation_steps,
            clip_max_norm=self.config.clip_max_norm,
        )
        for i, optimizer in enumerate(self._optimizers):
            setattr(step_root, f"optimizer_{i}", optimizer)
            plan.optimizers.append(f"optimizer_{i}")
        for i, scheduler in enumerate(self._schedulers):
            setattr(step_root, f"lr_scheduler_{i}", scheduler)
            plan.schedulers.append(f"lr_scheduler_{i}")
        if self._master is not None:
            step_root.master_weights = self._master
            plan.master = "master_weights"
        self._scaler_in_use = scaler
        return build_step_graph(step_root, build, plan)

    # ---- state ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Modules (float32 masters under O2), optimizers, schedulers, scaler, step counter."""
        modules = {}
        for name, module in self._modules.items():
            state = module.state_dict()
            if self._master is not None:
                for key in list(state):
                    master = self._master.master_of(operator.attrgetter(key)(module))
                    if master is not None:
                        state[key] = master.detach()
            modules[name] = state
        scaler = self._scaler_state()
        return {
            "modules": modules,
            "optimizers": [o.state_dict() for o in self._optimizers],
            "schedulers": [s.state_dict() for s in self._schedulers],
            "scaler": scaler,
            "step": self._step,
        }

    def _scaler_state(self) -> dict[str, Any] | None:
        scaler = getattr(self, "_scaler_in_use", None) or self._scaler
        return None if scaler is None else scaler.state_dict()

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
        for name, module in self._modules.items():
            module_state = dict(state["modules"][name])
            if self._master is not None:
                for key, value in list(module_state.items()):
                    param = operator.attrgetter(key)(module)
                    master = self._master.master_of(param)
                    if master is not None:
                        with torch.no_grad():
                            master.copy_(value)
                        module_state[key] = value.to(param.dtype)
            module.load_state_dict(module_state)
        if len(state["optimizers"]) != len(self._optimizers):
            raise ValueError(
                f"state_dict has {len(state['optimizers'])} optimizers, the graph "
                f"{len(self._optimizers)}"
            )
        for optimizer, optimizer_state in zip(self._optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(optimizer_state)
        for scheduler, scheduler_state in zip(self._schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(scheduler_state)
        scaler = getattr(self, "_scaler_in_use", None) or self._scaler
        if state.get("scaler") is not None and scaler is not None:
            scaler.load_state_dict(state["scaler"])
        self._step = int(state["step"])

    def __repr__(self) -> str:
        head = f"{type(self).__name__}({', '.join(self._modules)}; {self.config})"
        if self._last is None:
            return f"{head}\n  (not compiled yet: the first call captures build)"
        parts = [head, "step graph:", self._last.code.strip()]
        if self.training:
            parts += ["build graph:", self._last.get_submodule("build").code.strip()]
        return "\n".join(parts)
