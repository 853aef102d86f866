"""Optimizer states that an in-place checkpoint loader can fill (one job: a ``Graph``'s
optimizers -> their ``state_dict`` entries, and back).

``torch.distributed.checkpoint`` (DCP) loads *into* the state dict it is given: it asks the
:class:`~amp_graph.Graph` for its ``state_dict()``, fills the tensors it finds there from the
checkpoint, and hands the result to ``load_state_dict``. A torch optimizer that has not
stepped yet has no state (its first ``step()`` creates it), so a fresh Graph's state dict
offers DCP nothing to fill: the checkpoint's Adam moments would be dropped without a word,
and the resumed run would restart them from zero.

Guarantees:

* :func:`optimizer_states` gives every optimizer's ``state_dict()``; for one that has not
  stepped, with its state allocated as its first step would allocate it (torch's
  ``torch.distributed.checkpoint.state_dict`` does the same: one step with zero gradients at
  learning rate 0), and the optimizer left as it was: no state, its gradients and learning
  rates restored, its parameters unchanged.
* Each entry says whether the optimizer had stepped. :func:`load_optimizer_states` loads the
  state only of those that had, so a checkpoint of a fresh Graph resumes fresh, and a
  checkpoint DCP filled in place carries the saved flag with the saved state.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

STEPPED = "amp_graph.stepped"  # the key of the flag in each optimizer's entry


def optimizer_states(optimizers: list[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    """Each optimizer's ``state_dict()`` with its state allocated, and the flag ``STEPPED``."""
    return [_loadable_state_dict(optimizer) for optimizer in optimizers]


def load_optimizer_states(
    optimizers: list[torch.optim.Optimizer], states: list[dict[str, Any]]
) -> None:
    """Load what :func:`optimizer_states` gave (or a plain ``state_dict()`` per optimizer)."""
    if len(states) != len(optimizers):
        raise ValueError(f"state_dict has {len(states)} optimizers, the graph {len(optimizers)}")
    for optimizer, saved in zip(optimizers, states, strict=True):
        saved = dict(saved)
        if not saved.pop(STEPPED, True):
            saved["state"] = {}  # allocated for the loader only: the optimizer had not stepped
        optimizer.load_state_dict(saved)


def _loadable_state_dict(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.state or not any(p.requires_grad for p in params):
        return optimizer.state_dict() | {STEPPED: True}
    groups = optimizer.state_dict()["param_groups"]  # taken before the learning rates are 0
    grads = [p.grad for p in params]
    learning_rates = [group.get("lr") for group in optimizer.param_groups]
    try:
        for param in params:
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
        for group in optimizer.param_groups:
            if isinstance(group.get("lr"), torch.Tensor):
                group["lr"] = torch.zeros_like(group["lr"])
            elif "lr" in group:
                group["lr"] = 0.0
        with torch.no_grad():
            optimizer.step()
        allocated = optimizer.state_dict()["state"]  # the new tensors, now the entry's own
    finally:
        optimizer.state = collections.defaultdict(dict)
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        for group, lr in zip(optimizer.param_groups, learning_rates, strict=True):
            if lr is not None:
                group["lr"] = lr
    return {"state": allocated, "param_groups": groups, STEPPED: False}
