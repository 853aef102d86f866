"""widen_parameters: O2's low copies that the plan reads only in float32 are stored in float32.

Under O2 in a ``Graph`` the model's parameters are stored in the low dtype, each a copy of a
float32 master. A parameter whose every read the plan makes float32 (CLIP's
``logit_scale.exp()``, exp being on the float32 list; Mamba's ``A_log.float()``) gains
nothing stored low: it would be rounded before every read and save no cast. This pass finds
them in the plan and plans them stored in float32, so that the one capture serves: no second
capture once their storage changes.

Guarantees: a parameter among ``low_copies`` is widened only if every node that reads it
(tied weights: every one) has users, and each user, through views, is a cast to float32
(the model's own) or an op that computes in float32. The widened reads carry
``meta[STORED_DTYPE] = float32``, the plan is made again from them (:func:`assign_dtypes`:
their readers now take them without a cast; every other decision is the same, since each
reader already computed in float32), and ``gm.meta[WIDENED_PARAMETERS]`` lists their
targets. The module is not changed: whoever holds the low copies stores those in float32
before the graph runs (``amp_graph.training.step_builder`` gives them back their masters).

Runs after :mod:`assign_dtypes` (it reads the plan), before :mod:`insert_casts`.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.fx as fx

from . import schema
from .assign_dtypes import assign_dtypes
from .meta import AMP, STORED_DTYPE, WIDENED_PARAMETERS, Role
from .result import PassResult


def widen_parameters(
    gm: fx.GraphModule,
    low_copies: Collection[torch.Tensor],
    low_dtype: torch.dtype,
    cast_inputs: bool = False,
) -> PassResult:
    """Plan the ``low_copies`` that ``gm`` reads only in float32 stored in float32 (see the
    module docstring); ``low_dtype`` and ``cast_inputs`` are the plan's, for the re-plan."""
    reads = low_copy_reads(gm, low_copies)
    widened = [
        nodes
        for nodes in reads.values()
        if all(node.users and all(_reads_wide(user) for user in node.users) for node in nodes)
    ]
    for nodes in widened:
        for node in nodes:
            node.meta[STORED_DTYPE] = torch.float32
    if widened:  # their readers now take float32 without a cast
        assign_dtypes(gm, low_dtype, cast_inputs)
    gm.meta[WIDENED_PARAMETERS] = [nodes[0].target for nodes in widened]
    return PassResult(gm, bool(widened), {"parameters_widened": len(widened)})


def low_copy_reads(
    gm: fx.GraphModule, low_copies: Collection[torch.Tensor]
) -> dict[int, list[fx.Node]]:
    """The ``get_attr`` nodes that read each of ``low_copies`` (by the tensor's id: a tied
    weight's paths are one)."""
    wanted = {id(p) for p in low_copies}
    reads: dict[int, list[fx.Node]] = {}
    if not wanted:
        return reads
    for node in gm.graph.nodes:
        if node.op != "get_attr" or AMP not in node.meta:
            continue
        try:
            value = gm.get_parameter(node.target)  # type: ignore[arg-type]
        except AttributeError:
            continue  # a buffer or a constant
        if id(value) in wanted:
            reads.setdefault(id(value), []).append(node)
    return reads


def _reads_wide(node: fx.Node) -> bool:
    """``node`` reads its input in float32, directly or through views."""
    amp = node.meta.get(AMP)
    if amp is None:
        return False
    if amp.role is Role.USER_CAST:
        return amp.out_dtype == torch.float32
    if amp.role is Role.OP and schema.is_view(node):
        return bool(node.users) and all(_reads_wide(user) for user in node.users)
    return amp.role is Role.OP and amp.compute_dtype == torch.float32
