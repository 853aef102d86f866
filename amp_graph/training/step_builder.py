"""From a :class:`~amp_graph.training.nn_graph.Graph`'s registrations to its step graphs.

The Graph is the facade users read (its modules, optimizers, schedulers, scaler, ``config``
and ``build``); :class:`StepBuilder` is what turns them into a graph per input signature:

1. a root module over the registered modules whose forward is ``build``, with
   ``loss.backward()`` recorded rather than run (:class:`BackwardRecorder`), so that the
   captured graph is the forward returning each loss;
2. the capture and rewrite under the Graph's policy, through the front door
   (:mod:`amp_graph.frontends.front_door`), paths read from the Graph (``"model.head"``);
   under O2, the float32 masters made first; a parameter the plan reads only in float32,
   which it plans stored in float32 (:mod:`amp_graph.passes.widen_parameters`), gets its
   master's storage back before the graph runs (one capture);
3. the step graph around it (:mod:`amp_graph.training.step_graph`): micro-batches, loss
   scaling or the non-finite guard, clipping, the fused optimizer steps, the masters, the
   schedulers; under ``config.enable_compile`` its build handed to ``torch.compile``;
4. with ``config.enable_cuda_graph``, the replayer of those step graphs
   (:mod:`amp_graph.training.cuda_graph_step`), started once the refusals have passed.

Guarantees: one capture per input signature (a :class:`CaptureCache`), one step graph per
capture and step settings; a ``build`` that calls ``backward`` without an optimizer (or the
reverse) is refused at the first call, saying which; so is a batch that gradient
accumulation cannot split. Settings changed between calls are never silently unused: a
change of clipping, accumulation or process group builds the step graphs again around the
same captures (the CUDA graphs are captured again); what the captures are made of (AMP,
torch.compile, CUDA graphs) is refused once a step graph is built; under O2, writes to the
model's parameters reach the masters before each step (:mod:`.master_weights`).
"""

from __future__ import annotations

import inspect
import keyword
import logging
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from amp_graph.capture import Captured
from amp_graph.capture.fsdp_units import fsdp_units
from amp_graph.frontends.capture_cache import CaptureCache
from amp_graph.frontends.compile_modes import inductor_compiled, refuse_cuda_graphs_off_cuda
from amp_graph.frontends.front_door import COMPILE_META, admit, capture_and_rewrite
from amp_graph.frontends.user_frames import users_stacklevel
from amp_graph.ops.dtensors import is_dtensor
from amp_graph.passes.hoist_parameter_casts import hoist_parameter_casts
from amp_graph.passes.meta import WIDENED_PARAMETERS
from amp_graph.policy import Policy
from amp_graph.scaler import GradScaler
from amp_graph.training import cuda_graph_step as cuda_graphs
from amp_graph.training.fused_step import FusedStep
from amp_graph.training.master_weights import MasterWeights
from amp_graph.training.step_graph import StepPlan, build_step_graph
from amp_graph.training.step_watch import StepWatch

log = logging.getLogger(__name__)

CUDA_GRAPH_TOO_LATE = (
    "config.enable_cuda_graph changed after the first call: the step graph was built for "
    "the setting of the first call. Set it in __init__, before calling the graph."
)


class BuildRoot(nn.Module):
    """The nn.Module that owns the Graph's modules during tracing and in the step graph."""


class BackwardRecorder(TorchFunctionMode):
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


