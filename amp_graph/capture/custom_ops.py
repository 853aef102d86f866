"""``torch.library.custom_op`` calls kept as one node that runs under torch.autocast.

Eager ``torch.autocast`` leaves a custom op's inputs as they come (unless
``torch.library.register_autocast`` casts them), and its Python body runs with autocast
on: an ``a @ w.t()`` inside computes in the low dtype. A captured graph runs with no
autocast state, so the op would compute in float32, or fail on mixed inputs. The capture
therefore keeps a user's custom op the way it keeps a custom autograd Function
(:mod:`amp_graph.capture.autograd_functions`): :class:`CustomOpFunction` gives the op the
``apply`` a Function class has, and the node calls it under the autocast state the
capture saw.

Only functional ops of the user's (outside torch and amp_graph) with a Python body are kept:
made with ``torch.library.custom_op``, or defined with ``torch.library.Library`` and given a
Python kernel (:mod:`.library_ops`). An op that writes into its inputs keeps its aten-style
node, which the passes read from its schema.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from amp_graph.capture.library_ops import has_python_kernel, is_library_op, library_kernel

log = logging.getLogger(__name__)

_OWN_PACKAGES = ("torch", "amp_graph")


def user_custom_op(func: Any, args: tuple, kwargs: dict) -> torch._ops.OpOverload | None:
    """The overload ``func`` calls, where it is a functional ``torch.library.custom_op`` of
    the user's (defined outside torch and amp_graph), else None."""
    op = user_op(func, args, kwargs)
    return op if op is not None and is_functional(op) else None


def is_functional(op: torch._ops.OpOverload) -> bool:
    """``op`` writes into none of its inputs and returns no alias of one."""
    schema = op._schema
    return not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


def user_op(func: Any, args: tuple, kwargs: dict) -> torch._ops.OpOverload | None:
    """The overload ``func`` calls, where it is a user's op (defined outside torch and
    amp_graph) with a Python body: a ``torch.library.custom_op``, or an op defined with
    ``torch.library.Library`` and a Python kernel (:mod:`.library_ops`); functional or not.
    Else None."""
    op = func
    if isinstance(func, torch._ops.OpOverloadPacket):
        qualname = func._qualified_op_name.replace(".", "::", 1)
        if op_definition(qualname) is None and not is_library_op(qualname):
            return None  # resolving an aten packet on every call would cost the capture
        op = getattr(func, torch._C._jit_resolve_packet(func._qualified_op_name, *args, **kwargs))
    if not isinstance(op, torch._ops.OpOverload):
        return None
    if op_definition(op._schema.name) is None and not has_python_kernel(op):
        return None
    return op


def op_definition(qualname: str) -> Any:
    """The ``CustomOpDef`` of a user's op (torch's registry of them), else None."""
    from torch._library.custom_ops import OPDEFS

    definition = OPDEFS.get(qualname)
    module = getattr(getattr(definition, "_init_fn", None), "__module__", None) or ""
    if definition is None or module.split(".")[0] in _OWN_PACKAGES:
        return None
    return definition


class CustomOpFunction:
    """A custom op with ``apply`` as a Function class has it (what
    :class:`~amp_graph.capture.autograd_functions.FunctionCall` calls), named
    ``namespace.op``.

    On real tensors ``apply`` calls the op. On fake tensors it gives the value eager
    autocast would: the op's fake (``register_fake``, after ``register_autocast``'s casts),
    with the dtypes of the op's body run on the fake values under the current autocast
    state where the body can run on them, since a fake written without autocast in mind
    (``a.new_empty(...)`` for an ``a @ w.t()``) would give float32 where the body computes
    in the low dtype."""

    def __init__(self, op: torch._ops.OpOverload) -> None:
        self.op = op
        namespace, name = op._schema.name.split("::", 1)
        if op._overloadname != "default":
            name = f"{name}_{op._overloadname}"
        self.__module__, self.__name__, self.__qualname__ = namespace, name, name

    def apply(self, *args: Any, **kwargs: Any) -> Any:
        out = self.op(*args, **kwargs)
        leaves = pytree.tree_leaves((args, kwargs))
        if not any(isinstance(leaf, FakeTensor) for leaf in leaves):
            return out
        return _with_body_dtypes(self.op, args, kwargs, out)


