"""Capture: model code as people write it, to an aten-level FX graph with exact dtypes.

``torch.export`` (non-strict) runs the model's own Python on fake tensors built from real
example values, so shape-derived Python (``B, T, C = x.size()``, masks sliced to ``T``),
HF transformers, torch's Transformer layers, RNNs with tuple states and ``torch.autocast``
blocks are all captured, each op at aten level (``aten.linear``, ``aten.softmax.int``)
with its fake value in ``meta["val"]`` and its module path in ``meta["nn_module_stack"]``.

The capture runs under ``torch.autocast`` in the policy's dtype (O0 aside), so model code
that asks ``torch.is_autocast_enabled()`` (HF's ``maybe_autocast``) takes its autocast
path and its own float32 blocks are recorded. The ops recorded are the model's, not
autocast's: export traces above the autocast dispatch key. The dtypes the model's Python
sees are the policy's (:mod:`amp_graph.capture.planned_dtypes`), so that code which reads a dtype
(``.to(x.dtype)``) records the cast the policy implies.

The exported program is then "unlifted" by :func:`_graph_module`: each parameter and
buffer placeholder becomes a ``get_attr`` that reads the user's model *at call time*
(``self.model.blocks[0].attn.weight``), so the graph shares the model's tensors, sees
replacements of them, and never copies one. Graph inputs are the pytree leaves of
``(args, kwargs)``; :class:`Captured` keeps the specs that pack and unpack them.

A model may return a plain ``@dataclass`` (anywhere in its output, as torch.compile allows):
:func:`_register_dataclasses` registers its type as a pytree node
(``torch.export.register_dataclass``) while export runs the forward, so the graph returns
its fields and the caller gets an instance of the model's own type back.
"""

from __future__ import annotations

import contextlib
import gc
import linecache
import logging
import re
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module
from torch.utils import _pytree as pytree

from amp_graph.capture.autograd_functions import (
    bind_functions,
    kept_functions,
)
from amp_graph.capture.capture_error import CaptureError
from amp_graph.capture.casts import (
    mark_named,
    strip_aliases,
    strip_widening_casts,
)
from amp_graph.capture.custom_ops import needs_fake_message, op_without_fake
from amp_graph.capture.fsdp_units import (
    FSDP_MIXED_PRECISION,
    UnsupportedFSDP,
    fsdp_units_unsharded,
    gathered_dtypes,
    mixed_precision,
    planned_for,
)
from amp_graph.capture.host_random import HostGenerators, host_draws, host_draws_message
from amp_graph.capture.masked_partials import masked_partials_kept
from amp_graph.capture.module_hooks import refuse_backward_hooks
from amp_graph.capture.planned_dtypes import (
    capture_under_policy,
    half_model_view,
    mark_capture_plans,
    mark_checkpoint_regions,
)
from amp_graph.capture.symbolic_sizes import auto_dims_contained, auto_dynamic_shapes
from amp_graph.passes.fsdp_hooks import stack_unit
from amp_graph.passes.meta import (
    CHECKPOINT_REGION,
    DTYPE_READ,
    EXPORT_FACTS,
    FSDP_GATHERED_DTYPE,
    FSDP_PLANNED,
    FSDP_UNITS,
    MODEL_ROOT,
    model_root,
)
from amp_graph.policy import Policy

log = logging.getLogger(__name__)

MODEL_ATTR = "model"  # the attribute of a captured GraphModule that holds the user's model


@dataclass(frozen=True)
class ExportFacts:
    """The parts of torch.export's ExportedProgram besides its graph, kept to make another."""

    range_constraints: dict
    module_call_graph: list
    verifiers: list


