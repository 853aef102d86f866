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
import keyword
import logging
import operator
import warnings
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from amp_graph.capture import Captured
from amp_graph.capture.fsdp_units import fsdp_units
from amp_graph.frontends.capture_cache import CaptureCache
from amp_graph.frontends.front_door import COMPILE_META, admit, capture_and_rewrite
from amp_graph.frontends.policy_request import check_request
from amp_graph.monitoring.core import Monitor
from amp_graph.passes.hoist_parameter_casts import hoist_parameter_casts
from amp_graph.policy import Policy, nearest
from amp_graph.scaler import GradScaler, NonFiniteGuard
from amp_graph.training import cuda_graph_step as cuda_graphs
from amp_graph.training.fused_step import FusedStep
from amp_graph.training.master_weights import MasterWeights, read_only_in_float32
from amp_graph.training.optimizer_state import load_optimizer_states, optimizer_states
from amp_graph.training.step_graph import StepPlan, build_step_graph

log = logging.getLogger(__name__)


# What enable_compile passes on: torch.compile's keyword arguments.
COMPILE_OPTIONS = tuple(p for p in inspect.signature(torch.compile).parameters if p != "model")


class GraphConfig:
    """``graph.config``: AMP, gradient clipping and accumulation, compilation, as in OneFlow."""

    def __init__(self) -> None:
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

    def enable_amp(
        self, mode: bool = True, *, policy: Policy | str = "O1", dtype: torch.dtype | None = None
    ) -> None:
        """Compute per ``policy`` (O1 by default) in ``dtype`` (the device default if None).

        The policy means what it means for :func:`amp_graph.compile`, except that module
        paths start at the Graph (``"model.head"`` for ``self.model = model``): overrides
        that match no module raise ValueError at the first call, naming the nearest path.
        """
        check_request(policy, dtype)  # unknown names and bad dtypes fail here
        self.amp, self.policy, self.dtype = bool(mode), policy, dtype

    def set_gradient_clipping(self, max_norm: float | None) -> None:
        """Clip the total 2-norm of each optimizer's gradients (after unscaling)."""
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
        pipeline stages, hand-rolled sharding."""
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                "set_process_group takes a torch.distributed.ProcessGroup (e.g. "
                f"dist.new_group(ranks)) or None; got {type(process_group).__name__}"
            )
        self.process_group = process_group

    def set_gradient_accumulation_steps(self, steps: int) -> None:
        """Split each call's batch into ``steps`` micro-batches; one optimizer step per call."""
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"gradient accumulation steps is a positive int; got {steps!r}")
        self.accumulation_steps = steps

    def enable_compile(self, enabled: bool = True, /, **options: Any) -> None:
        """Hand the build graph (forward, casts and backward) to ``torch.compile`` (inductor
        unless ``backend=`` says otherwise), as OneFlow's ``nn.Graph`` compiles its graph.

        ``options`` are torch.compile's keyword arguments (``backend``, ``mode``,
        ``dynamic``, ``fullgraph``, ``options``, ...; ``mode="max-autotune"`` is torch.compile's
        mode, ``enable_compile(False)`` turns it off). The step around the build (gradient
        check, optimizer step, master weights) stays eager, as in a hand-written loop.
        Takes effect at the next capture (the first call).
        """
        for name in options:
            if name not in COMPILE_OPTIONS:
                raise TypeError(
                    f"enable_compile got an unknown option {name!r}; torch.compile takes "
                    f"{list(COMPILE_OPTIONS)}.{nearest(name, COMPILE_OPTIONS)}"
                )
        self.compile, self.compile_options = bool(enabled), dict(options)

    def enable_cuda_graph(
        self,
        mode: bool = True,
        *,
        warmup_steps: int = 3,
        max_graphs: int = 8,
        pad_batches: Any = None,
    ) -> None:
        """Run the whole step (forward, backward, unscale and check, clipping, optimizer
        steps, O2 masters, scale update) as one CUDA graph, replayed each call.

        Per input signature (sizes, dtypes, the values of non-tensor inputs): the first
        ``warmup_steps`` calls run eagerly on a side stream, the next captures the step and
        replays it; later calls copy the batch into the captured inputs and replay. At most
        ``max_graphs`` graphs are held (least recently used dropped), sharing one memory
        pool; each capture logs a line. What a call returns is a copy (kept safely across
        replays). Gradients are zeroed in place rather than set to None (the graph writes
        them at fixed addresses); LR schedulers step on the host after each call, changing a
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
            cuda_graphs.CudaGraphOptions(warmup_steps, max_graphs, pad_batches) if mode else None
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


class _Root(nn.Module):
    """The nn.Module that owns the Graph's modules during tracing and in the step graph."""


