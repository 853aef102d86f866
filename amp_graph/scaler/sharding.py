"""Which ranks must agree on a gradient check, and the collectives that make them agree.

A gradient is either a plain tensor, whose values this rank alone decides, or a DTensor
(FSDP2's ``fully_shard``, tensor parallelism), whose local shard is one piece of a tensor spread
over the groups of the mesh dimensions it is not replicated on. The scaler checks local shards
and reduces ``found_inf`` (MAX), and for clipping a sum of squares (SUM), over those groups;
nothing else triggers a collective.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from amp_graph.ops.dtensors import is_dtensor

Groups = tuple["dist.ProcessGroup", ...]


class Shard(NamedTuple):
    """A gradient as this rank sees it."""

    local: torch.Tensor  # the values this rank holds (a view: in-place writes reach the grad)
    groups: Groups  # groups of the mesh dimensions the gradient is not replicated on
    partial: bool  # some of those dimensions hold unreduced partial sums


def local_shard(grad: torch.Tensor) -> Shard:
    """A plain tensor is its own shard, agreed with nobody; a DTensor is its local tensor, to be
    agreed over the groups of the mesh dimensions whose placement is not ``Replicate`` (in mesh
    order)."""
    if not is_dtensor(grad):
        return Shard(grad, (), False)
    mesh = grad.device_mesh
    groups = tuple(
        mesh.get_group(dim) for dim, placement in enumerate(grad.placements)
        if not placement.is_replicate()
    )  # fmt: skip
    partial = any(placement.is_partial() for placement in grad.placements)
    with torch.no_grad():  # without autograd, to_local() is the local tensor itself
        return Shard(grad.to_local(), groups, partial)


def all_reduce_(tensor: torch.Tensor, groups: Groups, op: dist.ReduceOp.RedOpType) -> None:
    """All-reduce ``tensor`` in place over each group in turn.

    Reducing in turn over the groups of distinct dimensions of one mesh reduces over the whole
    sub-mesh, for SUM and MAX alike; MAX over any groups is the MAX over their union. A CPU
    tensor meets an NCCL-only group through a CUDA copy (NCCL takes no CPU tensors).
    """
    for group in groups:
        if tensor.device.type == "cpu" and dist.get_backend(group) == "nccl":
            on_gpu = tensor.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(on_gpu, op=op, group=group)
            tensor.copy_(on_gpu)
        else:
            dist.all_reduce(tensor, op=op, group=group)


def union(group_lists: list[Groups]) -> Groups:
    """The distinct groups of ``group_lists`` in order of first appearance (the same order on
    every rank that holds the same parameters, so collectives match up)."""
    seen: dict[int, dist.ProcessGroup] = {}
    for groups in group_lists:
        for group in groups:
            seen.setdefault(id(group), group)
    return tuple(seen.values())