def _with_body_dtypes(op: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any) -> Any:
    """``out`` (the op's fake), or the body's value on the same fakes where its tensors
    have the same shapes and other dtypes. An op with its own autocast rule keeps ``out``:
    the body runs on the inputs that rule casts, which ``out`` already had."""
    autocast_key = _AUTOCAST_KEYS.get(_device_type(args, kwargs), "")
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), autocast_key):
        return out
    body = body_of(op, args, kwargs)
    if body is None:
        return out
    try:
        with _unbacked_ignored(args, kwargs):
            computed = body(*args, **kwargs)
    except Exception as error:  # an opaque kernel: it reads no autocast state either
        log.debug("the body of %s does not run on fake values: %s", op, error)
        return out
    return computed if _same_shapes_other_dtypes(out, computed) else out


def _device_type(args: tuple, kwargs: dict) -> str:
    leaves = pytree.tree_leaves((args, kwargs))
    return next((t.device.type for t in leaves if isinstance(t, torch.Tensor)), "cpu")


def body_of(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """The Python body of the user's op ``op`` for the device of its tensors (a custom op's
    function, a ``torch.library.Library`` op's Python kernel), or None."""
    definition, device_type = op_definition(op._schema.name), _device_type(args, kwargs)
    if definition is None:
        return library_kernel(op, device_type)
    bodies = definition._backend_fns
    return bodies.get(device_type, bodies.get(None))


def _unbacked_ignored(args: tuple, kwargs: dict) -> Any:
    """While the body runs for its dtypes only: sizes it reads from values (``offs.tolist()``
    in transformers' grouped matmul) make unbacked symbols that no output returns, which the
    tracer would otherwise refuse at the op's end. The op's own fake gives the shapes."""
    mode = torch._guards.detect_fake_mode(pytree.tree_leaves((args, kwargs)))
    shape_env = getattr(mode, "shape_env", None)
    if shape_env is None:
        return contextlib.nullcontext()
    return shape_env.ignore_fresh_unbacked_symbols()


def _same_shapes_other_dtypes(out: Any, computed: Any) -> bool:
    """``computed`` has ``out``'s structure and tensor shapes, and some other dtype."""
    mine, spec = pytree.tree_flatten(out)
    theirs, their_spec = pytree.tree_flatten(computed)
    if spec != their_spec:
        return False
    pairs = [(a, b) for a, b in zip(mine, theirs, strict=True) if isinstance(a, torch.Tensor)]
    if not all(isinstance(b, torch.Tensor) and a.shape == b.shape for a, b in pairs):
        return False
    return any(a.dtype != b.dtype for a, b in pairs)


_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}

# torch's message for an op without a fake kernel names its CustomOpDef
_NO_FAKE = re.compile(r"no fake impl registered for <CustomOpDef\(([\w.:]+)\)>")


def op_without_fake(text: str) -> str | None:
    """The qualified name (``ns::op``) of the custom op an error says has no fake
    implementation, else None."""
    found = _NO_FAKE.search(text)
    return found.group(1) if found else None


def needs_fake_message(qualname: str) -> str:
    """How to give a custom op what a capture needs: its output's shapes and dtypes."""
    return (
        f"The custom op {qualname} has no fake (meta) implementation, which a capture needs "
        "to know its output's shapes and dtypes without running it. Register one: "
        f'@torch.library.register_fake("{qualname}") on a function that returns empty '
        "tensors of the output's shapes and dtypes (torch.compile needs it as well)."
    )


__all__ = [
    "CustomOpFunction",
    "body_of",
    "is_functional",
    "needs_fake_message",
    "op_definition",
    "op_without_fake",
    "user_custom_op",
    "user_op",
]
