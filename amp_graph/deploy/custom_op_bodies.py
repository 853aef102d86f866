"""Custom ops an exported program cannot run as torch.autocast runs them: refused by name.

An ExportedProgram holds ops, not autocast states: it calls a user's
``torch.library.custom_op`` with autocast off. Where that changes what the op computes (its
body's matmul runs in bfloat16 under torch.autocast, or its ``register_autocast`` rule casts
its inputs), the program would compute the op in float32, or fail on mixed bf16/float32
inputs, where the model under torch.autocast (and under ``amp_graph.compile``) computes it in
the low dtype. :func:`refuse_autocast_dependent_ops` finds such an op before the program is
made and says what to do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from amp_graph.capture.custom_ops import CustomOpFunction, is_functional
from amp_graph.capture.op_bodies import (
    MixedProduct,
    body_run,
    node_fake_inputs,
    products_under_autocast_and_off,
    user_op_calls,
)
from amp_graph.passes.meta import short


class AutocastDependentOp(RuntimeError):
    """A custom op computes other dtypes under torch.autocast than with it off."""


def refuse_autocast_dependent_ops(gm: fx.GraphModule, device_type: str, dtype: torch.dtype) -> None:
    """Raise :class:`AutocastDependentOp` for the first user custom op of ``gm`` whose output
    dtypes under ``torch.autocast(device_type, dtype)`` differ from its dtypes with autocast
    off, on the fake values the capture recorded, or whose body multiplies mixed float dtypes
    with autocast off. A body that cannot run on fake values is judged by the op's fake. An
    op that writes into its inputs (and returns nothing) is judged by the dtypes its body's
    products compute in.

    Guarantee: an op this lets through computes in the program what it computes under
    torch.autocast, as far as dtypes tell."""
    for node, op in user_op_calls(gm):  # only a user's op pays for the fake inputs
        args, kwargs = node_fake_inputs(node)
        if is_functional(op):
            with torch.autocast(device_type, dtype=dtype):
                under = _dtypes(CustomOpFunction(op).apply(*args, **kwargs))
            off = _dtypes_with_autocast_off(op, args, kwargs, device_type)
        else:  # it writes into its inputs: what its products compute in tells
            under, off = _products(op, args, kwargs, device_type, dtype)
        if under != off:
            raise AutocastDependentOp(_message(op, node, device_type, dtype, under, off))


def _products(
    op: torch._ops.OpOverload,
    args: tuple,
    kwargs: dict,
    device_type: str,
    dtype: torch.dtype,
) -> tuple[list[str] | None, list[str] | str | None]:
    """The dtypes an op's body computes its products in under torch.autocast and with it
    off (the error of a product on mixed inputs, there); None for both where its body cannot
    run on the fake values (nothing to tell from it)."""
    with torch.autocast(device_type, dtype=dtype):
        under, off = products_under_autocast_and_off(op, args, kwargs)
    return under, off if not isinstance(off, MixedProduct) else f"an error ({off})"


def _dtypes_with_autocast_off(
    op: torch._ops.OpOverload, args: tuple, kwargs: dict, device_type: str
) -> list[str] | str:
    """What the op computes with autocast off: its body's dtypes on the fake values where it
    has a body that runs on them (else its fake's), or the error of a product on mixed
    inputs, which only autocast's casts reconcile."""
    with torch.autocast(device_type, enabled=False):
        try:
            return _dtypes(body_run(op, args, kwargs)[0])
        except MixedProduct as error:
            return f"an error ({error})"
        except Exception:  # no body, or an opaque kernel: its fake says what it gives
            return _dtypes(op(*args, **kwargs))


def _dtypes(out: Any) -> list[str]:
    return [short(t.dtype) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _message(
    op: torch._ops.OpOverload,
    node: fx.Node,
    device_type: str,
    dtype: torch.dtype,
    under: list[str],
    off: list[str] | str,
) -> str:
    name, writes = op._schema.name, not is_functional(op)
    computes = "its products compute in" if writes else "it computes"
    way_out = (
        "or return the result instead of writing it into an argument and run the model "
        "through amp_graph.compile"
        if writes
        else "or run the model through amp_graph.compile"
    )
    if isinstance(off, list):
        off_text = f"{computes} {', '.join(off)}"
    else:  # the error of a product on mixed dtypes
        off_text = f"{'its body raises' if writes else 'it computes'} {off}"
    return (
        f"amp_graph.export cannot keep the custom op {name} (node {node.name}) as "
        f"torch.autocast runs it: under torch.autocast({device_type!r}, {short(dtype)}) "
        f"{computes} {', '.join(under)} (its body's ops or its register_autocast rule), with "
        f"autocast off {off_text}; an "
        "exported program calls it with autocast off. Make the op decide its own dtypes: "
        f"enter torch.autocast('{device_type}', dtype={dtype}) inside its body, "
        f"or cast its inputs there; {way_out}, which keeps the op under autocast."
    )


__all__ = ["AutocastDependentOp", "refuse_autocast_dependent_ops"]
