"""Pass recompute_casts: what backward keeps of the casts (a decision, like a dtype).

The op that reads a cast keeps it for backward (``linear`` saves its bf16 weight copy), so
under torch.autocast every low-precision copy of a weight lives from the forward to the
backward: a fifth of what a GPT's forward keeps, and under FSDP2 the whole unsharded model
on every rank. This pass decides which casts backward makes again instead: those whose
source outlives the forward anyway, so that recasting costs one memory-bound cast and
keeping the source costs nothing:

* a parameter or buffer (``get_attr``, or a graph input dynamo lifted from the module:
  ``role=PARAM``; the module keeps it; under FSDP2 the unit's
  unsharded parameter, all-gathered again before the unit's backward);
* the result of an op whose backward saves its own result (:data:`SAVES_RESULT`: softmax's
  float32 probabilities, whose bf16 copy feeds the next matmul); at run time only where
  autograd recorded that op (else the copy is kept);
* a widening cast's source (bf16 or fp16 to float32: O1 upcasts a bf16 activation for a
  float32 op, and ``pow`` or ``group_norm`` saves the float32 copy): backward keeps the low
  source in the copy's place, half the bytes, and widens it again (exact: float32 holds
  every bf16 and fp16 value); at run time only where the source's storage is the smaller
  (not a view into a larger tensor). So an activation is not held in float32 and in bf16.

The model's own casts of such values (GPT-2's ``attn_weights.type(value.dtype)`` of its
float32 probabilities, under O1) are casts too, where they change only the dtype.

The fp8 policy's float8 copies of parameters (``fp8_quantize`` of a weight, which the fp8
linear saves) are casts too: they become :func:`amp_graph.ops.recompute_ops.recomputed_quantize`.

Where recomputing pays: a recompute costs fixed host time (recording the copy, the
saved-tensor hooks, the recast's dispatch) besides its bytes, so under
``Policy(recompute_casts="auto")`` (the default) a copy smaller than what the device casts
in that time is kept, and so is every copy of a graph where the hooks on all its saved
tensors would cost more than all its recasts' bytes take, and, largest first, every copy
whose recompute would take the graph's recomputes past 1% of its step, estimated from its
matmul FLOPs (:mod:`.matmul_flops`) at the device's matmul rate: the recast's bytes are
time torch.autocast, which keeps every copy, does not spend
(:class:`amp_graph.ops.recompute_cost.RecomputeCost`, measured once per device by the
entry point; every FSDP2 unit's cast is recomputed whatever its size). Where AOTAutograd
compiles the graph (``by_partitioner``), ``"auto"`` leaves every copy but an FSDP2 unit's to
its partitioner: a tagged cast there is a kernel of its own in the backward, and in the
forward a cast that no longer fuses with its neighbours, where the partitioner left alone
generates the kernels torch.compile generates under torch.autocast, one for one
(BENCHMARKS.md, "What inductor generates for the backend"). ``True`` decides every
candidate, an int those of at least that many bytes, ``False`` none.

Each decided cast becomes a call of :func:`amp_graph.ops.recompute_ops.recomputed_cast` (the same
cast, visible as such in the printed graph); :func:`amp_graph.ops.recompute_ops.install` 's hooks
on the GraphModule then keep its source instead of the copy, and where AOTAutograd
compiles the graph, torch's activation-checkpointing tags on the node tell its partitioner
the same. Gradients are bit-identical: a cast is deterministic.

Reads: ``meta["amp"]`` (casts: ``role=CAST`` or ``USER_CAST``; their sources' role and aten
op), the sources' ``meta["val"]`` (dtypes, bytes). Writes: the decided casts' target and
args; ``meta["amp"].recompute`` (why the source is kept: ``"module"``, ``"autograd"`` or
``"smaller"``) or, on a candidate it keeps, ``meta["amp"].recompute_declined`` (why);
``meta["recompute"]`` and ``meta["ac_graph_id"]`` (torch's keys).
Guarantees: every value is computed as before; only top-level casts change (a checkpointed
block's casts are recomputed by its checkpoint already); a graph input's cast is decided
only where it widens (the caller may free the input after the forward: keeping it costs no
more than the copy it replaces); no cast whose source the graph writes after the cast
reads it (the recast would read the new value), or whose copy it writes, is decided; nor
one whose source's storage outlives the call (a parameter, buffer or input, or a view of
one) and is written anywhere in the graph. A write before the read into a value the call
made (the in-place op that made it) is no obstacle: the recast reads what the cast read.
A write between the forward and the backward, outside the graph, is
``ModifiedSourceError`` at backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from amp_graph.ops.recompute_cost import STEP_SHARE, RecomputeCost, size_text
from amp_graph.ops.recompute_ops import (
    KEPT_BY_AUTOGRAD,
    KEPT_BY_MODULE,
    KEPT_SMALLER,
    recomputed_cast,
    recomputed_quantize,
)

from .matmul_flops import forward_matmul_flops
from .meta import AMP, FSDP_UNIT, VAL, Role, is_dtype_cast, size_hint
from .result import PassResult
from .sharing import CastSharing

# aten ops whose derivative formula reads ``result`` (torch's derivatives.yaml): backward
# keeps their output whenever autograd records them.
SAVES_RESULT = frozenset(
    {
        "aten::softmax",  # composite: runs _softmax, whose output is its own
        "aten::_softmax",
        "aten::log_softmax",
        "aten::_log_softmax",
        "aten::exp",
        "aten::tanh",
        "aten::sigmoid",
        "aten::sqrt",
        "aten::rsqrt",
        "aten::relu",
    }
)


def _kept_by(source: fx.Node) -> str | None:
    """Why ``source`` outlives the forward, or None."""
    role = source.meta[AMP].role
    if role is Role.PARAM and source.op in ("get_attr", "placeholder"):  # read, or lifted
        return KEPT_BY_MODULE
    target = source.target
    saves_result = isinstance(target, torch._ops.OpOverload) and (
        target._schema.name in SAVES_RESULT
    )
    if source.op == "call_function" and saves_result:
        return KEPT_BY_AUTOGRAD
    return None


def _is_parameter_quantization(node: fx.Node) -> bool:
    """An fp8 policy's ``fp8_quantize`` of a parameter (its float8 copy, which the fp8 linear
    saves for backward): a cast too."""
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target._schema.name == "amp_graph::fp8_quantize"
        and isinstance(node.args[0], fx.Node)
        and _kept_by(node.args[0]) == KEPT_BY_MODULE
    )


_MODEL_CASTS = ("aten::to", "aten::_to_copy")


def _model_cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype of a cast the model wrote that changes only the dtype of a floating value
    (``x.to(torch.bfloat16)``, ``x.type_as(y)`` as captured), where it does change it;
    else None (a no-op ``.to()`` returns its input: no copy to keep)."""
    target = node.target
    if node.meta[AMP].role is not Role.USER_CAST or not isinstance(target, torch._ops.OpOverload):
        return None
    if target._schema.name not in _MODEL_CASTS:
        return None
    if target._schema.name == "aten::to" and target._overloadname == "dtype":
        dtype, extra = (node.args[1] if len(node.args) > 1 else None), node.args[2:]
    elif target._schema.name == "aten::_to_copy" and len(node.args) == 1:
        dtype, extra = node.kwargs.get("dtype"), ()
    else:
        return None
    others = {k: v for k, v in node.kwargs.items() if k != "dtype"}
    source = node.args[0].meta.get(VAL) if isinstance(node.args[0], fx.Node) else None
    if any(extra) or any(v not in (None, False) for v in others.values()):
        return None  # non_blocking, copy, layout, device, memory_format: not just a dtype
    if not isinstance(source, torch.Tensor) or not isinstance(dtype, torch.dtype):
        return None
    if not source.is_floating_point() or source.dtype == dtype:
        return None
    return dtype


