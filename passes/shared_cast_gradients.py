"""Pass shared_cast_gradients: a shared cast's consumers' gradients meet in the source's dtype.

The pipeline runs it where ``Policy.cast_gradients_per_consumer`` is True (the ``"autocast"``
preset's).

``simplify_casts`` lets every consumer of an activation read one cast of it (the Q, K and V
projections of one LayerNorm output read one bf16 copy), where torch.autocast casts once
per consumer. The forward computes the same bits either way, but the backward does not:
autograd sums the consumers' gradients where they meet, and at one shared copy they meet in
its dtype (bf16: two more roundings for three consumers), where autocast converts each one
to the source's dtype first and sums there (float32).

This pass puts :func:`amp_graph.ops.cast_reads.cast_read` between such a cast and each of
its consumers. Forward it is the cast itself (a view: no copy, nothing more held for
backward); backward it converts its consumer's gradient to the source's dtype and hands it
to the source, so the gradients sum where and in the order autocast's do.

Which casts: those amp_graph inserted (``role=CAST``; a cast the model's code wrote is
read as written, by autocast too), to a dtype (``x.to(d)`` or a recomputed cast; a float8
quantization has no gradient of its own), of a value computed in the graph or given to it
(a parameter's or buffer's cast is left shared: autocast caches those once per region, so
their gradients sum in the low dtype under autocast too; a graph input autocast would cache
as it caches a weight, a float32 leaf that requires grad, ``cast_read`` leaves shared when
it runs), with two or more consumers, none of which writes into the copy.

Reads: ``meta["amp"]`` (``role``; the sources' role). Writes: one ``cast_read`` node per
consumer of each such cast (``meta["amp"]`` ``role=RUNTIME``; ``meta["val"]`` the cast's,
where it has one), and the consumers' arguments. Guarantees: every forward value is the
same tensor values as before, and what backward keeps is the same storage. Runs last: the
passes before it find a cast's consumers as its direct users.
"""

from __future__ import annotations

import torch.fx as fx

from amp_graph.ops.cast_reads import cast_read

from .checkpoints import CHECKPOINT_PREFIX
from .meta import AMP, VAL, AmpInfo, Role, is_dtype_cast
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


def _give_reads(graph: fx.Graph) -> int:
    """A ``cast_read`` before each consumer of each shared activation cast of ``graph``;
    the number made."""
    reads = 0
    for cast in [node for node in graph.nodes if _shared_activation_cast(node)]:
        source = cast.args[0]
        for user in list(cast.users):
            if user.op == "output":  # returned as is: its gradient is the caller's
                continue
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
            reads += 1
    return reads


def shared_cast_gradients(gm: fx.GraphModule) -> PassResult:
    """Give each consumer of a shared activation cast its own :func:`cast_read`, so that its
    gradient reaches the source converted on its own, as under torch.autocast; in the graph
    and in its checkpointed blocks' submodules (``outline_checkpoints``), which backward
    runs again as they are.

    Stats: ``shared_cast_reads`` (the reads made; 0 where no cast is shared).
    """
    reads = _give_reads(gm.graph)
    for name, block in gm.named_children():
        if isinstance(block, fx.GraphModule) and name.startswith(CHECKPOINT_PREFIX):
            block_reads = _give_reads(block.graph)
            if block_reads:
                reads += block_reads
                block.recompile()  # the driver recompiles the top-level graph only
    return PassResult(gm, modified=reads > 0, stats={"shared_cast_reads": reads})