@dataclass
class ShapeGuard:
    """What a graph's input sizes must be: each dim an int (captured static) or a symbol
    (captured with symbolic sizes: equal symbols equal, within the symbol's range)."""

    dims: list[tuple[int, int, Any]] = field(default_factory=list)  # (leaf, dim, int | symbol)
    ranges: dict[Any, tuple[int, int | None]] = field(default_factory=dict)

    def accepts(self, leaves: Sequence[Any]) -> bool:
        bound: dict[Any, int] = {}
        for leaf, dim, want in self.dims:
            size = leaves[leaf].shape[dim]
            if isinstance(want, int):
                if size != want:
                    return False
            elif want in bound:
                if bound[want] != size:
                    return False
            else:
                low, high = self.ranges.get(want, (0, None))
                if size < low or (high is not None and size > high):
                    return False
                bound[want] = size
        return True


@dataclass
class Captured:
    """A captured graph and how to call it.

    ``graph_module`` takes the flat leaves of ``(args, kwargs)`` (``in_spec``) and returns the
    flat leaves of the model's output (``out_spec``). ``guard`` says which input sizes it
    serves.
    """

    graph_module: fx.GraphModule
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    guard: ShapeGuard | None = None  # None: any sizes
    seconds: float = 0.0

    def accepts(self, leaves: Sequence[Any]) -> bool:
        """Whether these flat inputs have sizes the graph was captured for."""
        return self.guard is None or self.guard.accepts(leaves)

    def call(self, leaves: Sequence[Any], choose: Callable[[Any], Any] | None = None) -> Any:
        """Run the graph (or the one ``choose`` picks for it: a monitor's) on flat inputs."""
        graph = self.graph_module if choose is None else choose(self.graph_module)
        return self.unflatten(graph(*leaves))

    def unflatten(self, out: Any) -> Any:
        """The model's output structure from what the graph returns (its flat leaves)."""
        if self.out_spec.is_leaf():
            return out
        return pytree.tree_unflatten(list(out), self.out_spec)


def export_refused(model: str) -> RuntimeError:
    """What ``torch.export.export`` of an amp_graph compiled module raises."""
    return RuntimeError(
        f"torch.export.export cannot export an amp_graph compiled module ({model}): amp_graph "
        "captures and rewrites the model itself, per input signature. For an inference "
        "program (eval mode, every cast explicit, weights stored in the low dtype) call "
        f"amp_graph.export(model, args, policy=..., dtype=...) (it also takes the compiled "
        "module); for the training graph as it is, export compiled.graph_module with the "
        "flat inputs"
    )