def _recast_of(node: fx.Node) -> tuple[Any, torch.dtype] | None:
    """(source, dtype) of a cast this pass may decide: one amp_graph inserted
    (``x.to(dtype)``), or one the model wrote that changes only the dtype."""
    if is_dtype_cast(node) and node.op == "call_method" and not node.kwargs:
        return node.args[0], node.args[1]
    dtype = _model_cast_dtype(node)
    return None if dtype is None else (node.args[0], dtype)


def copy_dtype_of(target: Any, args: tuple) -> torch.dtype:
    """The dtype of the copy a decided call makes, from its target and arguments."""
    return args[2] if target is recomputed_quantize else args[1]


def copy_dtype(node: fx.Node) -> torch.dtype:
    """The dtype of the copy a decided node makes (its recipe's target dtype)."""
    return copy_dtype_of(node.target, node.args)


def _widens(source: Any, dtype: torch.dtype) -> bool:
    """``source.to(dtype)`` is a floating upcast (bf16 or fp16 to float32): exact."""
    value = source.meta.get(VAL) if isinstance(source, fx.Node) else None
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and dtype.is_floating_point
        and dtype.itemsize > value.dtype.itemsize
    )


def _freed_bytes(cast: fx.Node) -> int:
    """Bytes backward no longer holds for one decided cast: its copy's, less its source's
    where the source is kept only in the copy's place (``"smaller"``)."""
    value, dtype = cast.args[0].meta.get(VAL), copy_dtype(cast)
    if not isinstance(value, torch.Tensor) or not isinstance(dtype, torch.dtype):
        return 0
    numel = value.numel()
    if not isinstance(numel, int):
        return 0
    kept = value.dtype.itemsize if cast.meta[AMP].recompute == KEPT_SMALLER else 0
    return int(numel) * (dtype.itemsize - kept)


