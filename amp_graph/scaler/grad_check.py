"""Gradient check and unscale (one job: an optimizer's gradients -> ``found_inf``).

:class:`GradientCheck` gathers an optimizer's gradients (local shards of DTensors, values of
sparse gradients), runs the fused ``amp_graph`` op on each (device, shard groups) partition, and
returns ``found_inf``: 1.0 when any element, on this rank or on a rank it must agree with, is
inf or nan. Ranks agree over the groups of sharded gradients (automatic) and over
``process_group`` (when given); never otherwise.

It is amp_graph's one gradient checker: :class:`~amp_graph.scaler.GradScaler` uses it to
unscale, and :class:`~amp_graph.scaler.nonfinite_guard.NonFiniteGuard` (steps that scale no
loss: bfloat16, float32) to check only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from amp_graph.ops import scaler_ops as ops
from amp_graph.scaler import errors, sharding


@dataclasses.dataclass
class Partition:
    """Gradients checked by one op call: one device, one set of groups to agree with."""

    device: torch.device
    groups: sharding.Groups  # where the other shards of these gradients live
    partial: bool = False  # some hold unreduced partial sums (no norm shard by shard)
    grads: list[torch.Tensor] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class CheckResult:
    """``found_inf``: 0-dim float32 on the scale's device, 0.0 or 1.0, the same on every rank
    that agreed. ``decided``: gradients were checked here or the answer came from other ranks
    (False only for an optimizer without gradients on a rank that agrees with nobody).
    ``sum_of_squares``: of the unscaled gradients, summed over shards (norm requests only)."""

    found_inf: torch.Tensor
    decided: bool
    sum_of_squares: torch.Tensor | None = None


class GradientCheck:
    """Checks and unscales gradients with the ``amp_graph`` ops; decides ``found_inf``.

    Args:
        process_group: a group over which ``found_inf`` is also MAX-reduced (pipeline stages,
            ranks without gradients of an optimizer, hand-rolled sharding). ``None``: no
            reduction beyond the mesh groups of DTensor gradients.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.process_group_lost = False  # set by unpickling a custom group (see __getstate__)

    # ---- gathering --------------------------------------------------------------------------

    def collect(
        self, optimizer: torch.optim.Optimizer, *, allow_fp16: bool, norm: bool = False
    ) -> list[Partition]:
        """The optimizer's gradients, partitioned. torch's ``ValueError`` for float16 gradients
        unless ``allow_fp16``. Sparse gradients are coalesced first (``param.grad`` replaced)
        when float16, as torch does (their duplicate indices may overflow when summed), and for
        a ``norm``: the values of one index add up before they are squared."""
        groups = optimizer.param_groups
        grads = [p.grad for group in groups for p in group["params"] if p.grad is not None]
        plain = _plain_partition(grads, allow_fp16)
        if plain is not None:
            return plain
        parts: dict[tuple, Partition] = {}
        for param in _params(optimizer):
            grad = param.grad
            if grad is None:
                continue
            if not allow_fp16 and grad.dtype == torch.float16:
                raise ValueError(errors.with_fix(errors.FP16_GRADS, errors.FIX_FP16_GRADS))
            if grad.is_sparse:
                if norm or grad.dtype is torch.float16:
                    param.grad = grad = grad.coalesce()
                grad = grad._values()
            shard = sharding.local_shard(grad)
            key = (shard.local.device, tuple(map(id, shard.groups)), shard.partial)
            if key not in parts:
                parts[key] = Partition(shard.local.device, shard.groups, shard.partial)
            parts[key].grads.append(shard.local)
        return list(parts.values())

    # ---- checking ---------------------------------------------------------------------------

    def run(
        self,
        parts: list[Partition],
        scale_device: torch.device,
        inv_scale: torch.Tensor | None,
        norm: bool = False,
    ) -> CheckResult:
        """Check (``inv_scale`` None: read only), or check and unscale, every partition; with
        ``norm`` also return the float32 sum of squares of the unscaled gradients, summed over
        the shards of sharded ones. No host synchronization; collectives only as described in
        the module docstring."""
        self._require_group()
        if norm and any(part.partial for part in parts):
            raise NotImplementedError(
                "unscale_and_clip_grad_norm_ got a gradient with a Partial placement (unreduced "
                "partial sums), whose norm cannot be taken shard by shard: reduce it first, or "
                "call unscale_() then torch.nn.utils.clip_grad_norm_."
            )
        found_parts: list[torch.Tensor] = []
        norm_parts: list[torch.Tensor] = []
        with torch.no_grad():
            for part in parts:
                found = torch.zeros((), dtype=torch.float32, device=part.device)
                if inv_scale is None:
                    check_only_(part.grads, found)
                else:
                    inv = inv_scale.to(part.device, non_blocking=True)
                    if norm:
                        sum_sq = ops.non_finite_check_unscale_and_norm_(part.grads, found, inv)
                        sharding.all_reduce_(sum_sq, part.groups, dist.ReduceOp.SUM)
                        norm_parts.append(sum_sq.to(scale_device, non_blocking=True))
                    else:
                        ops.non_finite_check_and_unscale_(part.grads, found, inv)
                found_parts.append(found.to(scale_device, non_blocking=True))
            # MAX, not a sum: fused optimizers skip only on found_inf == 1.0.
            found_inf = _max(found_parts, scale_device)
            groups = self.agreement_groups(parts)
            sharding.all_reduce_(found_inf, groups, dist.ReduceOp.MAX)
        sum_of_squares = _sum(norm_parts, scale_device) if norm else None
        return CheckResult(found_inf, bool(parts) or bool(groups), sum_of_squares)

    def agreement_groups(self, parts: list[Partition]) -> sharding.Groups:
        """The groups ``found_inf`` is reduced over: the partitions' shard groups, then
        ``process_group``."""
        extra = [(self.process_group,)] if self.process_group is not None else []
        return sharding.union([p.groups for p in parts] + extra)

    def _require_group(self) -> None:
        if self.process_group_lost:
            raise RuntimeError(
                "This GradScaler was unpickled without its process_group (a process group "
                "cannot be pickled): call scaler.set_process_group(group) with the group it was "
                "created with before using it."
            )

    # ---- pickling ---------------------------------------------------------------------------

    def __getstate__(self) -> dict:
        """A process group cannot be pickled: the world group is restored by name; any other
        group must be passed again (``set_process_group``) before the next check."""
        state = self.__dict__.copy()
        group = self.process_group
        state["process_group"] = None
        state["world_group"] = group is not None and _is_world(group)
        state["process_group_lost"] = self.process_group_lost or (
            group is not None and not state["world_group"]
        )
        return state

    def __setstate__(self, state: dict) -> None:
        world = state.pop("world_group", False)
        self.__dict__.update(state)
        if world:
            self.process_group = dist.group.WORLD