class _BackwardRecorder(TorchFunctionMode):
    """Records the losses ``build`` calls ``backward`` on instead of running it, so that the
    captured graph is the forward, returning those losses (the step graph runs backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[torch.Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func is torch.Tensor.backward:
            # torch passes its defaults along: gradient=None, retain_graph=None, ...
            if len(args) > 1 or any(v not in (None, False) for v in kwargs.values()):
                raise TypeError(
                    "in Graph.build, call loss.backward() without arguments: the step graph "
                    "runs backward itself (scaling the loss where needed)"
                )
            self.losses.append(args[0])
            return None
        return func(*args, **kwargs)


class Graph:
    """Base class: subclass it, register modules and optimizers, write ``build``."""

    def __init__(self) -> None:
        object.__setattr__(self, "_modules", OrderedDict())
        self.config = GraphConfig()
        self._optimizers: list[torch.optim.Optimizer] = []
        self._schedulers: list[Any] = []
        self._scaler: GradScaler | None = None
        self._cache: CaptureCache | None = None
        self._steps: dict[int, fx.GraphModule] = {}  # by id of the Captured build
        self._last: fx.GraphModule | None = None
        self._master: MasterWeights | None = None
        self._step = 0
        self._scaler_in_use: GradScaler | None = None
        self._guard = NonFiniteGuard()  # checks gradients when no loss is scaled
        self._replayer: cuda_graphs.StepReplayer | None = None  # config.enable_cuda_graph
        self._replayed_lrs: list[Any] = []  # the Python learning rates its graphs keep
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
        return self._scaler_in_use

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because a gradient was inf/nan (by the scaler or the guard).
        Reading it synchronizes once."""
        if self._scaler_in_use is not None:
            return self._scaler_in_use.skipped_steps
        return self._guard.skipped_steps

    @property
    def skipped_steps_counter(self) -> torch.Tensor | int:
        """:attr:`skipped_steps` without a host read: a device copy of the count (an int
        before the first step)."""
        if self._scaler_in_use is not None:
            return self._scaler_in_use.skipped_steps_counter
        return self._guard.skipped_steps_counter

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

    def capture(self, *args: Any) -> fx.GraphModule:
        """Capture and rewrite ``build`` for these inputs now, and return the step graph
        (nothing is computed, no step is counted). Calling the graph does this on its own."""
        self._last = self._step_for(args)[0]
        return self._last

    def __call__(self, *args: Any) -> Any:
        padded = self._replayer.padded(args) if self._replayer and self.training else None
        args = args if padded is None else padded.args
        step, leaves = self._step_for(args)
        self._last = step
        monitor = self.config.monitor
        run = step if monitor is None else monitor.graph_for_step(step, owner=self, inputs=args)
        if self._replayer is not None:  # a logging step is a captured graph of its own
            run = self._replay_step(run, monitor)
        if not self.training:
            with torch.no_grad():
                return run(*leaves)
        out = run(*leaves)
        if self._replayer is not None:  # not in the step graph: a replay runs no Python
            for scheduler in self._schedulers:
                scheduler.step()
        self._step += 1
        if monitor is not None:
            monitor.after_step(self, out)
        return out if padded is None else padded.cut(out)

    def _step_for(self, args: tuple) -> tuple[fx.GraphModule, list]:
        """The step graph for these inputs (captured on first sight) and its flat inputs."""
        if not self.__dict__.get("_init_called"):
            raise RuntimeError("call super().__init__() in your Graph's __init__")
        if self._cache is None:
            root = self._root()
            self._cache = CaptureCache(
                lambda a, k, dynamic: self._capture(root, a, dynamic),
                list(root.modules()),
                f"{type(self).__name__}.build",
            )
        if self._steps and (self.config.cuda_graph is None) != (self._replayer is None):
            raise RuntimeError(self._CUDA_GRAPH_TOO_LATE)
        if self._guard.process_group is not self.config.process_group:
            self._guard.set_process_group(self.config.process_group)
        n = self.config.accumulation_steps
        if n > 1:
            self._check_divisible(args)
        # build runs on one micro-batch at a time: capture it on one (shapes that the model
        # derives from the batch size are fixed in the graph); the step graph splits the batch
        splits = self.training and n > 1
        micro = (
            pytree.tree_map_only(torch.Tensor, lambda t: t.chunk(n)[0], args) if splits else args
        )
        captured, leaves = self._cache.get(micro, {})
        if splits:
            leaves = pytree.tree_leaves(args)
        if id(captured) not in self._steps:
            step = self._step_graph(captured)
            if self._replayer is not None:  # before it is kept: a refusal holds at every call
                self._replayer.device.check_devices(cuda_graphs.step_tensors(self._modules, leaves))
            self._steps[id(captured)] = step
        return self._steps[id(captured)], leaves

    def _replay_step(self, step: fx.GraphModule, monitor: Monitor | None) -> Any:
        """``step`` (the step graph, or a monitor's logging graph of it) run by the CUDA
        graph replayer (warm-up, capture or replay)."""
        assert self._replayer is not None
        cuda_graphs.refuse_changed_learning_rates(
            self._replayed_lrs, cuda_graphs.learning_rates(self._optimizers)
        )
        if monitor is None:
            return self._replayer.runner(step)
        return self._replayer.runner(step, monitor.replayable(step))

    def _start_replayer(self, build: fx.GraphModule, scaler: GradScaler | None) -> None:
        """config.enable_cuda_graph: refuse what a captured step cannot do, then replay."""
        options = self.config.cuda_graph
        if options is None:
            return
        cuda_graphs.refuse_uncapturable_step(
            self._optimizers,
            self._schedulers,
            self.config.compile_options if self.config.compile else None,
            self.config.process_group,
            self._modules,
            build,
            options.pad_batches is not None,
            self.config.accumulation_steps,
        )
        if self._replayer is None:
            # a replay runs no Python: it must leave the step's flags where its capture did
            pins = [(scaler, "_last_step_taken")] if scaler else [(self._guard, "_last_found")]
            self._replayer = cuda_graphs.StepReplayer(
                f"{type(self).__name__}", options, self._step_capture(), pins
            )
            self._replayed_lrs = cuda_graphs.learning_rates(self._optimizers)

    _CUDA_GRAPH_TOO_LATE = (
        "config.enable_cuda_graph changed after the first call: the step graph was built for "
        "the setting of the first call. Set it in __init__, before calling the graph."
    )
    # what captures and replays (tests on the CPU substitute a stand-in)
    _step_capture: Any = cuda_graphs.CudaGraphCapture

    def _check_divisible(self, args: tuple) -> None:
        n = self.config.accumulation_steps
        for value in args:
            if isinstance(value, torch.Tensor) and value.shape[0] % n:
                raise ValueError(
                    f"gradient accumulation splits each input into {n} micro-batches along "
                    f"dim 0, but an input has {value.shape[0]} rows; use a batch size divisible "
                    f"by {n}"
                )

    def _active_scaler(self, dtype: torch.dtype, policy: Policy) -> GradScaler | None:
        """The loss scaler the step uses, or None where scaling does not apply (anything but
        float16: bfloat16, fp8 whose e5m2 gradients have the range, AMP off); then the step's
        NonFiniteGuard keeps inf/nan gradients off the weights."""
        fp16 = self.config.amp and dtype == torch.float16
        if self._scaler is not None and not fp16:
            why = "off" if not self.config.amp else f"on with {dtype}"
            if policy.fp8 is not None:
                why = "fp8, whose e5m2 gradients have the range"
            warnings.warn(
                f"{type(self).__name__}: the GradScaler set with set_grad_scaler does nothing "
                f"here (AMP {why}): loss scaling is for float16. Steps with inf/nan gradients "
                "are still skipped.",
                stacklevel=4,
            )
        return self._scaler if fp16 else None

    def _root(self) -> _Root:
        """A module holding the Graph's modules, whose forward is ``build`` (with build's own
        argument names, so the captured graph's inputs read like build) recording the losses
        it calls ``backward`` on."""
        params = list(inspect.signature(self.build).parameters.values())
        if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
            raise TypeError("build(self, ...) takes positional arguments only (no *args/**kwargs)")
        names = [
            p.name if p.name.isidentifier() and not keyword.iskeyword(p.name) else f"arg{i}"
            for i, p in enumerate(params)
        ]
        build = self.build

        def run(*args: Any) -> tuple[Any, tuple[torch.Tensor, ...]]:
            recorder = _BackwardRecorder()
            with recorder:
                out = build(*args)
            return out, tuple(recorder.losses)

        namespace: dict[str, Any] = {"__run": run}
        exec(
            f"def forward(self, {', '.join(names)}):\n    return __run({', '.join(names)})\n",
            namespace,
        )
        cls = type(f"{type(self).__name__}Build", (_Root,), {"forward": namespace["forward"]})
        root = cls()
        for name, module in self._modules.items():
            root.add_module(name, module)
        return root

    def _capture(self, root: _Root, args: tuple, dynamic: bool) -> Captured:
        params = list(inspect.signature(self.build).parameters)
        if len(params) != len(args):
            raise TypeError(
                f"build takes {len(params)} inputs; the graph was called with {len(args)}"
            )
        policy = self.config.policy if self.config.amp else "O0"
        request = admit(policy, self.config.dtype, root, args, where="graph")
        if request.policy.master_weights and self.training and self._master is None:
            _refuse_masters_of_sharded(root, request.policy)
            self._master = MasterWeights.create(self._modules, self._optimizers, request.dtype)
        # The graph reads the Graph's modules as its own attributes (self.model.fc.weight),
        # unless a module's name would shadow a GraphModule attribute (then self.root.model).
        names = set(dict(root.named_children()))
        attr = "root" if names & set(dir(fx.GraphModule)) else None
        captured = capture_and_rewrite(
            root,
            args,
            {},
            request,
            dynamic=dynamic,
            model_attr=attr,
            # compiled: AOTAutograd's partitioner decides what backward keeps, no hooks
            recompute_hooks=not self.config.compile,
        )
        if self._master is not None:
            # a parameter read only in float32 gains nothing stored low, and is rounded
            wide = read_only_in_float32(captured.graph_module, self._master.low_parameters())
            if wide:
                names = self._master.release(wide, self._optimizers)
                log.info("O2: kept in float32 (read only in float32): %s", ", ".join(names))
                return self._capture(root, args, dynamic)  # the graph reads them in float32
        return captured

    def _step_graph(self, captured: Captured) -> fx.GraphModule:
        """The step graph around a captured build (see :mod:`amp_graph.training.step_graph`)."""
        build = captured.graph_module
        output_tree, losses = pytree.tree_unflatten(
            list(range(captured.out_spec.num_leaves)), captured.out_spec
        )
        if self.training and not losses:
            raise RuntimeError(
                f"{type(self).__name__}.build never calls loss.backward(), but an optimizer is "
                "registered with add_optimizer; call loss.backward() in build (or register no "
                "optimizer for an evaluation graph)"
            )
        if not self.training and losses:
            raise RuntimeError(
                f"{type(self).__name__}.build calls backward() but no optimizer is registered; "
                "add one with self.add_optimizer(...) or remove the backward call"
            )
        output_positions, output_spec = pytree.tree_flatten(output_tree)
        placeholders = [n for n in build.graph.nodes if n.op == "placeholder"]
        record = build.meta[COMPILE_META]
        scaler = self._active_scaler(record.dtype, record.policy) if self.training else None
        step_root = nn.Module()
        if scaler is not None:
            step_root.scaler = scaler
        elif self.training:
            step_root.guard = self._guard
        plan = StepPlan(
            inputs=[n.name for n in placeholders],
            tensor_inputs=[isinstance(n.meta.get("val"), torch.Tensor) for n in placeholders],
            output_positions=list(output_positions),
            output_spec=output_spec,
            loss_positions=list(losses),
            micro_batches=self.config.accumulation_steps if self.training else 1,
            clip_max_norm=self.config.clip_max_norm,
            grads_to_none=self.config.cuda_graph is None,
            scaler="scaler" if scaler is not None else None,
            guard="guard" if scaler is None and self.training else None,
        )
        if self.training and self.config.accumulation_steps > 1:
            # cast each weight once per step, not once per micro-batch
            _, plan.weight_casts = hoist_parameter_casts(build)
            build.recompile()
        for i, optimizer in enumerate(self._optimizers):
            setattr(step_root, f"optimizer_{i}", optimizer)
            plan.optimizers.append(f"optimizer_{i}")
            setattr(step_root, f"fused_step_{i}", FusedStep(optimizer))
            plan.fused_steps.append(f"fused_step_{i}")
        for i, scheduler in enumerate(self._schedulers):
            setattr(step_root, f"lr_scheduler_{i}", scheduler)
            if self.config.cuda_graph is None:  # else stepped by __call__, after the replay
                plan.schedulers.append(f"lr_scheduler_{i}")
        if self._master is not None:
            step_root.master_weights = self._master
            plan.master = "master_weights"
        self._scaler_in_use = scaler
        self._start_replayer(build, scaler)
        step = build_step_graph(step_root, build, plan)
        if self.config.compile:
            step.build = torch.compile(build, **self.config.compile_options)
        return step

    # ---- state ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Modules (float32 masters under O2), optimizers (their state allocated before the
        first step, for DCP to fill: :mod:`~amp_graph.training.optimizer_state`), schedulers,
        scaler, step counter, and the count of steps skipped without a scaler."""
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
            "optimizers": optimizer_states(self._optimizers),  # fillable in place (DCP)
            "schedulers": [s.state_dict() for s in self._schedulers],
            "scaler": scaler,
            "nonfinite_guard": self._guard.state_dict(),
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
        load_optimizer_states(self._optimizers, state["optimizers"])
        for scheduler, scheduler_state in zip(self._schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(scheduler_state)
        scaler = getattr(self, "_scaler_in_use", None) or self._scaler
        if state.get("scaler") is not None and scaler is not None:
            scaler.load_state_dict(state["scaler"])
        if state.get("nonfinite_guard") is not None:
            self._guard.load_state_dict(state["nonfinite_guard"])
        self._step = int(state["step"])
        if self._replayer is not None:  # the loaded state is in new tensors: capture again
            self._replayer.clear()
            self._replayed_lrs = cuda_graphs.learning_rates(self._optimizers)

    def __repr__(self) -> str:
        head = f"{type(self).__name__}({', '.join(self._modules)}; {self.config})"
        if self._last is None:
            return f"{head}\n  (not compiled yet: the first call captures build)"
        parts = [head, "step graph:", self._last.code.strip()]
        if self.training:
            parts += ["build graph:", self.build_graph.code.strip()]
        return "\n".join(parts)


def _refuse_masters_of_sharded(root: nn.Module, policy: Policy) -> None:
    """Master weights replace the model's parameters with low-precision copies, which would
    take FSDP2's sharded parameters from under it: refuse, saying what does work."""
    units = [path or "<root>" for path, _ in fsdp_units(root)]
    if units:
        raise ValueError(
            f"policy {policy.name!r} keeps float32 master weights (master_weights=True), which "
            f"would replace the parameters FSDP2 shards (units {units[:3]}...). With FSDP2 the "
            "sharded float32 parameters already are the masters: use "
            "dataclasses.replace(Policy.preset('O2'), master_weights=False) for O2's compute "
            "dtypes, or O1/O3; amp_graph.plan_fsdp before fully_shard gives the units that "
            "allow it bf16 all-gathers (the masters' low-precision copies, made by FSDP2)."
        )