class StepBuilder:
    """The step graphs of one Graph (``graph``, whose registrations it reads), per input
    signature, with what they share: O2's masters, the scaler in use, the CUDA graph
    replayer."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.cache: CaptureCache | None = None
        self.steps: dict[int, fx.GraphModule] = {}  # by id of the Captured build
        self.master: MasterWeights | None = None
        self.scaler_in_use: GradScaler | None = None
        self.replayer: cuda_graphs.StepReplayer | None = None  # config.enable_cuda_graph
        self.replayed_lrs: list[Any] = []  # the Python learning rates its graphs keep
        self.built = False  # a step graph has been built: capture settings are fixed
        self.revision = -1  # the config's revision the graphs were made for
        self.settings: tuple[tuple, tuple] | None = None  # (capture, step) settings then
        self.hoisted: dict[int, list[tuple[str, torch.dtype]]] = {}  # by id of the Captured
        self.watch = StepWatch()  # the param groups and (CUDA graphs) tensors taken as fixed

    @property
    def started(self) -> bool:
        """Whether ``build`` has been captured: what is registered now is in the capture."""
        return self.built or bool(self.cache is not None and self.cache.captures)

    @property
    def name(self) -> str:
        return type(self.graph).__name__

    def step_for(self, args: tuple) -> tuple[fx.GraphModule, list]:
        """The step graph for these inputs (captured on first sight) and its flat inputs."""
        graph, config = self.graph, self.graph.config
        if self.master is not None:  # O2: the model's parameters written since the last step
            self.master.take_model_writes()
        if self.revision != config.revision:
            self._settings_changed()
        if self.watch.optimizers_changed(graph._optimizers):
            self._optimizers_changed()
        if self.replayer is not None and self.watch.tensors_moved():
            self._recapture("a parameter or buffer was replaced or given new storage")
        if self.cache is None:
            root = self._root()
            self.cache = CaptureCache(
                lambda a, k, dynamic: self._capture(root, a, dynamic),
                list(root.modules()),
                f"{self.name}.build",
            )
        n = config.accumulation_steps
        if n > 1:
            _check_divisible(args, n)
        # build runs on one micro-batch at a time: capture it on one (shapes that the model
        # derives from the batch size are fixed in the graph); the step graph splits the batch
        splits = graph.training and n > 1
        micro = (
            pytree.tree_map_only(torch.Tensor, lambda t: t.chunk(n)[0], args) if splits else args
        )
        captured, leaves = self.cache.get(micro, {})
        if splits:
            leaves = pytree.tree_leaves(args)
        if id(captured) not in self.steps:
            step = self._step_graph(captured)
            if self.replayer is not None:  # before it is kept: a refusal holds at every call
                tensors = cuda_graphs.step_tensors(graph._modules, leaves)
                self.replayer.device.check_devices(tensors)
            self.steps[id(captured)] = step
            self.built = True
            config.fix("enable_amp", "enable_compile")
            self.watch.record_optimizers(graph._optimizers)
        return self.steps[id(captured)], leaves

    def _optimizers_changed(self) -> None:
        """A param group was added (``add_param_group``: unfreezing layers) or changed since
        the step graphs were built. Under O2 the model's low copies in it are replaced by
        their float32 masters (which hold the gradients the step hands over); under CUDA
        graphs the step graphs are built again (the refusals run on the new groups) and
        captured again, as a replay runs no Python and would step the old groups."""
        optimizers = self.graph._optimizers
        if self.master is not None:
            self.master.point_optimizers(optimizers)
        if self.replayer is not None:
            self.steps.clear()
            self.replayer.grads = self._grads_per_graph()
            self._recapture("an optimizer's param groups changed")
        self.watch.record_optimizers(optimizers)

    def _recapture(self, why: str) -> None:
        """Drop the captured CUDA graphs: the next calls warm up and capture again."""
        assert self.replayer is not None
        self.replayer.clear()
        self.replayed_lrs = cuda_graphs.learning_rates(self.graph._optimizers)
        self.watch.record_tensors(self.graph._modules)
        log.info("%s: %s since the CUDA graphs were captured: capturing again", self.name, why)

    def _settings_changed(self) -> None:
        """The config changed since the last call. A change of what the step graphs decide
        (clipping, accumulation, process group) drops them: the next calls build them again
        around the same captures (and capture their CUDA graphs again). A change of what the
        captures decide, before any step graph was built (a first call that failed), drops
        the captures; later the setters refuse it (:meth:`GraphConfig.fix`), but for
        ``enable_cuda_graph``, refused here at every call."""
        config, replayer = self.graph.config, self.replayer
        if self.built and (
            (config.cuda_graph is None) != (replayer is None)
            or (replayer is not None and config.cuda_graph != replayer.options)
        ):
            raise RuntimeError(CUDA_GRAPH_TOO_LATE)
        settings = (config.capture_settings(), config.step_settings())
        if self.settings is not None and settings[0] != self.settings[0]:
            if self.built:  # the setters refuse it: the attributes were set directly
                raise RuntimeError(
                    f"{self.name}.config's AMP or compile settings changed after the first "
                    f"call, from {self.settings[0]} to {settings[0]}; set them before it"
                )
            self.cache = None  # the captures were made under the old settings
            self.hoisted.clear()
        if self.settings is None or settings != self.settings:
            self.steps.clear()
            if replayer is not None:
                replayer.clear()
        if self.graph._guard.process_group is not config.process_group:
            self.graph._guard.set_process_group(config.process_group)
        self.settings, self.revision = settings, config.revision

    def replay(self, step: fx.GraphModule, monitor: Any) -> Any:
        """``step`` (the step graph, or a monitor's logging graph of it) run by the CUDA
        graph replayer (warm-up, capture or replay)."""
        assert self.replayer is not None
        current = cuda_graphs.learning_rates(self.graph._optimizers)
        cuda_graphs.refuse_changed_learning_rates(self.replayed_lrs, current)
        if monitor is None:
            return self.replayer.runner(step)
        return self.replayer.runner(step, monitor.replayable(step))

    def state_loaded(self) -> None:
        """The loaded state is in new tensors: the CUDA graphs capture again."""
        if self.replayer is not None:
            self._recapture("the state was loaded")

    # ---- capture -------------------------------------------------------------------

    def _root(self) -> BuildRoot:
        """A module holding the Graph's modules, whose forward is ``build`` (with build's own
        argument names, so the captured graph's inputs read like build) recording the losses
        it calls ``backward`` on."""
        params = list(inspect.signature(self.graph.build).parameters.values())
        if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
            raise TypeError("build(self, ...) takes positional arguments only (no *args/**kwargs)")
        names = [
            p.name if p.name.isidentifier() and not keyword.iskeyword(p.name) else f"arg{i}"
            for i, p in enumerate(params)
        ]
        build = self.graph.build

        def run(*args: Any) -> tuple[Any, tuple[torch.Tensor, ...]]:
            recorder = BackwardRecorder()
            with recorder:
                out = build(*args)
            return out, tuple(recorder.losses)

        namespace: dict[str, Any] = {"__run": run}
        exec(
            f"def forward(self, {', '.join(names)}):\n    return __run({', '.join(names)})\n",
            namespace,
        )
        cls = type(f"{self.name}Build", (BuildRoot,), {"forward": namespace["forward"]})
        root = cls()
        for name, module in self.graph._modules.items():
            root.add_module(name, module)
        return root

    def _capture(self, root: BuildRoot, args: tuple, dynamic: bool) -> Captured:
        graph, config = self.graph, self.graph.config
        params = list(inspect.signature(graph.build).parameters)
        if len(params) != len(args):
            raise TypeError(
                f"build takes {len(params)} inputs; the graph was called with {len(args)}"
            )
        policy = config.policy if config.amp else "O0"
        request = admit(policy, config.dtype, root, args, where="graph")
        if config.compile and config.cuda_graph is None:  # else the step's capture refuses it
            mode = config.compile_options.get("mode")
            refuse_cuda_graphs_off_cuda(mode, request.device_type, f"{self.name}: enable_compile")
        if request.policy.master_weights and graph.training and self.master is None:
            _refuse_masters_of_sharded(root, request.policy)
            self.master = MasterWeights.create(graph._modules, graph._optimizers, request.dtype)
            config.fix("enable_amp")  # the model's parameters are stored low now
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
            recompute_hooks=not config.compile,
            cuda_graphs=config.cuda_graph is not None,
            # a parameter read only in float32 gains nothing stored low, and is rounded:
            # the plan stores it in float32, and it gets its master's storage back here
            low_copies=self.master.low_parameters() if self.master is not None else (),
        )
        gm = captured.graph_module
        widened = [gm.get_parameter(target) for target in gm.meta.get(WIDENED_PARAMETERS, ())]
        if widened:
            assert self.master is not None
            released = self.master.release(widened, graph._optimizers)
            log.info("O2: kept in float32 (read only in float32): %s", ", ".join(released))
        return captured

    # ---- the step graph --------------------------------------------------------------

    def _step_graph(self, captured: Captured) -> fx.GraphModule:
        """The step graph around a captured build (see :mod:`amp_graph.training.step_graph`)."""
        graph, config = self.graph, self.graph.config
        build = captured.graph_module
        output_tree, losses = pytree.tree_unflatten(
            list(range(captured.out_spec.num_leaves)), captured.out_spec
        )
        if graph.training and not losses:
            raise RuntimeError(
                f"{self.name}.build never calls loss.backward(), but an optimizer is "
                "registered with add_optimizer; call loss.backward() in build (or register no "
                "optimizer for an evaluation graph)"
            )
        if not graph.training and losses:
            raise RuntimeError(
                f"{self.name}.build calls backward() but no optimizer is registered; "
                "add one with self.add_optimizer(...) or remove the backward call"
            )
        output_positions, output_spec = pytree.tree_flatten(output_tree)
        hoist = graph.training and (config.accumulation_steps > 1 or id(captured) in self.hoisted)
        weight_casts = self._hoisted_casts(captured) if hoist else []
        placeholders = [n for n in build.graph.nodes if n.op == "placeholder"]
        if weight_casts:  # the last: the weights cast, which the step graph passes
            placeholders = placeholders[:-1]
        record = build.meta[COMPILE_META]
        scaler = self._active_scaler(record.dtype, record.policy) if graph.training else None
        step_root = nn.Module()
        if scaler is not None:
            step_root.scaler = scaler
        elif graph.training:
            step_root.guard = graph._guard
        plan = StepPlan(
            inputs=[n.name for n in placeholders],
            tensor_inputs=[isinstance(n.meta.get("val"), torch.Tensor) for n in placeholders],
            output_positions=list(output_positions),
            output_spec=output_spec,
            loss_positions=list(losses),
            micro_batches=config.accumulation_steps if graph.training else 1,
            clip_max_norm=config.clip_max_norm,
            grads_to_none=config.cuda_graph is None or config.cuda_graph.set_to_none,
            scaler="scaler" if scaler is not None else None,
            guard="guard" if scaler is None and graph.training else None,
            weight_casts=weight_casts,
        )
        for i, optimizer in enumerate(graph._optimizers):
            setattr(step_root, f"optimizer_{i}", optimizer)
            plan.optimizers.append(f"optimizer_{i}")
            setattr(step_root, f"fused_step_{i}", FusedStep(optimizer))
            plan.fused_steps.append(f"fused_step_{i}")
        for i, scheduler in enumerate(graph._schedulers):
            setattr(step_root, f"lr_scheduler_{i}", scheduler)
            if config.cuda_graph is None:  # else stepped by __call__, after the replay
                plan.schedulers.append(f"lr_scheduler_{i}")
        if self.master is not None:
            step_root.master_weights = self.master
            plan.master = "master_weights"
        self.scaler_in_use = scaler
        self._start_replayer(build, scaler)
        step = build_step_graph(step_root, build, plan)
        if config.compile:
            step.build = inductor_compiled(build, config.compile_options)
        return step

    def _hoisted_casts(self, captured: Captured) -> list[tuple[str, torch.dtype]]:
        """Gradient accumulation: each weight cast once per step, not once per micro-batch.
        Hoisting rewrites the captured build in place, once: every step graph built around
        it afterwards (one micro-batch too, after a change of the accumulation steps) passes
        it the weights cast."""
        key = id(captured)
        if key not in self.hoisted:
            _, self.hoisted[key] = hoist_parameter_casts(captured.graph_module)
            captured.graph_module.recompile()
        return self.hoisted[key]

    def _active_scaler(self, dtype: torch.dtype, policy: Policy) -> GradScaler | None:
        """The loss scaler the step uses, or None where scaling does not apply (anything but
        float16: bfloat16, fp8 whose e5m2 gradients have the range, AMP off); then the step's
        NonFiniteGuard keeps inf/nan gradients off the weights. So does a disabled scaler
        (``enabled=False``, or ``GradScaler("cuda")`` without CUDA), whose step would apply
        whatever gradients it is given."""
        amp, scaler = self.graph.config.amp, self.graph._scaler
        if scaler is not None and not scaler.is_enabled():
            return None
        fp16 = amp and dtype == torch.float16
        if scaler is not None and not fp16:
            why = "off" if not amp else f"on with {dtype}"
            if policy.fp8 is not None:
                why = "fp8, whose e5m2 gradients have the range"
            warnings.warn(
                f"{self.name}: the GradScaler set with set_grad_scaler does nothing "
                f"here (AMP {why}): loss scaling is for float16. Steps with inf/nan gradients "
                "are still skipped.",
                stacklevel=users_stacklevel(),
            )
        return scaler if fp16 else None

    def _start_replayer(self, build: fx.GraphModule, scaler: GradScaler | None) -> None:
        """config.enable_cuda_graph: refuse what a captured step cannot do, then replay."""
        graph, config = self.graph, self.graph.config
        options = config.cuda_graph
        if options is None:
            return
        cuda_graphs.refuse_uncapturable_step(
            graph._optimizers,
            graph._schedulers,
            config.compile_options if config.compile else None,
            config.process_group,
            graph._modules,
            build,
            options.pad_batches is not None,
            config.accumulation_steps,
        )
        if self.replayer is None:
            # a replay runs no Python: it must leave the step's flags where its capture did
            pins = [(scaler, "_last_step_taken")] if scaler else [(graph._guard, "_last_found")]
            self.replayer = cuda_graphs.StepReplayer(
                self.name, options, graph._step_capture(), pins, self._grads_per_graph()
            )
            self.replayed_lrs = cuda_graphs.learning_rates(graph._optimizers)
            self.watch.record_tensors(graph._modules)

    def _grads_per_graph(self) -> cuda_graphs.GradsPerGraph | None:
        """With ``enable_cuda_graph(set_to_none=True)``: the parameters whose gradients the
        step drops (the optimizers'), and those whose ``.grad`` a capture sets (O2's low
        copies too); None when gradients are zeroed in place."""
        options = self.graph.config.cuda_graph
        if options is None or not options.set_to_none:
            return None
        dropped = _unique(
            p for opt in self.graph._optimizers for g in opt.param_groups for p in g["params"]
        )
        low = self.master.low_parameters() if self.master is not None else []
        return cuda_graphs.GradsPerGraph(dropped, _unique([*dropped, *low]))


def _unique(tensors: Iterable[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``tensors`` in order, each once (by identity)."""
    return tuple({id(t): t for t in tensors}.values())


def _check_divisible(args: tuple, n: int) -> None:
    for value in args:
        if isinstance(value, torch.Tensor) and value.shape[0] % n:
            raise ValueError(
                f"gradient accumulation splits each input into {n} micro-batches along "
                f"dim 0, but an input has {value.shape[0]} rows; use a batch size divisible "
                f"by {n}"
            )


def _refuse_masters_of_sharded(root: nn.Module, policy: Policy) -> None:
    """Master weights replace the model's parameters with low-precision copies, which would
    take FSDP2's sharded parameters from under it, and cannot be made of DTensors
    (``param.data = ...`` on a DTensor changes its dtype, not its shards'): refuse, saying
    what does work."""
    dtensors = [name for name, p in root.named_parameters() if is_dtensor(p)]
    if dtensors and not fsdp_units(root):
        raise ValueError(
            f"policy {policy.name!r} keeps float32 master weights (master_weights=True), "
            f"which cannot be made of the tensor-parallel (DTensor) parameters ({dtensors[0]}, "
            "...): the low-precision copies would have to be DTensors of their own. Use "
            "dataclasses.replace(Policy.preset('O2'), master_weights=False) for O2's compute "
            "dtypes with the float32 parameters as the masters, or O1/O3."
        )
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


__all__ = ["CUDA_GRAPH_TOO_LATE", "BackwardRecorder", "BuildRoot", "StepBuilder"]
