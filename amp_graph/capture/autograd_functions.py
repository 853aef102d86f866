"""Custom ``torch.autograd.Function`` s kept whole: one graph node that calls ``apply``.

``torch.export`` (non-strict) runs a Function's ``forward`` and records its ops, inlined;
the Function's own ``backward`` is lost, and autograd then differentiates the forward's ops
instead (a straight-through ``round`` gets the derivative 0, flash-attn's kernel none at
all): silently wrong gradients. While amp_graph captures, :class:`kept_functions` therefore
gives every Function class the model can call (those defined outside torch) an ``apply``
that, under export's pre-dispatch tracer, runs the Function on the fake values unrecorded
and records one node for the whole call instead. After the capture, :func:`bind_functions`
makes that node's target a :class:`FunctionCall`: at run time it calls the Function's own
``apply``, so its ``forward``, ``setup_context``, ``save_for_backward``,
``mark_non_differentiable``, ``once_differentiable`` and ``backward`` are the user's, as in
eager mode.

What the Function computes in, is what torch.autocast gives it: the node runs ``apply``
under the autocast state the capture saw at the call (amp_graph's own ``torch.autocast`` in
the policy's dtype, or none for O0, with the model's own ``torch.autocast`` blocks), so
``torch.amp.custom_fwd(cast_inputs=...)`` casts its inputs and turns autocast off inside,
and ``custom_bwd`` runs the backward under the forward's state, as they do under
torch.autocast. Its inputs reach it as the plan computed them: a Function call is not an op
that autocast casts, and no pass casts them either (:func:`is_function_call`).

DTensor's own conversions (``from_local``, ``redistribute``, ``to_local``: the hooks of
``torch.distributed.tensor.parallel`` call them) are kept the same way. Inlined, export
would record their collectives as bare ``all_reduce`` / ``all_gather`` nodes, which have no
derivative; kept, their backward redistributes the gradient as in eager mode, and the ops
between them compute on DTensors (the policy's dtype on each shard, as on one process).

A user's ``torch.library.custom_op`` call is kept the same way (:mod:`.custom_ops`), so that
its body and its ``register_autocast`` rule see autocast as in eager mode. What a kept call
run on fake values writes into the attributes of its plain Python arguments (a
bitsandbytes state's lazily quantized weight) is undone after that run
(:func:`~amp_graph.capture.call_state.attributes_restored`).

The patch is scoped: each class's ``apply`` is restored when the capture ends, raises or
not, and a call made while no export traces (another thread, a model's own ``torch.compile``
region) goes to the original ``apply``.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from amp_graph.capture.call_state import attributes_restored, fake_attribute
from amp_graph.capture.capture_error import CaptureError
from amp_graph.capture.casts import (
    CastKeepingInterpreter,
    below_tracer,
    is_noop_cast,
    proxy_tracer,
    reads_target_dtype,
)
from amp_graph.capture.custom_ops import (
    CustomOpFunction,
    is_functional,
    needs_fake_message,
    op_without_fake,
    user_custom_op,
    user_op,
)
from amp_graph.capture.op_bodies import check_mutating_op
from amp_graph.passes.meta import KEPT_FUNCTION

# The target export's verifier admits for a Function call kept in its pre-dispatch graph
# (torch's own allow_in_pre_dispatch_graph uses it); bind_functions replaces it with ours.
_TRACED_TARGET = torch.export.custom_ops._call_custom_autograd_function_in_pre_dispatch
_KEY_PREFIX = "amp_graph.kept_function:"
_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class AutocastState:
    """The torch.autocast state a Function was called under, per device type."""

    states: tuple[tuple[str, bool, torch.dtype], ...]

    @classmethod
    def now(cls) -> AutocastState:
        return cls(
            tuple(
                (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                for device in _DEVICE_TYPES
            )
        )

    def entered(self) -> contextlib.ExitStack:
        """Enter this state (each device type whose state differs from the current one)."""
        stack = contextlib.ExitStack()
        for device, enabled, dtype in self.states:
            if enabled or torch.is_autocast_enabled(device):
                # no cast cache: one call is too short to reuse a cast, and a CUDA graph
                # capture must not keep one
                stack.enter_context(
                    torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=False)
                )
        return stack

    @classmethod
    def of_policy(cls, device_type: str, dtype: torch.dtype | None) -> AutocastState:
        """torch.autocast in ``dtype`` on ``device_type`` (None: off), as amp_graph's capture
        runs a policy's model; over what the model's own blocks set now."""
        now = cls.now()
        if dtype is None:
            return now
        return cls(
            tuple(
                (device, True, dtype)
                if device == device_type and not enabled
                else (device, enabled, d)
                for device, enabled, d in now.states
            )
        )

    def describe(self) -> str:
        on = [
            f"{device} {str(dtype).removeprefix('torch.')}" for device, e, dtype in self.states if e
        ]
        return f"under torch.autocast({', '.join(on)})" if on else "with autocast off"


# torch's own Functions amp_graph keeps whole: DTensor's conversions, whose backward
# redistributes the gradient (inlined, the forward's collectives would have no derivative)
_TORCH_FUNCTION_NAMES = {
    "torch.distributed.tensor._api._FromTorchTensor": "dtensor_from_local",
    "torch.distributed.tensor._api._ToTorchTensor": "dtensor_to_local",
    "torch.distributed.tensor._redistribute.Redistribute": "dtensor_redistribute",
    "torch.distributed.tensor._redistribute.NestedRedistribute": "dtensor_redistribute",
}


def _qualified(cls: type) -> str:
    """``module.QualName`` of a class: how the classes above are keyed and errors name them."""
    return f"{cls.__module__}.{cls.__qualname__}"


class FunctionCall:
    """A graph node's target: ``function.apply`` on the node's tensors and the constants
    the capture saw, under the autocast state of the capture (:class:`AutocastState`)."""

    def __init__(
        self,
        function: type[torch.autograd.Function],
        spec: pytree.TreeSpec,
        leaves: list[Any],
        tensor_positions: list[int],
        autocast: AutocastState,
    ) -> None:
        self.function, self.spec, self.autocast = function, spec, autocast
        self.leaves, self.tensor_positions = leaves, tensor_positions
        own_name = _TORCH_FUNCTION_NAMES.get(_qualified(function))
        self.__name__ = own_name or f"{function.__name__}_apply"
        self.__qualname__ = self.__name__
        # fx's codegen spells a target from a torch module as an attribute path, which a
        # call object is not; torch's own Functions (DTensor's) are named as globals
        self.__module__ = __name__ if own_name else function.__module__

    def __call__(self, *tensors: Any) -> Any:
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_positions, tensors, strict=True):
            leaves[position] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        # on fake values (a pass planning dtypes), what the call writes into its plain
        # Python arguments is undone: the real call must find them as the user left them
        faked = any(isinstance(t, FakeTensor) for t in tensors)
        with self.autocast.entered(), attributes_restored(self.leaves if faked else ()):
            return self.function.apply(*args, **kwargs)

    def in_float32(self) -> FunctionCall:
        """The same call with autocast off: what it computes when the model runs in float32
        (the numerics' shadow run)."""
        off = AutocastState(tuple((d, False, dtype) for d, _, dtype in self.autocast.states))
        return FunctionCall(self.function, self.spec, self.leaves, self.tensor_positions, off)

    @property
    def name(self) -> str:
        return _qualified(self.function)

    def __repr__(self) -> str:
        return f"<{self.name}.apply {self.autocast.describe()}>"


def is_function_call(node: fx.Node) -> bool:
    """A node that calls a custom autograd Function kept whole."""
    return node.op == "call_function" and isinstance(node.target, FunctionCall)


def function_calls(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``gm`` that call a custom autograd Function kept whole."""
    return [n for n in gm.graph.nodes if is_function_call(n)]


def _user_function_classes() -> list[type[torch.autograd.Function]]:
    """Every Function class defined outside torch, and DTensor's conversions (torch's
    other Functions, as checkpoint's, export handles itself)."""
    found: dict[type, None] = {}
    pending = list(torch.autograd.Function.__subclasses__())
    while pending:
        cls = pending.pop()
        if cls in found:
            continue
        found[cls] = None
        pending.extend(cls.__subclasses__())
    return [
        c
        for c in found
        if not (c.__module__ == "torch" or c.__module__.startswith("torch."))
        or _qualified(c) in _TORCH_FUNCTION_NAMES
    ]


class FunctionNotCaptured(CaptureError):
    """A custom autograd Function whose forward could not run on fake tensors."""


class FakeStateKept(CaptureError):
    """A kept call's non-tensor argument holds a fake tensor after the capture."""


class _KeptCustomOps(TorchFunctionMode):
    """Sends each call of a user's ``torch.library.custom_op`` under export's tracer to
    :meth:`kept_functions.record_op`."""

    def __init__(self, owner: kept_functions) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            tracer = proxy_tracer()
            op = user_op(func, args, kwargs) if tracer is not None else None
            if op is not None and not self.owner._inside:
                if is_functional(op):
                    return self.owner.record_op(tracer, op, args, kwargs)
                check_mutating_op(op, args, kwargs, self.owner.owner)
        return func(*args, **kwargs)


class kept_functions:
    """While active, every custom Function called under export's pre-dispatch tracer is
    recorded as one node (see the module doc); :attr:`calls` maps each node's key to its
    :class:`FunctionCall`, for :func:`bind_functions`."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.calls: dict[str, FunctionCall] = {}
        self._ops = _KeptCustomOps(self)
        self._patched: list[tuple[type, Any]] = []
        self._known: set[type] = set()
        self.defined: list[type] = []  # Function classes defined while it was active
        self._count = itertools.count()
        self._inside = False  # a Function's forward is running: calls in it are its own

    def __enter__(self) -> kept_functions:
        classes = _user_function_classes()
        self._known = set(classes)
        for cls in classes:
            self._patched.append((cls, cls.__dict__.get("apply")))
            cls.apply = classmethod(self._apply_for(cls))  # type: ignore[method-assign]
        self._ops.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        # read before anything collects them: a class made in a forward dies with its call.
        # Only classes made inside a function count: a module imported lazily during the
        # forward (as transformers imports its integrations) defines its classes at the top
        self.defined = [
            c
            for c in _user_function_classes()
            if c not in self._known and "<locals>" in c.__qualname__
        ]
        self._ops.__exit__(None, None, None)
        for cls, own in reversed(self._patched):
            if own is None:
                del cls.apply
            else:
                cls.apply = own  # type: ignore[method-assign]
        self._patched.clear()

    def _apply_for(self, cls: type) -> Any:
        original = cls.__dict__.get("apply")
        original_apply = original.__func__ if isinstance(original, classmethod) else None

        def call_original(klass: type, *args: Any, **kwargs: Any) -> Any:
            if original_apply is not None:
                return original_apply(klass, *args, **kwargs)
            return super(cls, klass).apply(*args, **kwargs)  # type: ignore[misc]

        def apply(klass: type, *args: Any, **kwargs: Any) -> Any:
            tracer = proxy_tracer()
            if tracer is None or klass is not cls or self._inside:
                return call_original(klass, *args, **kwargs)
            return self._record(tracer, klass, call_original, args, kwargs)

        apply.__name__ = "apply"
        return apply

    def _record(self, tracer: Any, cls: type, call_original: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return self._record_call(
                tracer, cls, args, kwargs, lambda: call_original(cls, *args, **kwargs)
            )
        except Exception as error:
            raise FunctionNotCaptured(_not_captured(self.owner, cls, error)) from error

    def record_op(self, tracer: Any, op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        """Record one node for a call of the custom op ``op`` (:mod:`.custom_ops`)."""
        function = CustomOpFunction(op)
        try:
            return self._record_call(
                tracer, function, args, kwargs, lambda: function.apply(*args, **kwargs)
            )
        except Exception as error:
            raise CaptureError(_op_not_captured(self.owner, op, error)) from error

    def _record_call(
        self, tracer: Any, function: Any, args: tuple, kwargs: dict, run: Callable[[], Any]
    ) -> Any:
        """Run the call on the fake values (unrecorded, its writes into plain objects among
        its arguments undone) and record one node for it; its fake output."""
        self._inside = True
        try:
            with attributes_restored((args, kwargs)):
                call, out, proxies = traced_call(
                    tracer, function, AutocastState.now(), args, kwargs, run
                )
        finally:
            self._inside = False
        key = f"{_KEY_PREFIX}{next(self._count)}"
        self.calls[key] = call
        from torch.fx.experimental.proxy_tensor import track_tensor_tree

        proxy = tracer.create_proxy("call_function", _TRACED_TARGET, (key, *proxies), {})
        track_tensor_tree(out, proxy, constant=None, tracer=tracer)
        return out

    def refuse_fake_state(self) -> None:
        """Raise :class:`FakeStateKept` where, after the capture, a kept call's non-tensor
        argument holds a fake tensor (the model's code wrote it there after the call): the
        node would hand it to the call at run time, and its outputs would be fake."""
        for call in self.calls.values():
            if (found := fake_attribute(call.leaves)) is not None:
                obj, name = found
                raise FakeStateKept(
                    f"amp_graph could not capture {self.owner}: the {type(obj).__name__} "
                    f"passed to {call.name} holds a fake tensor in its attribute {name!r} "
                    "after the capture (the model's code stored a value the capture computed "
                    "there), and the graph would pass that object to the call at every run. "
                    "Fill such a cache on the first real call only (amp_graph undoes what "
                    "the call itself writes), or keep it in a module buffer."
                )


def traced_call(
    tracer: Any,
    function: Any,
    autocast: AutocastState,
    args: tuple,
    kwargs: dict,
    run: Callable[[], Any],
) -> tuple[FunctionCall, Any, list[Any]]:
    """Run a Function call on fake values without recording it (``run``, under
    ``autocast``): its :class:`FunctionCall`, its output and the proxies of its tensor
    inputs, for the caller to record one node with."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    with below_tracer(), autocast.entered():
        out = run()
    constants = [None if i in positions else leaf for i, leaf in enumerate(leaves)]
    proxies = [tracer.unwrap_proxy(leaves[i]) for i in positions]
    return FunctionCall(function, spec, constants, positions, autocast), out, proxies


class DynamoFunction:
    """A Function call as dynamo traced it: torch's ``autograd_function_apply`` of its
    forward and backward bodies, with ``apply`` as a Function class has it."""

    def __init__(self, forward: Any, backward: Any, options: dict, name: str) -> None:
        self.forward_body, self.backward_body, self.options = forward, backward, options
        self.__name__ = self.__qualname__ = name
        self.__module__ = "dynamo"

    def apply(self, *args: Any) -> Any:
        return _AUTOGRAD_FUNCTION_APPLY(
            self.forward_body, self.backward_body, *args, **self.options
        )


_AUTOGRAD_FUNCTION_APPLY = torch.ops.higher_order.autograd_function_apply
# torch.amp's decorators as dynamo inlines them: it traced them with autocast off, so their
# bodies hold none of the casts (cast_inputs) or states (custom_bwd) torch.autocast would give
_AMP_DECORATORS = ("in decorate_fwd", "in decorate_bwd")


class FunctionKeepingInterpreter(CastKeepingInterpreter):
    """The backend's retrace of dynamo's graph (:class:`CastKeepingInterpreter`), where each
    ``autograd_function_apply`` (a custom Function dynamo traced whole, forward and backward)
    becomes one node that runs it under ``autocast``, as :class:`kept_functions` records a
    Function under export, instead of its forward's ops traced without gradients."""

    def __init__(
        self, gm: fx.GraphModule, aliases: set[str], baked: set[str], autocast: AutocastState
    ) -> None:
        super().__init__(gm, aliases, baked)
        self.autocast = autocast

    def run_node(self, n: fx.Node) -> Any:
        self._node = n
        return super().run_node(n)

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        tracer = proxy_tracer()
        if tracer is not None and (op := user_custom_op(target, args, kwargs)) is not None:
            return self._keep_op(tracer, op, args, kwargs)
        if target is not _AUTOGRAD_FUNCTION_APPLY or tracer is None:
            return super().call_function(target, args, kwargs)
        forward, backward, *inputs = args
        where = _call_site(self._node)
        name = _defining_class(forward, backward) or _called_class(where) or "autograd_function"
        for body, decorator in zip((forward, backward), _AMP_DECORATORS, strict=True):
            if any(decorator in n.meta.get("stack_trace", "") for n in body.graph.nodes):
                raise CaptureError(_amp_decorated(name, where))
            if (read := _baked_dtype_read(body)) is not None:
                raise CaptureError(_baked(name, where, read))
        function = DynamoFunction(forward, backward, dict(kwargs), name)
        return self._keep(tracer, function, tuple(inputs), {}, f"{name} (as dynamo traced it)")

    def _keep_op(self, tracer: Any, op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        """One node that runs the custom op under ``autocast`` (:mod:`.custom_ops`)."""
        function = CustomOpFunction(op)
        return self._keep(tracer, function, args, kwargs)

    def _keep(
        self, tracer: Any, function: Any, args: tuple, kwargs: dict, shown: str | None = None
    ) -> Any:
        """Record one node that calls ``function.apply`` under ``autocast`` (its meta names
        it ``shown``, by default its :class:`FunctionCall`'s name); its fake output."""
        call, out, proxies = traced_call(
            tracer, function, self.autocast, args, kwargs, lambda: function.apply(*args, **kwargs)
        )
        from torch.fx.experimental.proxy_tensor import track_tensor_tree

        name = _snake(function.__name__)
        proxy = tracer.create_proxy("call_function", call, tuple(proxies), {}, name=name)
        proxy.node.meta[KEPT_FUNCTION] = (shown or call.name, self.autocast.describe())
        track_tensor_tree(out, proxy, constant=None, tracer=tracer)
        return out


def _baked_dtype_read(body: fx.GraphModule) -> fx.Node | None:
    """A ``.to(dtype)`` / ``.type(dtype)`` in a body that was a no-op as dynamo traced it
    (float32 to float32): the dtype may have been read from a tensor (``w.to(g.dtype)``),
    and dynamo baked in the float32 it saw, where autocast's run would read the low one."""
    for node in body.graph.nodes:
        if node.op not in ("call_method", "call_function") or not reads_target_dtype(node.target):
            continue
        args, kwargs = fx.node.map_aggregate(
            (node.args, node.kwargs),
            lambda a: a.meta.get("example_value") if isinstance(a, fx.Node) else a,
        )
        if is_noop_cast(node.target, tuple(args), dict(kwargs)):
            return node
    return None


def _baked(name: str, where: str, read: fx.Node) -> str:
    return (
        f"amp_graph's torch.compile backend cannot keep the custom autograd Function {name} "
        f"({where}): its code casts to a dtype it may read from a tensor "
        f"({_call_site(read) or read.name}), and dynamo traced that in float32, so the "
        "Function would compute in float32 where torch.autocast's run reads the low dtype. "
        "Use amp_graph.compile(model, ...) or amp_graph.Graph, which keep the Function whole "
        "and run its own code under autocast."
    )


def _call_site(node: fx.Node) -> str:
    """The model's line that called the Function (the last frame of the node's trace)."""
    lines = [ln.strip() for ln in node.meta.get("stack_trace", "").splitlines()]
    frames = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
    if not frames:
        return ""
    last = frames[-1]
    code = lines[last + 1] if last + 1 < len(lines) else ""
    return f"{lines[last]}: `{code}`"


def _defining_class(*bodies: fx.GraphModule) -> str | None:
    """The Function class whose ``forward`` or ``backward`` the bodies' ops came from: the
    file and line of their innermost frames, against each class's code."""
    frames = set()
    for body in bodies:
        for node in body.graph.nodes:
            found = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace", ""))
            if found:
                frames.add((found[-1][0], int(found[-1][1])))
    for cls in _user_function_classes():
        for method in ("forward", "backward"):
            code = getattr(inspect.unwrap(getattr(cls, method)), "__code__", None)
            if code is None:
                continue
            lines = [line for _, _, line in code.co_lines() if line is not None]
            if any(f == code.co_filename and line in lines for f, line in frames):
                return cls.__qualname__
    return None


def _called_class(where: str) -> str | None:
    found = re.findall(r"(\w+)\.apply\(", where)
    return found[-1] if found else None


def _amp_decorated(name: str, where: str) -> str:
    return (
        f"amp_graph's torch.compile backend cannot keep the custom autograd Function {name} "
        f"({where}): it is decorated with torch.amp.custom_fwd or custom_bwd, which dynamo "
        "traced with autocast off, so its graph would miss the casts and autocast states "
        "torch.autocast gives it (cast_inputs, the backward under the forward's autocast). "
        "Use amp_graph.compile(model, ...) or amp_graph.Graph, which keep the Function whole "
        "and run it under autocast as torch.autocast does."
    )


def _not_captured(owner: str, cls: type, error: BaseException) -> str:
    name = _qualified(cls)
    if name in _TORCH_FUNCTION_NAMES:
        return (
            f"amp_graph could not capture {owner}: DTensor's {_TORCH_FUNCTION_NAMES[name]} "
            f"failed on the capture's fake tensors ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}). DTensor's rules and the "
            "tracer disagree on this placement: report it (with the parallelize_module plan) "
            "to amp_graph. Meanwhile run this module under torch.autocast, or give it a "
            "plan whose outputs are Shard or Replicate placements."
        )
    failed = (
        f"amp_graph could not capture {owner}: the custom autograd Function {name} failed "
        f"when its forward ran on fake tensors ({_first_line(error)}). amp_graph keeps a "
        "Function whole (its own backward), but needs its output's shapes and dtypes from a "
        "run on fake tensors. "
    )
    if (qualname := op_without_fake(str(error))) is not None:
        return failed + needs_fake_message(qualname)
    return failed + (
        "Give the Function a fake implementation: wrap its kernel in a "
        "torch.library.custom_op with register_fake (as flash-attn does), or keep the "
        "Function out of the captured module."
    )


def _op_not_captured(owner: str, op: torch._ops.OpOverload, error: BaseException) -> str:
    failed = (
        f"amp_graph could not capture {owner}: the custom op {op._schema.name} failed on the "
        f"capture's fake tensors ({_first_line(error)}). "
    )
    if op_without_fake(str(error)) is not None:
        return failed + needs_fake_message(op._schema.name)
    return failed + (
        "Its register_fake function must run on fake tensors: it may read shapes and dtypes, "
        "not values."
    )


def _first_line(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _snake(name: str) -> str:
    """``StraightThroughRound`` -> ``straight_through_round``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def bind_functions(gm: fx.GraphModule, calls: dict[str, FunctionCall]) -> int:
    """Give each node :class:`kept_functions` recorded its :class:`FunctionCall` target.
    Returns how many nodes it bound."""
    bound = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not _TRACED_TARGET:
            continue
        key = node.args[0]
        if not (isinstance(key, str) and key in calls):
            continue
        node.target = calls[key]
        node.args = node.args[1:]
        # export named it after its target
        node._rename(_snake(node.target.__name__.removesuffix("_apply")))
        node.meta[KEPT_FUNCTION] = (node.target.name, node.target.autocast.describe())
        bound += 1
    if bound:
        gm.recompile()
    return bound


__all__ = [
    "AutocastState",
    "DynamoFunction",
    "FunctionCall",
    "FunctionKeepingInterpreter",
    "FunctionNotCaptured",
    "bind_functions",
    "function_calls",
    "is_function_call",
    "kept_functions",
]