def capture_autocast(
    device_type: str, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager:
    """The autocast state the model's Python sees during capture (none for O0)."""
    if dtype is None or device_type not in ("cpu", "cuda", "xpu", "mps", "hpu"):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a graph is traced and built. Each full
    collection walks every live object, and tracing a 10k-node graph makes hundreds of
    thousands (nodes, fake tensors, their metadata) that count towards its thresholds:
    collections cost about a sixth of such an export (BENCHMARKS.md). The cycles made
    meanwhile are collected after, by the next collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture_module(
    model: nn.Module,
    args: tuple,
    kwargs: dict[str, Any],
    *,
    device_type: str,
    autocast_dtype: torch.dtype | None,
    dynamic: bool = False,
    model_attr: str | None = MODEL_ATTR,
    policy: Policy | None = None,
    low_dtype: torch.dtype | None = None,
    dynamic_shapes: Any = None,
    code_on_call: bool = False,
    keep_functions: bool = True,
) -> Captured:
    """Export ``model(*args, **kwargs)`` and unlift it into a GraphModule over ``model``.

    ``dynamic=True`` lets export keep the sizes of tensor inputs symbolic where the model
    allows (``Dim.AUTO``), so one graph serves every batch size and sequence length;
    ``dynamic_shapes`` (torch.export's argument) says which sizes exactly, instead.
    ``model_attr`` is the GraphModule attribute the model is read through (None: its
    children become the GraphModule's). With a ``policy`` (and its ``low_dtype``), the
    model's Python sees the dtypes that policy gives each value
    (:mod:`amp_graph.capture.planned_dtypes`), not torch.autocast's. ``code_on_call``: the
    GraphModule generates its Python code when first called or printed, not at each
    ``recompile()`` (torch's ``_LazyGraphModule``): for a caller that only reads the graph,
    as :func:`amp_graph.export` does, generating the code of a 10k-node graph is waste.
    ``keep_functions``: each custom ``torch.autograd.Function`` the model calls becomes one
    node that calls its ``apply`` (:mod:`amp_graph.capture.autograd_functions`), so that its
    own backward runs; False inlines its forward's ops, for an inference program.

    Raises:
        CaptureError: naming the failing construct (file, line, code) and what to do.
    """
    start = time.perf_counter()
    refuse_backward_hooks(model)
    if dynamic_shapes is None and dynamic:
        dynamic_shapes = auto_dynamic_shapes(model, args, kwargs)
    low = low_dtype or autocast_dtype or torch.bfloat16
    casts_nothing = autocast_dtype is None and (policy is None or policy.changes_nothing)

    functions = kept_functions(type(model).__name__)

    def export() -> tuple[Any, Any, Any]:
        planned = (
            capture_under_policy(model, policy, low)
            if policy is not None
            else contextlib.nullcontext()
        )
        # Apex O2/O3 (the policies that cast inputs at entry): the model's Python sees a half
        # model
        half = (
            half_model_view(model, policy, low)
            if policy is not None and policy.cast_inputs
            else contextlib.nullcontext()
        )
        # FSDP2: every rank captures its units unsharded with their hooks detached
        # (amp_graph/capture/fsdp_units.py); the pass fsdp_hooks calls the hooks in the graph
        fsdp = fsdp_units_unsharded(model, casts_nothing)
        # Export flattens the output right after the forward returns: the hook registers the
        # output's dataclass types before that. Removed after, also when export fails.
        hook = model.register_forward_hook(_register_output_dataclasses)
        try:
            with (
                gc_paused(),
                auto_dims_contained((args, kwargs)),  # its marks and 0/1 notes
                fsdp as units,
                capture_autocast(device_type, autocast_dtype),
                functions if keep_functions else contextlib.nullcontext(),
                planned,
                # above the policy's mode: it sees a snapshot's detach first
                masked_partials_kept(model, (args, kwargs)),
                half,
                # export builds a GraphModule after each of its own passes, generating and
                # compiling Python code for each (6 times on torch 2.13); none of it is run,
                # since _graph_module copies the graph: generate code only when asked for
                _use_lazy_graph_module(True),
            ):
                program = torch.export.export(
                    model, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes
                )
        finally:
            hook.remove()
        return program, planned, units

    generators = HostGenerators.now()
    try:
        program, planned, units = export()
    except CaptureError:
        raise  # ours (a dataclass output that cannot be rebuilt): it says what to do
    except UnsupportedFSDP as error:
        raise CaptureError(str(error)) from None  # says what to do; the trace adds nothing
    except Exception as error:
        if _raised_by_user_code(error):
            raise  # the model's own assert or check failed: that is the user's error as is
        raise _capture_error(model, error, generators.moved(HostGenerators.now())) from error
    if drawn := host_draws(generators, export):
        raise CaptureError(host_draws_message(type(model).__name__, drawn))
    if isinstance(planned, capture_under_policy) and planned.reentrant_checkpoint:
        raise CaptureError(
            f"{type(model).__name__} calls torch.utils.checkpoint in its reentrant form "
            "(use_reentrant=True, the default where use_reentrant is not passed), which "
            "runs the block under torch.no_grad() inside an autograd.Function: one graph "
            "would compute it without gradients. Pass use_reentrant=False (HF models: "
            "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
            "{'use_reentrant': False})); amp_graph then recomputes the block in backward."
        )
    if keep_functions and (defined := functions.defined):
        names = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in defined)
        raise CaptureError(
            f"{type(model).__name__} defines the custom autograd Function {names} while its "
            "forward runs: amp_graph keeps a Function whole (its own backward) only if its "
            "class exists before the capture. Define the class once, at module level."
        )
    if keep_functions:
        functions.refuse_fake_state()
    with gc_paused():
        gm = _graph_module(program, model, model_attr, code_on_call)
        bind_functions(gm, functions.calls)
    gm.meta[EXPORT_FACTS] = ExportFacts(
        dict(program.range_constraints), list(program.module_call_graph), list(program.verifiers)
    )
    if isinstance(planned, capture_under_policy):
        if planned.widening_casts or planned.aliases:
            strip_widening_casts(gm, planned.widening_casts)
            strip_aliases(gm, planned.aliases)
            gm.recompile()
        mark_checkpoint_regions(gm, planned.checkpointed)
        mark_capture_plans(gm, planned.plan_records)
        mark_named(gm, planned.dtype_reads, DTYPE_READ)
    if units:
        gm.meta[FSDP_UNITS] = units
        _check_checkpoints_within_units(gm, units)
        if policies := mixed_precision(model):
            gm.meta[FSDP_MIXED_PRECISION] = policies
            _mark_gathered_dtypes(gm, gathered_dtypes(model), planned_for(model), model_attr)
    spec = program.call_spec
    return Captured(
        gm, spec.in_spec, spec.out_spec, _shape_guard(gm, program), time.perf_counter() - start
    )


