"""The driver: runs the passes in order, and says which one failed.

The graph comes flat: :func:`inline_regions` is part of the captured form (``rewrite``
runs it before it keeps the graph as captured), not a pass of the list.

Order: classify -> (fp8_linears, under an fp8 policy) -> assign_dtypes
-> (place_casts: ``Policy.place_casts``, where the default rule is ALLOW: O2) ->
(widen_parameters, given O2's low copies) -> low_extremes
-> insert_casts -> (cast_outputs: ``Policy.output_dtype``) -> simplify_casts -> verify
-> absorb_casts -> fsdp_hooks
-> fsdp_planned_reads (models sharded with FSDP2) -> outline_checkpoints -> recompute_casts
-> (shared_cast_gradients: ``Policy.cast_gradients_per_consumer``, the ``"autocast"`` preset).
With ``check_each_pass=True`` (the tests use it; ``compile``, the backend and ``Graph``
take the same flag) the verifier also runs after each pass up to
simplify_casts, so a pass that breaks an invariant is caught where it happens; the passes
after it change what the verifier checks (an absorbed cast's op takes its input narrow,
checkpoints move into submodules), and the graph is linted after each of them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from amp_graph.ops.recompute_cost import RecomputeCost
from amp_graph.policy import Policy, Rule

from .absorb_casts import absorb_casts
from .assign_dtypes import assign_dtypes
from .attribute_reads import read_attributes_directly
from .cast_outputs import cast_outputs
from .checkpoints import outline_checkpoints
from .classify import classify
from .fp8_linears import fp8_linears
from .fsdp_hooks import fsdp_hooks
from .fsdp_planned_reads import fsdp_planned_reads
from .insert_casts import insert_casts
from .low_extremes import low_extremes
from .meta import VAL, model_root
from .place_casts import place_casts
from .recompute_casts import recompute_casts
from .regions import region_left
from .result import PassResult
from .shared_cast_gradients import shared_cast_gradients
from .simplify_casts import simplify_casts
from .verify import verify
from .widen_parameters import widen_parameters

log = logging.getLogger(__name__)


class PassError(RuntimeError):
    """A pass failed; the message names it and the passes that ran before it."""


@dataclass
class PipelineResult:
    """The rewritten GraphModule, the summed pass counters, and seconds per pass."""

    graph_module: fx.GraphModule
    stats: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def amp_passes(
    policy: Policy,
    low_dtype: torch.dtype,
    check_each_pass: bool = False,
    recompute_cost: RecomputeCost | None = None,
    low_copies: Collection[torch.Tensor] = (),
    recompute_by_partitioner: bool = False,
    read_cost: RecomputeCost | None = None,
) -> list[tuple[str, Callable[[fx.GraphModule], PassResult]]]:
    """The pass list, bound to a policy and a dtype. The final verify always lints and checks
    that every planned input has its planned dtype; ``check_each_pass`` also re-propagates every
    dtype through the rewritten graph (as costly again as assign_dtypes: the tests use it).
    ``recompute_cost``: what recomputing a cast costs where the graph runs, for
    ``Policy(recompute_casts="auto")``; ``recompute_by_partitioner``: AOTAutograd compiles
    the graph, and ``"auto"`` leaves its casts to the partitioner (:func:`recompute_casts`).
    ``low_copies``: parameters the caller stores low as copies of float32 masters (O2 in a
    ``Graph``), of which the plan stores those it reads only in float32 in float32
    (:mod:`widen_parameters`). ``read_cost``: the same measurement, for
    ``Policy.cast_gradients_per_consumer`` (None: every consumer of a shared cast reads it;
    :func:`shared_cast_gradients`)."""
    passes: list[tuple[str, Callable[[fx.GraphModule], PassResult]]] = [
        ("classify", lambda gm: classify(gm, policy)),
    ]
    if policy.fp8 is not None:  # after classify: an fp32 override outranks fp8
        passes.append(("fp8_linears", lambda gm: fp8_linears(gm, policy.fp8, model_root(gm))))
    passes.append(("assign_dtypes", lambda gm: assign_dtypes(gm, low_dtype, policy.cast_inputs)))
    # only the default rule ALLOW leaves ops free to place (O2); reads the plan, costing
    # low copies as their masters
    if policy.place_casts and policy.default is Rule.ALLOW:
        passes.append(
            (
                "place_casts",
                lambda gm: place_casts(
                    gm, low_dtype, policy.cast_inputs, low_copies, policy.output_dtype
                ),
            )
        )
    if low_copies:  # reads the plan, the placement's too; before the casts, which follow it
        passes.append(
            (
                "widen_parameters",
                lambda gm: widen_parameters(gm, low_copies, low_dtype, policy.cast_inputs),
            )
        )
    # after the dtypes: it lowers float32's extremes where an op is planned low
    passes.append(("low_extremes", low_extremes))
    passes.append(("insert_casts", insert_casts))
    # before simplify_casts, which merges an output's cast with an op's cast of the value
    if policy.output_dtype is not None:
        passes.append(("cast_outputs", lambda gm: cast_outputs(gm, policy.output_dtype)))
    passes.append(("simplify_casts", simplify_casts))
    passes.append(("verify", lambda gm: verify(gm, propagate=check_each_pass)))
    # after verify, which checks each op's inputs against the plan: an absorbed cast's op
    # receives its input narrow, and widens it itself
    passes.append(("absorb_casts", absorb_casts))
    # after every dtype is settled (its calls run collectives: no pass may run the graph
    # after it); before the outlining, which then finds checkpoints inside units' regions
    passes.append(("fsdp_hooks", fsdp_hooks))
    # reads only: a warning where a parameter plan_fsdp gathers low is read wider
    passes.append(("fsdp_planned_reads", fsdp_planned_reads))
    # last: it moves checkpointed nodes into submodules, after every dtype is settled
    passes.append(("outline_checkpoints", outline_checkpoints))
    # after the outlining: a checkpointed block's casts are recomputed by its checkpoint
    passes.append(
        (
            "recompute_casts",
            lambda gm: recompute_casts(
                gm,
                policy.recompute_casts,
                recompute_cost,
                by_partitioner=recompute_by_partitioner,
            ),
        )
    )
    # last: the passes before it find a cast's consumers as its direct users
    if policy.cast_gradients_per_consumer:
        passes.append(("shared_cast_gradients", lambda gm: shared_cast_gradients(gm, read_cost)))
    return passes


def require_captured_graph(gm: fx.GraphModule) -> None:
    """The one IR the passes take: aten-level calls (``call_function``) with an example value
    (``meta["val"]``) on every placeholder and aten op, as amp_graph's captures make them
    (Python calls the capture records, ``torch._C.is_grad_enabled`` or ``getitem``, may have
    none: they compute no tensor the passes decide).

    The model's autocast and grad-mode blocks are already flat (:func:`inline_regions`).

    Raises:
        TypeError: for a torch-level graph (``call_module`` / ``call_method`` nodes, as
            ``torch.fx.symbolic_trace`` makes), a node without a value, or a block not yet
            flattened, saying what to do.
    """
    left = region_left(gm)
    if left is not None:
        raise TypeError(
            f"amp_graph's passes take the model's autocast and grad-mode blocks flattened; "
            f"node {left.name!r} ({left.target}) is one. Run amp_graph.passes.inline_regions "
            "on the graph first (amp_graph.frontends.compiler.rewrite does)."
        )
    for node in gm.graph.nodes:
        if node.op in ("call_module", "call_method"):
            raise TypeError(
                f"amp_graph's passes take an aten-level graph, as amp_graph's capture makes it; "
                f"node {node.name!r} is a {node.op} ({node.target}), a torch-level node. Pass "
                "the model, or this GraphModule, to amp_graph.compile: it captures it first."
            )
        aten_op = node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
        if (node.op == "placeholder" or aten_op) and VAL not in node.meta:
            raise TypeError(
                f"amp_graph's passes need an example value on every node (meta['val']); "
                f"{node.name!r} has none. Capture the model with amp_graph.compile, the "
                "torch.compile backend or Graph, which attach them."
            )


def run_passes(
    gm: fx.GraphModule,
    policy: Policy,
    low_dtype: torch.dtype,
    *,
    check_each_pass: bool = False,
    recompute_cost: RecomputeCost | None = None,
    low_copies: Collection[torch.Tensor] = (),
    recompute_by_partitioner: bool = False,
    read_cost: RecomputeCost | None = None,
) -> PipelineResult:
    """Run the AMP passes on ``gm`` (captured and flat, :func:`require_captured_graph`) in
    place and return it with the counters (``recompute_cost``, ``low_copies``,
    ``recompute_by_partitioner``, ``read_cost``: :func:`amp_passes`)."""
    require_captured_graph(gm)
    result = PipelineResult(gm)
    ran: list[str] = []
    passes = amp_passes(
        policy,
        low_dtype,
        check_each_pass,
        recompute_cost,
        low_copies,
        recompute_by_partitioner,
        read_cost,
    )
    for name, run in passes:
        start = time.perf_counter()
        try:
            out = run(gm)
            skip = (
                "verify",
                "fp8_linears",
                "absorb_casts",
                "fsdp_hooks",
                "fsdp_planned_reads",
                "outline_checkpoints",
                "recompute_casts",
                "shared_cast_gradients",
            )
            if check_each_pass and name not in skip:
                materialized = name in ("insert_casts", "cast_outputs", "simplify_casts")
                verify(gm, propagate=materialized, planned_inputs=materialized)
            elif check_each_pass:
                # these passes change what verify checks (an absorbed cast's op takes its
                # input narrow; outlined checkpoints move nodes): the graph is linted, and
                # the rewrite's own verify ran after simplify_casts
                gm.graph.lint()
        except Exception as error:
            before = ", ".join(ran) or "none"
            raise PassError(
                f"amp_graph pass {name!r} failed (passes run before it: {before}): "
                f"{type(error).__name__}: {error}"
            ) from error
        result.seconds[name] = time.perf_counter() - start
        for key, value in out.stats.items():
            result.stats[key] = result.stats.get(key, 0) + value
        ran.append(name)
    read_attributes_directly(gm.graph)
    gm.recompile()  # once, for all the passes (they edit the graph only)
    return result
