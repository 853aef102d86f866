"""Pass state_casts: the parameters and buffers a graph reads only through one narrowing cast.

A deployed model need not store such a tensor in float32 and cast it at every call: stored
already cast, it takes the bytes of the low dtype and the cast disappears. This pass finds
them; :mod:`amp_graph.deploy` stores them so.

Reads: ``get_attr`` nodes (the state the graph reads) and their users, which must be casts
in the form :func:`passes.aten_casts.cast_dtype` knows. Returns the result, changes nothing.
Guarantees: a tensor is listed only when every read of it, under every attribute path that
reaches it (tied weights: GPT-2's ``wte`` and ``lm_head``), is a cast to the same floating
dtype narrower than its own; so storing it cast gives every reader the bits it received.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .aten_casts import cast_dtype


@dataclass
class StateCasts:
    """``dtypes``: each such ``get_attr`` target and the dtype every reader casts it to;
    ``casts``: the cast nodes that read them."""

    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    casts: list[fx.Node] = field(default_factory=list)


def state_attribute(gm: fx.GraphModule, target: str) -> object:
    """What the ``get_attr`` target ``target`` reads from ``gm``."""
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def state_casts(gm: fx.GraphModule) -> StateCasts:
    """The state tensors read only through a cast to one narrower floating dtype."""
    reads: dict[int, list[fx.Node]] = defaultdict(list)  # by tensor: tied paths are one
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = state_attribute(gm, node.target)  # type: ignore[arg-type]
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                reads[id(value)].append(node)
    found = StateCasts()
    for nodes in reads.values():
        own = state_attribute(gm, nodes[0].target).dtype  # type: ignore[arg-type,union-attr]
        users = [user for node in nodes for user in node.users]
        dtypes = {cast_dtype(user) for user in users}
        if len(dtypes) != 1 or not users:
            continue
        (dtype,) = dtypes
        if dtype is None or not dtype.is_floating_point or dtype.itemsize >= own.itemsize:
            continue
        found.dtypes.update(dict.fromkeys((n.target for n in nodes), dtype))  # type: ignore[misc]
        found.casts.extend(users)
    return found