def check_only_(grads: list[torch.Tensor], found_inf: torch.Tensor) -> None:
    """Set ``found_inf`` to 1.0 if a gradient is inf/nan; the values are unchanged.

    On CUDA, amp_graph's read-only kernel. On the CPU, torch's fused check-and-unscale with a
    scale of 1, which writes every value back as itself (``x * 1 == x``, bit for bit): one
    vectorized C++ loop, measured faster than read-only ``aminmax`` per tensor with many small
    gradients and within noise on large ones (``benchmarks/grad_check_bench.py``).
    """
    if not grads:
        return
    if found_inf.device.type == "cpu":
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, _cpu_one())
    else:
        ops.non_finite_check_(grads, found_inf)


def _plain_partition(grads: list[torch.Tensor], allow_fp16: bool) -> list[Partition] | None:
    """The partitions of gradients that are all plain dense tensors on one device (the
    common case), without the per-gradient bookkeeping of sharded or sparse ones: one
    partition agreed with nobody. None when any gradient needs that bookkeeping (or raises)."""
    if not grads:
        return []
    device = grads[0].device
    for grad in grads:
        if (
            type(grad) is not torch.Tensor  # DTensor shards, other subclasses
            or grad.is_sparse
            or grad.device != device
            or (not allow_fp16 and grad.dtype == torch.float16)
        ):
            return None
    return [Partition(device, (), False, grads)]


@functools.cache
def _cpu_one() -> torch.Tensor:
    """The scale of 1 the CPU check passes (read only; made once, not per step): a plain
    tensor whatever mode the first check runs under (fake, inference)."""
    with _disable_current_modes(), torch.inference_mode(False), torch.no_grad():
        return torch.ones((), dtype=torch.float32)


def _params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


def _is_world(group: dist.ProcessGroup) -> bool:
    return dist.is_available() and dist.is_initialized() and group is dist.group.WORLD


def _max(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    return tensors[0] if len(tensors) == 1 else torch.stack(tensors).amax()


def _sum(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    return tensors[0] if len(tensors) == 1 else torch.stack(tensors).sum()
