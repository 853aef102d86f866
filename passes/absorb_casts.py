"""Pass absorb_casts: a widening cast folded into the op that reads it, where the op takes a
``dtype=`` argument (``softmax(x.to(float32), -1)`` becomes ``softmax(x, -1, float32)``).

O1 computes softmax, log_softmax and sum in float32 (torch.autocast's CUDA list; a policy
may add mean), so it widens their bf16 or fp16 input with a cast of its own. These ops can
widen their input themselves: torch's ``dtype=`` argument is defined as the same cast
applied first. On a CPU torch then runs exactly that conversion inside the op (softmax
and log_softmax as an aten ``_to_copy`` of their own; the reductions inside their kernel),
so all six are absorbed there, with the cast's bits. On CUDA the op with ``dtype=`` is not
always the cast: an fp16 softmax (``half_to_float``) and a bf16 or fp16 ``sum``/``mean``
read the narrow input directly and accumulate in another order (other bits than the cast
from about 1000 elements a row on an H200). There the pass absorbs only the ops CUDA
autocast itself calls with ``dtype=float32`` (its ``FP32_SET_OPT_DTYPE`` list: softmax,
log_softmax, sum), so that the graph runs autocast's own kernels and bits; ``mean``, which
autocast leaves alone, keeps its cast. On other devices nothing is absorbed. The printed graph
shows the op with its ``dtype=`` and no cast before it.

Only a cast that is the op's input and nothing else's is absorbed: a cast shared by several
readers (one float32 copy for softmax and sum) stays one cast, rather than one per reader.

Reads: ``meta["amp"]`` (``role=CAST`` casts amp_graph inserted, their users' aten op).
Writes: the op's input and ``dtype`` argument; removes the cast; sets
``meta["amp"].cast_absorbed`` on the op. Guarantees: every op receives the same values in
the dtype it received them in before the pass, converted by the op itself (torch's
definition of ``dtype=``), with the same bits forward and backward as the cast on a
CPU, and as torch.autocast's own call on CUDA (:func:`absorbs`; the tests check the bits on a
CPU, and on CUDA where a GPU runs them); only widening casts amp_graph inserted are
absorbed, never the model's own casts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from amp_graph.policy import base_name
from amp_graph.policy.autocast_lists import CUDA_FP32_SET_OPT_DTYPE

from .meta import AMP, VAL, Role
from .result import PassResult

aten = torch.ops.aten

# ops whose ``dtype=`` argument casts their input before they compute (torch's
# native_functions.yaml: "the input tensor is casted to dtype before the operation") and
# whose backward then matches the cast's: the gradient reaches the narrow input through
# the same float32 computation and one rounding. Not ``cumsum``: its derivative
# (derivatives.yaml) casts the gradient down *before* the reverse cumulative sum, which then
# accumulates in bf16 (other bits; tests/test_absorb_casts.py keeps it out).
TAKES_DTYPE = frozenset(
    {
        aten.softmax.int,
        aten.log_softmax.int,
        aten.sum.default,
        aten.sum.dim_IntList,
        aten.mean.default,
        aten.mean.dim,
    }
)

# of those, the ones CUDA autocast itself calls with ``dtype=`` (its FP32_SET_OPT_DTYPE list,
# keyed by op as the policy's tables are)
CUDA_AUTOCAST_SETS_DTYPE = frozenset(
    op for op in TAKES_DTYPE if op._opname in {base_name(n) for n in CUDA_FP32_SET_OPT_DTYPE}
)

# of those, the ones whose dtype= is an aten ``_to_copy`` call of its own (composite ops);
# the reductions convert inside their kernel
CAST_BY_ATEN_CALL = frozenset({aten.softmax.int, aten.log_softmax.int})


def copies_input(op: torch._ops.OpOverload, narrow: Any) -> bool:
    """Whether ``op(x, dtype=...)`` makes a widened copy of its input ``narrow`` (a fake or real
    tensor) before computing: softmax and log_softmax do, through an aten ``_to_copy``, except
    CUDA's fp16 ones (one ``half_to_float`` kernel reads the fp16 input); reductions never do."""
    if op not in CAST_BY_ATEN_CALL:
        return False
    return not (narrow.device.type == "cuda" and narrow.dtype == torch.float16)