def _register_dataclasses(tree: Any, owner: str) -> None:
    """Make the type of every dataclass instance in ``tree`` a pytree node, so that export
    can return it and ``tree_unflatten`` gives back an instance of that type.

    An unregistered dataclass type is registered with ``torch.export.register_dataclass``
    (globally, as a user would; it stays registered). The children of every registered node
    are searched too (dataclass fields, tuples, lists, dicts, HF ``ModelOutput``), so nested
    dataclasses are found. ``None`` fields and non-tensor fields (ints) come back as they
    were: the former in the spec, the latter as graph outputs. ``owner`` names the model in
    errors.

    Raises:
        CaptureError: a dataclass that ``cls(**fields)`` cannot rebuild (``init=False``
            fields, an ``__init__`` of other arguments, a ``__post_init__`` that replaces a
            field) or that torch refuses to register; it names the type and what to do.
    """
    if isinstance(tree, torch.Tensor):
        return
    if is_dataclass(tree) and not isinstance(tree, type) and pytree.tree_is_leaf(tree):
        _register_dataclass(tree, owner)
    if not pytree.tree_is_leaf(tree):
        children, _ = pytree.tree_flatten(tree, is_leaf=lambda child: child is not tree)
        for child in children:
            _register_dataclasses(child, owner)


def _register_output_dataclasses(module: nn.Module, args: Any, output: Any) -> None:
    """The forward hook :func:`capture_module` sets on the model while export runs it."""
    _register_dataclasses(output, type(module).__name__)


def _register_dataclass(value: Any, owner: str) -> None:
    """Register ``type(value)`` with ``torch.export.register_dataclass``, whose unflatten
    rebuilds an instance as ``cls(**init_fields)``. That call is tried on ``value`` first, so
    a type it would rebuild wrongly is refused, never registered."""
    cls = type(value)
    name = f"{cls.__module__}.{cls.__qualname__}"
    try:
        rebuilt = cls(**{f.name: getattr(value, f.name) for f in fields(cls) if f.init})
        lost = [f.name for f in fields(cls) if _field(rebuilt, f.name) is not _field(value, f.name)]
        if not lost:
            torch.export.register_dataclass(cls, serialized_type_name=name)
            log.info("amp_graph: registered %s as a pytree node, to return it from a graph", name)
            return
        why = (
            f"the instance it rebuilds has other values in {lost} (init=False fields, or "
            "fields its __init__ or __post_init__ sets itself)"
        )
    except Exception as error:
        raise CaptureError(
            _unregistrable(owner, name, f"{type(error).__name__}: {error}")
        ) from error
    raise CaptureError(_unregistrable(owner, name, why))


def _field(obj: Any, name: str) -> Any:
    return getattr(obj, name, _field)  # _field itself: the field was never set


