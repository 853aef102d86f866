"""What autocast changes in a custom op's body, read from a run of the body on fake values.

Under eager torch.autocast a ``torch.library.custom_op``'s Python body runs with autocast
on: its matmuls compute in the low dtype. Where amp_graph cannot give the op that state (an
op that writes into its inputs, an exported program), the body runs with autocast off, and
computes in float32, or fails on a bf16 activation times a float32 weight. The functions
here run the body on fake values under each state and say whether that changes what it
computes: :func:`body_products` lists the dtypes its products compute in, and
:class:`MixedProduct` is what a product on mixed float dtypes would raise (fake tensors let
it through).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from amp_graph.capture.capture_error import CaptureError
from amp_graph.capture.casts import below_tracer
from amp_graph.capture.custom_ops import body_of, is_functional, user_op
from amp_graph.passes.meta import short

# the ops autocast computes in the low dtype whose kernels refuse mixed float dtypes
PRODUCTS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.addmv.default,
    torch.ops.aten.convolution.default,
}


class MixedProduct(RuntimeError):
    """A product on floating inputs of two dtypes, which its kernel refuses."""


class _Products(TorchDispatchMode):
    """Records the dtype each product computes in; raises :class:`MixedProduct` where one
    gets floating inputs of two dtypes, as its kernel would."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func in PRODUCTS:
            floats = {
                t.dtype
                for t in pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t.is_floating_point()
            }
            if len(floats) > 1:
                names = ", ".join(sorted(short(d) for d in floats))
                raise MixedProduct(f"{func.__name__} on {names} inputs")
            self.dtypes.extend(short(d) for d in floats)
        return func(*args, **kwargs)


def body_run(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[Any, list[str]]:
    """The body's value on ``args`` under the current autocast state, and the dtypes its
    products computed in. Raises :class:`MixedProduct` for a product on mixed dtypes, and
    whatever the body raises on fake values (an opaque kernel)."""
    body = body_of(op, args, kwargs)
    if body is None:
        raise LookupError(f"{op._schema.name} has no Python body for these inputs' device")
    with _Products() as products:
        value = body(*args, **kwargs)
    return value, products.dtypes


def body_products(
    op: torch._ops.OpOverload, args: tuple, kwargs: dict
) -> list[str] | MixedProduct | None:
    """The dtypes the body's products compute in under the current autocast state; the
    error, where one multiplies mixed dtypes; None where the body cannot run on ``args``."""
    try:
        return body_run(op, args, kwargs)[1]
    except MixedProduct as error:
        return error
    except Exception:  # an opaque kernel (it reads values): nothing to tell from it
        return None


_DEVICE_TYPES = ("cpu", "cuda")


def products_under_autocast_and_off(
    op: torch._ops.OpOverload, args: tuple, kwargs: dict
) -> tuple[list[str] | None, list[str] | MixedProduct | None]:
    """:func:`body_products` under the current autocast state, and with autocast off on
    every device; (None, None) where the body cannot run on ``args`` (nothing to tell)."""
    under = body_products(op, args, kwargs)
    with contextlib.ExitStack() as off:
        for device in _DEVICE_TYPES:
            off.enter_context(torch.autocast(device, enabled=False))
        plain = body_products(op, args, kwargs)
    if not isinstance(under, list) or plain is None:
        return None, None
    return under, plain


def check_mutating_op(op: torch._ops.OpOverload, args: tuple, kwargs: dict, owner: str) -> None:
    """For a user's custom op that writes into its inputs, called during a capture under
    torch.autocast: such an op stays an op of the graph, which calls it with autocast off.
    Raise :class:`CaptureError` where its body would then multiply mixed dtypes (it would
    fail at run time); warn where its products would compute in other dtypes than under
    torch.autocast (float32 where autocast gives the low dtype)."""
    if not any(torch.is_autocast_enabled(d) for d in _DEVICE_TYPES):
        return
    with below_tracer():
        under, plain = products_under_autocast_and_off(op, args, kwargs)
    if under is None or under == plain:
        return
    name = op._schema.name
    where = (
        f"the custom op {name} writes into its inputs (mutates_args), so amp_graph keeps it "
        "as an op of the graph, and a graph calls its ops with autocast off: "
    )
    way_out = (
        "Return the result instead of writing it into an argument (amp_graph keeps a "
        "functional custom op under autocast), or enter torch.autocast inside its body."
    )
    if isinstance(plain, MixedProduct):
        raise CaptureError(
            f"amp_graph could not capture {owner}: {where}its body would fail ({plain}), "
            f"where torch.autocast casts its products' inputs. {way_out}"
        )
    warnings.warn(
        f"{owner}: {where}its products compute in {', '.join(plain)} where torch.autocast's "
        f"run computes them in {', '.join(under)}. {way_out}",
        stacklevel=2,
    )


def check_mutating_ops(gm: fx.GraphModule, autocast_entered: Callable[[], Any], owner: str) -> None:
    """:func:`check_mutating_op` for each call in ``gm`` of a user's op that writes into its
    inputs, on the fake values its nodes carry (the dtypes the plan gave them), under the
    autocast state ``autocast_entered()`` enters: for a graph captured without autocast (the
    backend's retrace of dynamo's trace), checked once the passes have decided its dtypes."""
    for node, op in user_op_calls(gm):
        if is_functional(op):
            continue
        args, kwargs = node_fake_inputs(node)
        mode = torch._guards.detect_fake_mode(pytree.tree_leaves((args, kwargs)))
        with mode or contextlib.nullcontext(), autocast_entered():
            check_mutating_op(op, args, kwargs, owner)


def user_op_calls(gm: fx.GraphModule) -> Iterator[tuple[fx.Node, torch._ops.OpOverload]]:
    """Each node of ``gm`` that calls a user's op as an op of the graph (not a kept call),
    with that op (:func:`~amp_graph.capture.custom_ops.user_op`)."""
    for node in gm.graph.nodes:
        # a graph's targets are overloads, which name their op without the arguments
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if (op := user_op(node.target, (), {})) is not None:
            yield node, op


def node_fake_inputs(node: fx.Node) -> tuple[tuple, dict]:
    """A node's arguments with each node replaced by its fake value (``meta["val"]``)."""

    def value(arg: Any) -> Any:
        return arg.meta.get("val") if isinstance(arg, fx.Node) else arg

    return fx.node.map_aggregate(node.args, value), fx.node.map_aggregate(node.kwargs, value)


__all__ = [
    "PRODUCTS",
    "MixedProduct",
    "body_products",
    "body_run",
    "check_mutating_op",
    "check_mutating_ops",
    "node_fake_inputs",
    "products_under_autocast_and_off",
    "user_op_calls",
]