def _mark_recompute(node: fx.Node, kept_by: str) -> None:
    """The decision, for amp_graph's report and for AOTAutograd: torch's own activation
    checkpointing keys (copied onto the nodes AOTAutograd traces from this one), so that
    where the graph is compiled its partitioner recomputes the cast too."""
    node.meta[AMP].recompute = kept_by
    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    node.meta["ac_graph_id"] = 0


def _written_after_the_cast(gm: fx.GraphModule, casts: list[fx.Node]) -> set[fx.Node]:
    """The casts whose source the graph writes after the cast reads it (backward would
    recast the new value), or whose copy it writes. A write before the read into a value
    the call made (the in-place op that made it: BERT's ``embeddings += ...``) is no
    obstacle; a write anywhere into a storage that outlives the call (a parameter, a
    buffer, a graph input, or a view of one) is: the next call writes it again, maybe
    before this call's backward."""
    if not casts:
        return set()
    wanted, sharing = set(casts), CastSharing(gm)
    at_cast: dict[fx.Node, tuple[int, int]] = {}  # versions of (source, copy) at the cast
    for node in gm.graph.nodes:
        source_version = sharing.key(node.args[0])[1] if node in wanted else 0
        sharing.visit(node)
        if node in wanted:
            at_cast[node] = (source_version, sharing.key(node)[1])
    unsafe = set()
    for cast, versions in at_cast.items():
        root = sharing.root(cast.args[0])
        outlives_the_call = root.op in ("placeholder", "get_attr")
        if (sharing.key(cast.args[0])[1], sharing.key(cast)[1]) != versions or (
            outlives_the_call and sharing.key(root)[1]
        ):
            unsafe.add(cast)
    return unsafe


def cast_copy_bytes(source: Any, dtype: torch.dtype) -> int | None:
    """Bytes of ``source`` cast to ``dtype`` (symbolic sizes at their example's hint), or None."""
    value = source.meta.get(VAL) if isinstance(source, fx.Node) else None
    if not isinstance(value, torch.Tensor) or not isinstance(dtype, torch.dtype):
        return None
    numel = size_hint(value.numel())
    return None if numel is None else numel * dtype.itemsize