def _unregistrable(owner: str, name: str, why: str) -> str:
    return (
        f"{owner} returns a {name}, a dataclass amp_graph returns by registering it with "
        "torch.export.register_dataclass, which rebuilds it from its fields as "
        f"cls(**fields); that fails here: {why}. Register the type yourself with "
        "torch.utils._pytree.register_pytree_node (saying how to flatten and rebuild it), or "
        "return a tuple or dict of its fields."
    )


def _check_checkpoints_within_units(gm: fx.GraphModule, units: list[str]) -> None:
    """An activation checkpoint must lie inside one FSDP2 unit (or outside all of them):
    FSDP's hooks run at unit boundaries, and one that fell inside a recomputed region
    would all-gather or reshard again in backward, which the graph cannot express."""
    found: dict[int, set[str | None]] = {}
    for node in gm.graph.nodes:
        if CHECKPOINT_REGION in node.meta:
            unit = stack_unit(node, gm, units)
            found.setdefault(node.meta[CHECKPOINT_REGION], set()).add(unit)
    for region, inside in found.items():
        if len(inside) > 1:
            names = ", ".join(sorted(repr(u) for u in inside))
            raise CaptureError(
                f"activation checkpoint {region} of {type(model_root(gm)).__name__} spans the "
                f"FSDP2 units {names}: amp_graph can keep a checkpoint only inside one unit. "
                "Checkpoint each FSDP2 unit (or a part of one) on its own, e.g. "
                "torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) per block."
            )


def _shape_guard(gm: fx.GraphModule, program: Any) -> ShapeGuard:
    """Each input dim's captured size or symbol, and the symbols' ranges."""
    guard = ShapeGuard()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for leaf, node in enumerate(placeholders):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(value.shape):
            if not isinstance(size, torch.SymInt):
                guard.dims.append((leaf, dim, int(size)))
            elif getattr(size.node.expr, "is_Symbol", False):
                guard.dims.append((leaf, dim, size.node.expr))
            # a derived size (2*s0): the graph's own runtime asserts check it
    for symbol, ranges in getattr(program, "range_constraints", {}).items():
        guard.ranges[symbol] = (_bound(ranges.lower) or 0, _bound(ranges.upper))
    return guard


def _bound(value: Any) -> int | None:
    """A range bound as an int; None for infinity."""
    try:
        return int(value)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None


def capture_for_policy(
    model: nn.Module,
    args: tuple,
    kwargs: dict[str, Any],
    policy: Policy,
    dtype: torch.dtype,
    *,
    device_type: str,
    **options: Any,
) -> Captured:
    """:func:`capture_module` for a policy computing in ``dtype``: the model's Python sees
    the dtypes ``policy`` gives each value, and torch.autocast in ``dtype`` unless the
    policy casts nothing (O0). ``options``: :func:`capture_module` 's others."""
    return capture_module(
        model,
        args,
        kwargs,
        device_type=device_type,
        autocast_dtype=None if policy.casts_nothing else dtype,
        policy=policy,
        low_dtype=dtype,
        **options,
    )


_STATE_KINDS = ("PARAMETER", "BUFFER", "CONSTANT_TENSOR")


def _mark_gathered_dtypes(
    gm: fx.GraphModule,
    gathered: dict[str, torch.dtype],
    planned: dict[str, str],
    attr: str | None,
) -> None:
    """``meta[FSDP_GATHERED_DTYPE]`` on the reads of parameters their FSDP2 unit all-gathers
    in another dtype than the model holds them in (the passes plan for the gathered one),
    and ``meta[FSDP_PLANNED]`` where ``amp_graph.plan_fsdp`` chose that dtype."""
    prefix = f"{attr}." if attr else ""
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target.startswith(prefix):
            name = node.target[len(prefix) :]
            if name in gathered:
                node.meta[FSDP_GATHERED_DTYPE] = gathered[name]
                if name in planned:
                    node.meta[FSDP_PLANNED] = planned[name]


