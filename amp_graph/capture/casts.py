"""The casts and dtype reads of the model's Python while it is captured under a policy.

:class:`CompositePromoteMode` is the torch-function mode that
:mod:`amp_graph.capture.planned_dtypes`
enters beside its dispatch mode. At the level of the model's Python calls it

* gives a read of ``x.dtype`` the dtype ``x`` has in the plan (a graph input O2 casts at
  entry is float32 where it is traced, low in the graph), so that ``h.to(x.dtype)``,
  ``torch.finfo(x.dtype)`` and ``if x.dtype == torch.float16`` mean what they mean in the
  graph; ``h.to(x)`` likewise (:func:`cast_to_planned`);
* keeps a cast that returns its input itself apart from that input (:func:`kept_apart`);
* widens the mixed inputs of composite promote ops that check dtypes above dispatch.

The helpers here also serve the backend's capture (:mod:`amp_graph.capture`), which retraces
dynamo's graph and meets the same no-op casts.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from amp_graph.passes.meta import CASTABLE, LOW_PRECISION
from amp_graph.policy import Policy

# `x.dtype` reaches a torch-function mode as this descriptor's __get__ (a new bound
# method-wrapper on each access: compare the descriptor)
_DTYPE_DESCRIPTOR = torch.Tensor.dtype

# The casts a model writes as tensor methods, and the dtype each names (None: read from its
# arguments). One that changes nothing where the model is traced (``x.float()`` of a value
# that is float32 there) returns its input itself, and the tracer then takes every later use
# of that input for the cast's node: where the plan gives the input another dtype (an O2
# input, cast at entry), those uses would read the cast's float32.
_CAST_METHODS: dict[str, torch.dtype | None] = {
    "float": torch.float32,
    "double": torch.float64,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "to": None,
    "type": None,
    "type_as": None,
}
_CAST_METHOD_NAMES = {getattr(torch.Tensor, name): name for name in _CAST_METHODS}


def _cast_method(func: Any) -> str | None:
    """The name of the tensor-method cast ``func`` is (a method name or ``torch.Tensor``'s
    method), or None."""
    if isinstance(func, str):
        return func if func in _CAST_METHODS else None
    try:
        return _CAST_METHOD_NAMES.get(func)
    except TypeError:  # an unhashable callable: no tensor method
        return None


def newest_node(graph: fx.Graph) -> fx.Node | None:
    """The graph's last node. ``reversed(graph.nodes)`` is an iterator on torch 2.13 but an
    iterable on 2.11: ``iter`` serves both."""
    return next(iter(reversed(graph.nodes)), None)


class CompositePromoteMode(TorchFunctionMode):
    """Widens the mixed floating inputs of composite promote ops before they check dtypes,
    and notes which traced values' low dtype the model's Python reads.

    A composite op (``bilinear``, ``tensordot``) checks that its inputs share one dtype in
    its own C++ body, above any dispatch mode; CUDA autocast promotes them first (its
    kernel runs above the composite), CPU autocast does not list them. So where the policy
    promotes such an op and the model mixes dtypes, this mode casts the inputs to the
    widest one at the call. The casts are recorded (this mode is above the tracer); their
    node names are kept in ``casts`` and :func:`strip_widening_casts` removes them after
    the capture, leaving the op with the inputs the model gave it, as CUDA autocast's
    graphs have it. The passes then insert the casts the policy decides.

    A read of a tensor's ``.dtype`` that gives a low dtype adds the tensor's node name to
    ``dtype_reads``: whatever the model builds from it (``torch.finfo(dtype).min`` masks,
    ``.to(x.dtype)``) is a constant of the graph, and only a capture in which that value is
    float32 changes it (:data:`amp_graph.passes.meta.DTYPE_READ`).

    A tensor-method cast that returns its input itself where the model is traced
    (``x.float()`` of an input that is float32 there but low in the plan, as O2's inputs
    are) is given an alias of its input (:func:`kept_apart`; names in ``aliases``), so
    that later uses of ``x`` read ``x``, not the cast. One mode does the three jobs: a
    torch-function mode costs every torch call of the capture.
    """

    def __init__(
        self,
        tracer: Any,
        policy: Policy,
        casts: set[str],
        dtype_reads: set[str],
        aliases: set[str],
        planned_dtype: Callable[[torch.Tensor], torch.dtype] | None = None,
    ) -> None:
        super().__init__()
        self.tracer, self.policy, self.casts = tracer, policy, casts
        self.dtype_reads, self.aliases = dtype_reads, aliases
        self.planned_dtype = planned_dtype

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if self.planned_dtype is not None:
            func, args, kwargs = cast_to_planned(func, args, kwargs, self.planned_dtype)
        args = kept_apart(func, args, kwargs, self.aliases, self.tracer)
        if self.planned_dtype is not None and _is_dtype_query(func, args, kwargs):
            return _query_as_planned(func, args[0], self.planned_dtype(args[0]))
        if getattr(func, "__self__", None) is _DTYPE_DESCRIPTOR:
            dtype = func(*args, **kwargs)
            if self.planned_dtype is not None and args and isinstance(args[0], torch.Tensor):
                dtype = self.planned_dtype(args[0])
            if dtype in LOW_PRECISION:
                self.dtype_reads.update(n.name for n in traced_nodes(list(args), self.tracer))
            return dtype
        if _composite_promote(func, self.policy):
            leaves, spec = pytree.tree_flatten((args, kwargs))
            floating = {
                v.dtype for v in leaves if isinstance(v, torch.Tensor) and v.dtype in CASTABLE
            }
            if len(floating) > 1:
                wide = promoted(sorted(floating, key=str))
                for i, value in enumerate(leaves):
                    if isinstance(value, torch.Tensor) and value.dtype in floating - {wide}:
                        leaves[i] = value.to(wide)
                        self.casts.add(newest_node(self.tracer.graph).name)
                args, kwargs = pytree.tree_unflatten(leaves, spec)
        return func(*args, **kwargs)


# Tensor methods that answer with the dtype in another form: x.type() (a legacy type name, as
# in h.type(x.type())) and x.element_size() (its itemsize)
_DTYPE_QUERIES = frozenset({torch.Tensor.type, torch.Tensor.element_size})
_LEGACY_NAMES = {
    torch.float32: "FloatTensor",
    torch.float16: "HalfTensor",
    torch.bfloat16: "BFloat16Tensor",
}


def _is_dtype_query(func: Any, args: tuple, kwargs: dict) -> bool:
    try:
        known = func in _DTYPE_QUERIES
    except TypeError:  # an unhashable callable: no tensor method
        return False
    return known and len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor)


def _query_as_planned(func: Any, tensor: torch.Tensor, planned: torch.dtype) -> Any:
    """``x.type()`` or ``x.element_size()`` as ``x`` has them in the plan."""
    if func is torch.Tensor.element_size:
        return planned.itemsize
    if planned == tensor.dtype or planned not in _LEGACY_NAMES:
        return func(tensor)
    prefix = "torch." if tensor.device.type == "cpu" else f"torch.{tensor.device.type}."
    return prefix + _LEGACY_NAMES[planned]


def cast_to_planned(
    func: Any, args: tuple, kwargs: dict, planned_dtype: Callable[[torch.Tensor], torch.dtype]
) -> tuple[Any, tuple, dict]:
    """The call to make for ``x.to(y)``, whose target is another tensor's dtype: a cast to
    the dtype ``y`` has in the plan, on ``y``'s device, where that differs from ``y``'s
    captured dtype (torch records ``x.to(y)`` as ``aten.to.device`` either way). Not needed
    for ``x.to(y.dtype)`` (the ``.dtype`` read gives the planned one) nor ``x.type_as(y)``
    (recorded as written, it reads ``y``'s dtype in the graph; see
    :meth:`PolicyDtypeMode._note`). Any other call is returned as given."""
    if _cast_method(func) != "to" or not args or not isinstance(args[0], torch.Tensor):
        return func, args, kwargs
    positional = [i for i, a in enumerate(args[1:], 1) if isinstance(a, torch.Tensor)]
    source = args[positional[0]] if positional else kwargs.get("other")
    if not isinstance(source, torch.Tensor):
        return func, args, kwargs
    planned = planned_dtype(source)
    if planned == source.dtype:
        return func, args, kwargs
    rest = {k: v for k, v in kwargs.items() if k in ("non_blocking", "copy")}
    if positional:  # x.to(other, non_blocking=False, copy=False)
        flags = dict(zip(("non_blocking", "copy"), args[positional[0] + 1 :], strict=False))
        rest.update(flags)
    return torch.Tensor.to, (args[0], source.device, planned), rest


def _cast_target(name: str, args: tuple, kwargs: dict) -> torch.dtype | None:
    """The dtype the tensor-method cast ``name`` converts ``args[0]`` to, where it names one."""
    fixed = _CAST_METHODS.get(name)
    if fixed is not None:
        return fixed
    candidates = [*args[1:], kwargs.get("dtype"), kwargs.get("other")]
    for value in candidates:
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, torch.Tensor):
            return value.dtype
    return None


def reads_target_dtype(name: Any) -> bool:
    """Whether the tensor-method cast ``name`` (a method name or ``torch.Tensor``'s method)
    takes its target as an argument (``x.to(dtype)``, ``x.type(dtype)``), which may be a dtype
    the model read from a tensor, rather than naming it (``x.float()``)."""
    return _cast_method(name) in ("to", "type")


def is_noop_cast(name: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the tensor-method cast ``name`` (a method name or ``torch.Tensor``'s method)
    returns its input itself here: a cast to the dtype the input has, without ``copy=True``."""
    name = _cast_method(name)
    if name is None or not args or not isinstance(args[0], torch.Tensor):
        return False
    return not kwargs.get("copy", False) and _cast_target(name, args, kwargs) == args[0].dtype


def _same_device(named: Any, tensor: torch.Tensor) -> bool:
    """``named`` (a device, its string or a CUDA index) is where ``tensor`` is, as ``.to``
    reads it (no index: the tensor's own)."""
    if isinstance(named, bool) or not isinstance(named, (torch.device, str, int)):
        return False
    try:
        device = torch.device(named)
    except (RuntimeError, TypeError):
        return False
    return device.type == tensor.device.type and device.index in (None, tensor.device.index)


def moves_nothing(name: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``name`` is a ``.to(device)`` naming no dtype (``h.to(x.device)``, as HF writes
    to bring a value to another's device) of a tensor already there: torch returns the
    tensor itself, whatever its dtype. Traced, it would be recorded as a cast to the dtype
    the tensor had in that trace."""
    if _cast_method(name) != "to" or not args or not isinstance(args[0], torch.Tensor):
        return False
    named = [*args[1:], kwargs.get("device")]
    named = [a for a in named if a is not None]
    flags = {"device", "non_blocking"}
    if not named or set(kwargs) - flags or len(named) > 2:
        return False
    device, *rest = named
    return _same_device(device, args[0]) and all(isinstance(r, bool) and not r for r in rest)


def kept_apart(func: Any, args: tuple, kwargs: dict, names: set[str], tracer: Any = None) -> tuple:
    """The arguments to call ``func`` with: as given, or, for a cast that would return its
    input itself (:func:`is_noop_cast`), with an ``aten.alias`` of that input, recorded by
    ``tracer`` (default: the running pre-dispatch tracer; its node name is added to
    ``names``). The cast then returns the alias, and later uses of the input keep their own
    node. :func:`strip_aliases` removes the alias after the capture, leaving ``cast(x)``."""
    if not is_noop_cast(func, args, kwargs):
        return args
    alias = torch.ops.aten.alias.default(args[0])
    tracer = tracer if tracer is not None else proxy_tracer()
    if tracer is not None:
        names.add(newest_node(tracer.graph).name)
    return (alias, *args[1:])


def strip_aliases(gm: fx.GraphModule, names: set[str]) -> int:
    """Remove the aliases :func:`kept_apart` recorded; returns how many."""
    return _bypass(gm, names, ("aten::alias",))


@functools.lru_cache(maxsize=512)
def _composite_op_name(func: Any) -> str | None:
    """The aten op a torch-level function runs, when that op is a composite."""
    try:
        name = torch.overrides.resolve_name(func)
    except Exception:  # not every callable can be named
        return None
    base = (name or "").rsplit(".", 1)[-1]
    try:
        composite = torch._C._dispatch_has_kernel_for_dispatch_key(
            f"aten::{base}", "CompositeImplicitAutograd"
        )
    except RuntimeError:  # no aten op of that name (a dunder, a property)
        return None
    return base if composite else None


def _composite_promote(func: Any, policy: Policy) -> bool:
    name = _composite_op_name(func)
    return name is not None and name in policy.promote and name not in policy.ops


def strip_widening_casts(gm: fx.GraphModule, names: set[str]) -> int:
    """Remove the casts :class:`CompositePromoteMode` recorded; returns how many."""
    return _bypass(gm, names, ("aten::to", "aten::_to_copy"))


def _bypass(gm: fx.GraphModule, names: set[str], ops: tuple[str, ...]) -> int:
    """Remove the nodes named in ``names`` that run one of ``ops`` (aten schema names), each
    replaced by its first argument: what the capture's modes recorded only to steer the
    trace. Returns how many."""
    removed = 0
    for node in list(gm.graph.nodes):
        op = getattr(node.target, "_schema", None)
        if node.name in names and op is not None and op.name in ops:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            removed += 1
    return removed


def mark_named(gm: fx.GraphModule, names: set[str], key: str) -> None:
    """``meta[key] = True`` on the nodes named in ``names`` (the trace keeps node names):
    what a capture noted while tracing (:data:`~amp_graph.passes.meta.DTYPE_READ`,
    :data:`~amp_graph.passes.meta.TRACED_NOOP_CAST`)."""
    for node in gm.graph.nodes:
        if node.name in names:
            node.meta[key] = True


def promoted(dtypes: list[torch.dtype]) -> torch.dtype | None:
    floating = [d for d in dtypes if d in CASTABLE]
    if not floating:
        return None
    out = floating[0]
    for dtype in floating[1:]:
        out = torch.promote_types(out, dtype)
    return out


def traced_nodes(values: list[Any], tracer: Any) -> set[fx.Node]:
    """The graph nodes the tracer holds for these tensors (the model's inputs)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_slot

    nodes = set()
    for value in values:
        if isinstance(value, torch.Tensor):
            try:
                nodes.add(get_proxy_slot(value, tracer).proxy.node)
            except (AttributeError, KeyError, RuntimeError):  # not traced: a constant
                continue
    return nodes


def proxy_tracer() -> Any:
    """The pre-dispatch tracer of the running ``torch.export``, or None."""
    try:
        from torch._ops import _get_dispatch_mode_pre_dispatch
    except ImportError:
        return None
    mode = _get_dispatch_mode_pre_dispatch(torch._C._TorchDispatchModeKey.PROXY)
    return getattr(mode, "tracer", None)


@contextlib.contextmanager
def below_tracer() -> Iterator[None]:
    """Run code on export's fake values below its pre-dispatch tracer (nothing of it
    recorded) and without torch-function modes (export's would record autocast and
    grad-mode switches, amp_graph's would plan its ops as the model's)."""
    include = torch._C._dispatch_tls_local_include_set().remove(torch._C.DispatchKey.PreDispatch)
    exclude = torch._C._dispatch_tls_local_exclude_set() | torch._C.DispatchKeySet(
        torch._C.DispatchKey.PreDispatch
    )
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch._C.DisableTorchFunction():
        yield


class CastKeepingInterpreter(fx.Interpreter):
    """Runs dynamo's graph under ``make_fx``, keeping a value's later uses apart from a cast
    of it that returns it itself (dynamo traces in float32, where ``h.float()`` is ``h``):
    such a cast is given an alias of its input, removed after the trace
    (:func:`kept_apart`).

    Of those, a ``.to(...)`` or ``.type(...)`` may name a dtype the model read from a tensor
    (``h.to(x.dtype)``), which dynamo bakes in as the dtype it traced: their node names go
    to ``baked`` (:data:`~amp_graph.passes.meta.TRACED_NOOP_CAST`). ``h.float()`` names its
    target itself and is not baked."""

    def __init__(self, gm: fx.GraphModule, aliases: set[str], baked: set[str]) -> None:
        super().__init__(gm)
        self.aliases, self.baked = aliases, baked

    def call_method(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return self._keeping(super().call_method, target, args, kwargs)

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return self._keeping(super().call_function, target, args, kwargs)

    def _keeping(self, call: Callable, target: Any, args: tuple, kwargs: dict) -> Any:
        if moves_nothing(target, args, kwargs):
            return args[0]  # the tensor itself, as torch returns it: its dtype is the plan's
        baked = reads_target_dtype(target) and is_noop_cast(target, args, kwargs)
        out = call(target, kept_apart(target, args, kwargs, self.aliases), kwargs)
        tracer = proxy_tracer() if baked else None
        newest = newest_node(tracer.graph) if tracer is not None else None
        if newest is not None:
            self.baked.add(newest.name)
        return out


__all__ = [
    "CastKeepingInterpreter",
    "CompositePromoteMode",
    "cast_to_planned",
    "is_noop_cast",
    "kept_apart",
    "mark_named",
    "moves_nothing",
    "newest_node",
    "promoted",
    "proxy_tracer",
    "reads_target_dtype",
    "strip_aliases",
    "strip_widening_casts",
    "traced_nodes",
]