def _saved_tensor_estimate(gm: fx.GraphModule) -> int:
    """About how many tensors autograd saves in the forward: one per aten op with a floating
    result that is not a view (a linear saves two, an add or a view none)."""
    count = 0
    for node in gm.graph.nodes:
        target, value = node.target, node.meta.get(VAL)
        if not (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)):
            continue
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            count += not target.is_view
    return count


def _declined(
    candidates: list[tuple[fx.Node, int | None, bool]],
    enabled: bool | str | int,
    cost: RecomputeCost | None,
    saved_tensors: int,
    by_partitioner: bool = False,
    step_flops: float = 0.0,
) -> dict[fx.Node, str]:
    """The candidates (node, copy bytes, in an FSDP2 unit) backward keeps, each with why.

    ``True``, or ``"auto"`` without a cost: none. ``"auto"`` ``by_partitioner``: every one
    outside an FSDP2 unit (AOTAutograd's partitioner decides). An int: copies below that
    many bytes.
    ``"auto"``: copies below ``cost.min_copy_bytes``; then every one, where the hooks on
    the forward's ``saved_tensors`` would cost more host time than the recasts spend on
    their bytes (:meth:`RecomputeCost.hooks_pay`); then, largest first, those that would
    take the recomputes past :data:`STEP_SHARE` of a step of ``step_flops`` (forward and
    backward) at the measured matmul rate. An FSDP2 unit's casts are never
    declined: their sources are the unit's unsharded parameters, and keeping the copies
    would hold the whole unsharded model on every rank."""
    if enabled == "auto" and by_partitioner:
        return {node: _PARTITIONER for node, _, in_unit in candidates if not in_unit}
    if enabled is True or (enabled == "auto" and cost is None):
        return {}
    if isinstance(enabled, int):
        minimum = enabled
        why = f"its copy ({{size}}) is below Policy(recompute_casts={enabled})'s minimum."
    else:
        assert cost is not None
        minimum = cost.min_copy_bytes
        why = (
            f"its copy ({{size}}) is below the {size_text(minimum)} where recomputing "
            f"pays ({cost.describe()})." + _ANYWAY
        )
    declined = {
        node: why.format(size=size_text(nbytes))
        for node, nbytes, in_unit in candidates
        if not in_unit and nbytes is not None and nbytes < minimum
    }
    if enabled != "auto" or cost is None or any(in_unit for *_, in_unit in candidates):
        return declined  # (in an FSDP2 model the hooks run for the units' casts anyway)
    left = [(node, nbytes or 0) for node, nbytes, _ in candidates if node not in declined]
    total = sum(nbytes for _, nbytes in left)
    if left and not cost.hooks_pay(saved_tensors, len(left), total):
        why = (
            f"recomputing the {len(left)} casts of this graph above that size "
            f"({size_text(total)}) would cost more host time, with the saved-tensor hooks "
            f"on its ~{saved_tensors} saved tensors, than their bytes take to cast "
            f"({cost.describe()}): it keeps every copy and runs no hook." + _ANYWAY
        )
        declined.update((node, why) for node, _ in left)
        return declined
    declined.update(_past_the_step_share(left, cost, saved_tensors, step_flops))
    return declined


def _past_the_step_share(
    left: list[tuple[fx.Node, int]], cost: RecomputeCost, saved_tensors: int, step_flops: float
) -> dict[fx.Node, str]:
    """The copies, largest first, whose recompute would take the graph's recomputes past
    :data:`STEP_SHARE` of its step (estimated from ``step_flops``): where the GEMMs are
    short, the recasts' bytes show in the step, and torch.autocast pays none of them."""
    step_ns = cost.step_ns(step_flops)
    if step_ns is None:
        return {}
    why = (
        f"recomputing it as well would take this graph's recomputes past {STEP_SHARE:.0%} "
        f"of its step, estimated at {step_ns / 1e6:.2f} ms from its "
        f"{step_flops / 1e9:.2f} GFLOP of matrix products, forward and backward "
        f"({cost.describe()})." + _ANYWAY
    )
    casts = copy_bytes = 0
    past: dict[fx.Node, str] = {}
    for node, nbytes in sorted(left, key=lambda item: -item[1]):
        if cost.within_step_share(saved_tensors, casts + 1, copy_bytes + nbytes, step_ns):
            casts, copy_bytes = casts + 1, copy_bytes + nbytes
        else:
            past[node] = why
    return past