def _graph_module(
    program: Any, model: nn.Module, attr: str | None, code_on_call: bool = False
) -> fx.GraphModule:
    """The exported graph with its state placeholders read from ``model`` (see module doc):
    through the attribute ``attr`` of the GraphModule (``self.model.fc.weight``), or, with
    ``attr=None``, through ``model``'s own children set on the GraphModule
    (``self.fc.weight``: for a root that only holds modules, as a Graph's does)."""
    from torch.export.graph_signature import InputKind, OutputKind

    def state(target: str) -> str:
        return f"{attr}.{target}" if attr else target

    source = program.graph_module
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    specs = {spec.arg.name: spec for spec in program.graph_signature.input_specs}
    constants: dict[str, Any] = {}
    for node in source.graph.nodes:
        if node.op == "placeholder":
            spec = specs[node.name]
            if spec.kind.name in _STATE_KINDS:
                if spec.kind is InputKind.CONSTANT_TENSOR:
                    name = f"_const_{len(constants)}"
                    constants[name] = program.constants[spec.target]
                    new = graph.get_attr(name)
                else:
                    new = graph.get_attr(state(spec.target))
            elif spec.kind is InputKind.USER_INPUT:
                new = graph.placeholder(node.name)
            else:
                raise CaptureError(
                    f"torch.export produced an input of kind {spec.kind.name} ({node.name}), "
                    "which amp_graph does not handle (custom objects and effect tokens)"
                )
            new.meta = dict(node.meta)
            env[node] = new
        elif node.op == "output":
            outputs = list(node.args[0])
            users: list[fx.Node] = []
            for spec, value in zip(program.graph_signature.output_specs, outputs, strict=True):
                mapped = env[value] if isinstance(value, fx.Node) else value
                if spec.kind is OutputKind.USER_OUTPUT:
                    users.append(mapped)
                elif spec.kind in (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION):
                    target = (
                        graph.get_attr(state(spec.target))
                        if spec.kind is OutputKind.BUFFER_MUTATION
                        else next(n for n in graph.nodes if n.name == spec.target)
                    )
                    graph.call_function(torch.ops.aten.copy_.default, (target, mapped))
                else:
                    raise CaptureError(f"unexpected output kind {spec.kind.name} from torch.export")
            # A model returning one tensor gets a graph returning it (not a 1-tuple).
            single = program.call_spec.out_spec.is_leaf() and len(users) == 1
            graph.output(users[0] if single else tuple(users))
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    # Built empty, given its attributes, then its graph: GraphModule(root, graph) would
    # first copy every read into a placeholder module tree (a module per path, thousands on
    # a deep model), only to have it replaced by the model.
    cls = _LazyGraphModule if code_on_call else fx.GraphModule
    gm = cls(nn.Module(), fx.Graph(), class_name=type(model).__name__)
    for name, value in constants.items():
        setattr(gm, name, value)
    # Read the model's tensors through the model itself, at call time: the user's module
    # (or, without ``attr``, its children and its own tensors).
    if attr:
        setattr(gm, attr, model)
    for node in graph.nodes:
        if node.op != "get_attr" or node.target in constants:
            continue
        head = node.target.split(".", 1)[0]
        if attr and head == attr:
            continue
        if attr is None and hasattr(model, head):
            setattr(gm, head, getattr(model, head))
        else:  # a subgraph export made (a higher-order op's body)
            set_dotted_attr(gm, node.target, _attr(source, node.target))
    gm.graph = graph  # generates the code (once, or on the first call)
    gm.meta[MODEL_ROOT] = attr or ""
    return gm


def set_dotted_attr(root: nn.Module, dotted: str, value: Any) -> None:
    """``root.a.b.c = value``, adding an empty module for each missing ``a``, ``b``."""
    *path, name = dotted.split(".")
    for part in path:
        if not hasattr(root, part):
            root.add_module(part, nn.Module())
        root = getattr(root, part)
    setattr(root, name, value)