def absorbs(op: torch._ops.OpOverload, device: torch.device) -> bool:
    """Whether the pass gives ``op`` on ``device`` its input's widening cast as ``dtype=``:
    on a CPU every op of TAKES_DTYPE (the same conversion, the cast's bits); on CUDA those
    that CUDA autocast calls with ``dtype=`` itself (autocast's bits).

    >>> absorbs(aten.mean.default, torch.device("cpu"))
    True
    >>> cuda = torch.device("cuda")
    >>> absorbs(aten.mean.default, cuda), absorbs(aten.sum.default, cuda)
    (False, True)
    """
    if device.type == "cpu":
        return op in TAKES_DTYPE
    return device.type == "cuda" and op in CUDA_AUTOCAST_SETS_DTYPE


def _dtype_argument(op: torch._ops.OpOverload) -> tuple[int, bool]:
    """(position, keyword-only) of the op's ``dtype`` argument."""
    for position, argument in enumerate(op._schema.arguments):
        if argument.name == "dtype":
            return position, argument.kwarg_only
    raise ValueError(f"{op} has no dtype argument")


def _given_dtype(op_node: fx.Node) -> torch.dtype | None:
    position, kwarg_only = _dtype_argument(op_node.target)
    if kwarg_only or len(op_node.args) <= position:
        return op_node.kwargs.get("dtype")
    return op_node.args[position]


def _absorbable(cast: fx.Node) -> fx.Node | None:
    """The op that may take ``cast`` 's conversion as its ``dtype=``, or None."""
    amp = cast.meta.get(AMP)
    if amp is None or amp.role is not Role.CAST or cast.op != "call_method" or cast.kwargs:
        return None
    source, dtype = cast.args[0], cast.args[1]
    value = source.meta.get(VAL) if isinstance(source, fx.Node) else None
    widens = (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and isinstance(dtype, torch.dtype)
        and dtype.itemsize > value.dtype.itemsize
    )
    if not widens or len(cast.users) != 1:
        return None
    (op_node,) = cast.users
    if op_node.op != "call_function" or not absorbs(op_node.target, value.device):
        return None
    if op_node.args[0] is not cast or cast in op_node.args[1:] or cast in op_node.kwargs.values():
        return None
    return op_node if _given_dtype(op_node) in (None, dtype) else None


def absorb_casts(gm: fx.GraphModule) -> PassResult:
    """Fold each widening cast into the one op that reads it, where that op takes ``dtype=``.

    Stats: ``casts_absorbed`` and ``absorbed_cast_bytes`` (the float32 copies' bytes per
    call that the graph no longer makes itself).
    """
    count = nbytes = 0
    for cast in list(gm.graph.nodes):
        op_node = _absorbable(cast)
        if op_node is None:
            continue
        source, dtype = cast.args[0], cast.args[1]
        position, kwarg_only = _dtype_argument(op_node.target)
        if kwarg_only:
            op_node.kwargs = {**op_node.kwargs, "dtype": dtype}
            op_node.args = (source, *op_node.args[1:])
        else:
            defaults = [a.default_value for a in op_node.target._schema.arguments[:position]]
            args = [source, *op_node.args[1:]]
            args += defaults[len(args) :]
            op_node.args = (*args[:position], dtype, *op_node.args[position + 1 :])
        op_node.meta[AMP].cast_absorbed = True
        gm.graph.erase_node(cast)
        count += 1
        numel = source.meta[VAL].numel()
        nbytes += int(numel) * dtype.itemsize if isinstance(numel, int) else 0
    return PassResult(
        gm, modified=count > 0, stats={"casts_absorbed": count, "absorbed_cast_bytes": nbytes}
    )