_ANYWAY = " Policy(recompute_casts=True) recomputes every such cast."
_PARTITIONER = (
    "AOTAutograd compiles this graph: its partitioner decides whether backward keeps the copy "
    "or casts again, as it does for torch.compile under torch.autocast (a recompute forced "
    "here would be a kernel of its own in the backward, and would keep the cast from fusing "
    "in the forward)." + _ANYWAY
)


def recompute_casts(
    gm: fx.GraphModule,
    enabled: bool | str | int = True,
    cost: RecomputeCost | None = None,
    *,
    by_partitioner: bool = False,
) -> PassResult:
    """Make the casts whose source outlives the forward recomputed in backward, where it
    pays.

    ``enabled`` is ``Policy.recompute_casts``: ``False`` decides none (backward keeps every
    copy, as torch.autocast does); ``True`` every one it may; an int, those whose copy has
    at least that many bytes; ``"auto"``, those :class:`RecomputeCost` says pay on the
    device, ``cost`` (None: every one), or where AOTAutograd compiles the graph
    (``by_partitioner``) none: its partitioner decides. An FSDP2 unit's casts are
    recomputed whatever the size. The casts it could have recomputed and keeps carry why in
    ``meta["amp"].recompute_declined``.

    Stats: ``casts_recomputed`` and ``recomputed_cast_bytes`` (per call, the bytes backward
    no longer holds: the copies', less the low sources kept in the place of widened copies);
    ``casts_recompute_declined``.
    """
    if enabled is False:
        return PassResult(gm, modified=False, stats={"casts_recomputed": 0})
    candidates: list[tuple[fx.Node, str, Any, tuple, dict]] = []
    for node in gm.graph.nodes:
        if _is_parameter_quantization(node):
            source, kept_by = node.args[0], KEPT_BY_MODULE
            target, args, kwargs = recomputed_quantize, node.args, dict(node.kwargs)
        elif (recast := _recast_of(node)) is not None:
            source, dtype = recast
            kept_by = _kept_by(source) if isinstance(source, fx.Node) else None
            if kept_by is None and _widens(source, dtype):
                kept_by = KEPT_SMALLER
            target, args, kwargs = recomputed_cast, (source, dtype, kept_by), {}
        else:
            continue
        if kept_by is not None:
            candidates.append((node, kept_by, target, args, kwargs))
    unsafe = _written_after_the_cast(gm, [node for node, *_ in candidates])
    candidates = [candidate for candidate in candidates if candidate[0] not in unsafe]
    weighed = enabled == "auto" and cost is not None and not by_partitioner
    declined = _declined(
        [
            (node, cast_copy_bytes(args[0], copy_dtype_of(target, args)), _in_fsdp_unit(args[0]))
            for node, _, target, args, _ in candidates
        ],
        enabled,
        cost,
        _saved_tensor_estimate(gm) if weighed else 0,
        by_partitioner,
        # forward and backward: each product's two gradients cost what it did
        3 * forward_matmul_flops(gm) if weighed else 0.0,
    )
    count = nbytes = 0
    for node, kept_by, target, args, kwargs in candidates:
        if node in declined:
            node.meta[AMP].recompute_declined = declined[node]
            continue
        node.op, node.target, node.args, node.kwargs = "call_function", target, args, kwargs
        _mark_recompute(node, kept_by)
        count += 1
        nbytes += _freed_bytes(node)
    stats = {
        "casts_recomputed": count,
        "recomputed_cast_bytes": nbytes,
        "casts_recompute_declined": len(declined),
    }
    return PassResult(gm, modified=count > 0, stats=stats)


def _in_fsdp_unit(source: Any) -> bool:
    return isinstance(source, fx.Node) and source.meta.get(FSDP_UNIT) is not None