def _attr(obj: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        obj = getattr(obj, name)
    return obj


def _raised_by_user_code(error: BaseException) -> bool:
    """The exception comes from the model's own code (``assert t <= block_size``), not from
    the tracer: its innermost frame is outside torch."""
    frames = traceback.extract_tb(error.__traceback__)
    torch_root = torch.__file__.rsplit("/", 2)[0]
    return bool(frames) and not frames[-1].filename.startswith(torch_root)


def _user_frame(error: BaseException) -> str:
    """``file.py:12: `if x.sum() > 0:``` for the innermost frame outside torch and amp_graph
    that has a source file (not code generated at run time, ``<string>``)."""
    frames = traceback.extract_tb(error.__traceback__)
    torch_dir = torch.__file__.rsplit("/", 1)[0] + "/"  # not site-packages: transformers
    ours = __file__.rsplit("/", 1)[0]
    for frame in reversed(frames):
        if not frame.filename.startswith((torch_dir, ours, "<")):
            code = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
            return f"{frame.filename}:{frame.lineno}: `{code}`"
    return "an unknown location"


# torch's refusal of a higher-order operator (flex_attention) under a dispatch mode of ours
_HIGHER_ORDER = re.compile(r"no rule registered for HigherOrderOperator (\w+) and mode")

_HINTS: tuple[tuple[Callable[[str], bool], str], ...] = (
    (
        lambda text: "Cache" in text and "pytree" in text,
        "The model returns a cache object (transformers' DynamicCache) that a graph cannot "
        "return. For training, call it with use_cache=False (or set config.use_cache = False).",
    ),
    (
        lambda text: "not a known type" in text or "register a pytree" in text,
        "The model returns or takes an object that is not a tensor, a tuple, list or dict of "
        "them, a returned dataclass, or a registered pytree type; return tensors, or "
        "register the type with torch.utils._pytree.register_pytree_node.",
    ),
    (
        lambda text: _HIGHER_ORDER.search(text) is not None,
        "torch.export runs this operator through torch.compile, which refuses the dispatch "
        "mode amp_graph's capture plans dtypes with. Use torch.compile(model, "
        "backend=amp_graph.backend(...)), which takes flex_attention where its block mask is "
        "made outside the compiled forward (create_block_mask runs vmap, which the backend "
        "cannot retrace).",
    ),
    (
        lambda text: "data-dependent" in text or "guard on data-dependent" in text,
        "The model's Python branches on the values inside a tensor (e.g. `if x.sum() > 0:`), "
        "which one graph cannot express. Use torch.compile(model, backend='amp_graph'), "
        "which splits the model at such places, or rewrite the branch with torch.where / "
        "torch.cond.",
    ),
)


def _capture_error(
    model: nn.Module, error: BaseException, drawn: list[str] | None = None
) -> CaptureError:
    text = f"{type(error).__name__}: {error}"
    no_fake = op_without_fake(text)
    hint = (
        (needs_fake_message(no_fake) if no_fake else None)
        or next((h for match, h in _HINTS if match(text)), None)
        or (
            "If the model's Python cannot run on fake tensors, use torch.compile(model, "
            "backend='amp_graph'), which splits the model where it must."
        )
    )
    if drawn:
        # often the cause: a mask drawn on the host became a constant the graph indexes with
        hint += "\n  Also: " + host_draws_message(type(model).__name__, drawn)
    first_lines = "\n".join(text.splitlines()[:6])
    if found := _HIGHER_ORDER.search(text):  # torch's own hint there is for our mode, not users
        first_lines = f"torch's {found.group(1)} cannot run under amp_graph's capture"
    return CaptureError(
        f"amp_graph could not capture {type(model).__name__} with torch.export "
        f"(non-strict): {first_lines}\n  The failing construct is at {_user_frame(error)}.\n"
        f"  {hint}"
    ).with_traceback(None)


__all__ = [
    "MODEL_ATTR",
    "CaptureError",
    "Captured",
    "ShapeGuard",
    "capture_autocast",
    "capture_for_policy",
    "capture_module",
    "gc_paused",
    "set_dotted_attr",
]
