"""What a Graph's step graphs, and CUDA graphs captured of them, took as fixed: checked per call.

A step graph steps the optimizers' param groups as they are when it runs, but under O2 the
groups must hold the float32 masters, not the model's low-precision copies; and a captured
CUDA graph reads the addresses its capture saw, runs no Python and so sees no new param
group, no parameter given new storage (``param.data = value``, ``model.to(...)``) and no
buffer reassigned. :class:`StepWatch` finds both kinds of change at the next call, by
identity and address (no per-element work), so that the step builder can point new groups
at the masters and capture the CUDA graphs again, rather than train what the user no longer
holds.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from amp_graph.training.master_weights import slots

_PARAMS = operator.itemgetter("params")


def optimizer_layout(optimizers: Sequence[torch.optim.Optimizer]) -> tuple:
    """Every group's parameter list (by identity) and its length, in order: a new group
    (``add_param_group``), or a parameter appended to or removed from a group, changes it.
    (A parameter swapped in place within a list, which torch's API never does, does not.)"""
    return tuple(
        (id(params), len(params)) for opt in optimizers for params in map(_PARAMS, opt.param_groups)
    )


class StepWatch:
    """The optimizers' layout a Graph's step graphs were built with, and, under CUDA graphs,
    the parameters and buffers (objects and addresses) the captures read."""

    def __init__(self) -> None:
        self.layout: tuple | None = None
        self._dicts: list[dict[str, Any]] = []
        self._keys: list[str] = []
        self._tensors: list[torch.Tensor] = []
        self._addresses: list[int] = []

    def optimizers_changed(self, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        """Whether a param group was added or changed since :meth:`record_optimizers`."""
        return self.layout is not None and optimizer_layout(optimizers) != self.layout

    def record_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.layout = optimizer_layout(optimizers)

    def record_tensors(self, modules: dict[str, nn.Module]) -> None:
        """Remember where the modules hold their parameters and buffers, and their addresses
        (at a CUDA graph's capture)."""
        sites = slots(modules, ("_parameters", "_buffers"), lambda _: True)
        self._dicts = [owner for _, owner, _ in sites]
        self._keys = [key for _, _, key in sites]
        self._tensors = [owner[key] for _, owner, key in sites]
        self._addresses = list(map(torch.Tensor.data_ptr, self._tensors))

    def tensors_moved(self) -> bool:
        """Whether a recorded parameter or buffer was replaced on its module, or given new
        storage, since :meth:`record_tensors`."""
        now = list(map(dict.get, self._dicts, self._keys))
        if not all(map(operator.is_, now, self._tensors)):
            return True
        return list(map(torch.Tensor.data_ptr, self._tensors)) != self._addresses
