"""Pass shared_cast_gradients: a shared cast's consumers' gradients meet in the source's dtype.

The pipeline runs it where ``Policy.cast_gradients_per_consumer`` is True (the ``"autocast"``
preset's).

``simplify_casts`` lets every consumer of an activation read one cast of it (the Q, K and V
projections of one LayerNorm output read one bf16 copy), where torch.autocast casts once
per consumer. The forward computes the same bits either way, but the backward does not:
autograd sums the consumers' gradients where they meet, and at one shared copy they meet in
its dtype (bf16: two more roundings for three consumers), where autocast converts each one
to the source's dtype first and sums there (float32).

This pass gives each such consumer one of two things, both of which sum the gradients where
and in the order autocast's do:

* a cast of its own, as autocast gives it, where the copy is small: a native cast, whose
  bytes take less time to write than a read's Python (``RecomputeCost.max_own_cast_bytes``,
  measured once per device; up to about 300 KiB on a 2-vCPU EPYC), and nothing held that
  autocast does not hold;
* otherwise :func:`amp_graph.ops.cast_reads.cast_read` of the shared cast: forward the cast
  itself (a view: no copy, nothing more held for backward), backward its consumer's
  gradient converted to the source's dtype, handed to the source. Without a measured cost
  (a device amp_graph cannot time, a graph AOTAutograd compiles, or one replayed as CUDA
  graphs, which pay the read's host time once, at capture) every consumer reads.

Which casts: those amp_graph inserted (``role=CAST``; a cast the model's code wrote is
read as written, by autocast too), to a dtype (``x.to(d)`` or a recomputed cast; a float8
quantization has no gradient of its own), of a value computed in the graph or given to it
(a parameter's or buffer's cast is left shared: autocast caches those once per region, so
their gradients sum in the low dtype under autocast too; a graph input autocast would cache
as it caches a weight, a float32 leaf that requires grad, ``cast_read`` leaves shared when
it runs), with two or more consumers, none of which writes into the copy.

Reads: ``meta["amp"]`` (``role``; the sources' role), ``meta["val"]`` (the copy's bytes).
Writes: per consumer of each such cast but its first, a copy of the cast node before it
(``meta["amp"]`` ``role=CAST``, ``cast_for`` that consumer); or per consumer, a
``cast_read`` node (``role=RUNTIME``; ``meta["val"]`` the cast's, where it has one); and
the consumers' arguments. Guarantees: every forward value is the same tensor values as
before; what backward keeps is the same storage where consumers read, and autocast's (one
copy per consumer) where they cast. Runs last: the passes before it find a cast's consumers
as its direct users.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from amp_graph.ops.cast_reads import cast_read
from amp_graph.ops.recompute_cost import RecomputeCost

from .checkpoints import CHECKPOINT_PREFIX
from .meta import AMP, VAL, AmpInfo, Role, is_dtype_cast
from .recompute_casts import cast_copy_bytes, copy_dtype
from .result import PassResult
from .schema import written_inputs

__all__ = ["shared_cast_gradients"]


def _shared_activation_cast(node: fx.Node) -> bool:
    """A cast amp_graph made of a value the graph computes or takes, read by two or more
    consumers, none of which writes into it."""
    if not is_dtype_cast(node) or len(node.users) < 2:
        return False
    source = node.args[0]
    if not isinstance(source, fx.Node) or source.meta[AMP].role is Role.PARAM:
        return False
    return not any(node in written_inputs(user) for user in node.users)


def _own_casts_pay(cast: fx.Node, cost: RecomputeCost | None) -> bool:
    """Whether ``cast``'s consumers should each cast on their own: a plain cast (not
    recomputed in backward) whose copy is no larger than a read's host time writes."""
    if cost is None or cast.op != "call_method" or cast.meta[AMP].recompute:
        return False
    if cast.args[0].op == "placeholder":  # read: it shares what autocast would cache
        return False
    nbytes = cast_copy_bytes(cast.args[0], copy_dtype(cast))
    return nbytes is not None and nbytes <= cost.max_own_cast_bytes


def _give_own_casts(graph: fx.Graph, cast: fx.Node, consumers: list[fx.Node]) -> int:
    """A copy of ``cast`` before each of ``consumers``, which then read it instead: each
    one's gradient converts on its own, natively, as under autocast; the number made."""
    info = cast.meta[AMP]
    for user in consumers:
        with graph.inserting_before(user):
            own = graph.node_copy(cast)
        own.meta[AMP] = dataclasses.replace(
            info,
            cast_for=(user.name,),
            detail=f"{info.detail}; a cast of its own for {user.name}, as under autocast",
        )
        user.replace_input_with(cast, own)
    info.cast_for = tuple(user.name for user in cast.users)
    return len(consumers)


def _give_reads(graph: fx.Graph, cast: fx.Node, consumers: list[fx.Node]) -> int:
    """A ``cast_read`` before each of ``consumers``; the number made."""
    source = cast.args[0]
    for user in consumers:
        with graph.inserting_before(user):
            read = graph.call_function(cast_read, (source, cast))
        if VAL in cast.meta:
            read.meta[VAL] = cast.meta[VAL]
        read.meta[AMP] = AmpInfo.fixed(
            Role.RUNTIME,
            "cast_read",
            f"{cast.name} as {user.name} reads it: its gradient converted to the source's "
            "dtype on its own",
            out_dtype=cast.meta[AMP].out_dtype,
            module_path=user.meta[AMP].module_path,
        )
        user.replace_input_with(cast, read)
    return len(consumers)


def _per_consumer(graph: fx.Graph, cost: RecomputeCost | None) -> tuple[int, int]:
    """Each consumer of each shared activation cast of ``graph`` a cast of its own or a
    read; the (reads, own casts) made."""
    reads = own_casts = 0
    order = {node: index for index, node in enumerate(graph.nodes)}
    for cast in [node for node in graph.nodes if _shared_activation_cast(node)]:
        consumers = sorted((u for u in cast.users if u.op != "output"), key=order.__getitem__)
        returned = len(consumers) < len(cast.users)  # as is: its gradient is the caller's
        if _own_casts_pay(cast, cost):
            # the first consumer keeps the cast, unless the output shares it
            own_casts += _give_own_casts(graph, cast, consumers if returned else consumers[1:])
        else:
            reads += _give_reads(graph, cast, consumers)
    return reads, own_casts


def shared_cast_gradients(gm: fx.GraphModule, cost: RecomputeCost | None = None) -> PassResult:
    """Give each consumer of a shared activation cast a cast of its own (a copy ``cost``
    says is small) or its own :func:`cast_read`, so that its gradient reaches the source
    converted on its own, as under torch.autocast; in the graph and in its checkpointed
    blocks' submodules (``outline_checkpoints``), which backward runs again as they are.

    Stats: ``shared_cast_reads`` (the reads made) and ``shared_cast_own_casts`` (the casts
    added); 0 where no cast is shared.
    """
    reads, own_casts = _per_consumer(gm.graph, cost)
    for name, block in gm.named_children():
        if isinstance(block, fx.GraphModule) and name.startswith(CHECKPOINT_PREFIX):
            block_reads, block_casts = _per_consumer(block.graph, cost)
            if block_reads or block_casts:
                reads += block_reads
                own_casts += block_casts
                block.recompile()  # the driver recompiles the top-level graph only
    return PassResult(
        gm,
        modified=reads + own_casts > 0,
        stats={"shared_cast_reads": reads, "shared_cast_own_casts": own_casts},
    )
