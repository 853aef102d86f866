"""A skipped first step of torch's fused SGD (one job: no uninitialized momentum buffer).

``torch.optim.SGD(..., momentum=m, fused=True)`` gives a parameter group whose parameters have
no momentum buffer yet (its first step) buffers made with ``torch.empty_like`` and fills them in
its kernel (``buf = grad``). When the step is skipped on the device (``found_inf`` set), the
kernel writes nothing and the buffers keep whatever the memory held (often nan), which every
later step reads. (Fused Adam, AdamW and Adagrad initialize their state before the kernel.)

A skipped step must leave the state as if it never ran: no buffer, so that the next step sets
``buf = grad``. A zero buffer does exactly that when ``dampening == 0`` (torch's default, and
required by nesterov): the next step computes ``buf = m * 0 + (1 - 0) * grad = grad``.
So after such a step :func:`zero_skipped_buffers` zeroes the new buffers where ``found_inf`` is
set, on the device, and leaves them bit for bit as the kernel wrote them where it is not. With
``dampening != 0`` a zero buffer would give ``(1 - dampening) * grad``: the caller decides that
step on the host instead (one read, on such a first step only; :func:`zero_is_exact`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["first_step_groups", "zero_is_exact", "zero_skipped_buffers"]


def first_step_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The parameter groups of a ``torch.optim.SGD`` whose next step allocates momentum
    buffers: momentum on, and gradients on parameters that have no buffer.

    torch's fused SGD allocates all of a group's buffers or none (a group mixing parameters
    with and without one makes its kernel raise ``TypeError``), so the first parameter with a
    gradient answers for its group: one lookup per group, not per parameter.
    """
    if not isinstance(optimizer, torch.optim.SGD):
        return []
    state = optimizer.state
    groups = []
    for group in optimizer.param_groups:
        if group["momentum"] == 0:
            continue
        first = next((p for p in group["params"] if p.grad is not None), None)
        if first is not None and "momentum_buffer" not in state.get(first, ()):
            groups.append(group)
    return groups


def zero_is_exact(groups: list[dict[str, Any]]) -> bool:
    """Whether zero buffers stand exactly for missing ones in these groups (no dampening)."""
    return all(group["dampening"] == 0 for group in groups)


def zero_skipped_buffers(
    optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]], found_inf: torch.Tensor
) -> None:
    """After the step of :func:`first_step_groups`' ``groups``: zero their momentum buffers if
    ``found_inf`` is set (the kernel skipped and left them uninitialized). No host read."""
    state = optimizer.state
    skipped: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for group in groups:
            for param in group["params"]:
                buffer = state.get(param, {}).get("momentum_buffer")
                if param.grad is None or buffer is None:
                    continue
                if buffer.device not in skipped:
                    flag = found_inf.to(buffer.device, non_blocking=True)
                    skipped[buffer.device] = flag != 0
                buffer.masked_fill_(skipped[buffer.device], 0.0)
