"""Symbolic sizes for a capture: which dims export may make symbolic, and what asking for
them does outside the capture, contained.

:func:`auto_dynamic_shapes` asks for ``Dim.AUTO`` on every dim of every tensor input.
:func:`auto_dims_contained` keeps the rest of the program as it was:

* torch logs a WARNING for each dim of size 0 or 1 that it specializes (a batch of one, a
  decode step's one token), which is what ``Dim.AUTO`` means; amp_graph's shape guard
  captures again when such a size changes, so the notes are dropped (kept at DEBUG);
* ``torch.export`` with ``Dim.AUTO`` marks each real input tensor it fakifies
  (``torch._dynamo.maybe_mark_dynamic``: ``_dynamo_weak_dynamic_indices`` and its kin) and
  clears the marks only when it succeeds. After a failed capture with symbolic sizes the
  marks stayed on the user's tensors, so the static capture that follows was symbolic again
  (and failed again); every tensor's marks are put back as they were.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.export import Dim
from torch.utils import _pytree as pytree

_PREFIX = "_dynamo_"
_EXPORT_LOG = logging.getLogger("torch._export.non_strict_utils")
_SPECIALIZED = "specialized; Dim.AUTO was specified"
log = logging.getLogger(__name__)


def _specialization_note_to_debug(record: logging.LogRecord) -> bool:
    if _SPECIALIZED in record.getMessage():
        log.debug("torch.export: %s", record.getMessage())
        return False
    return True


def _marks(tensor: torch.Tensor) -> dict[str, Any]:
    return {
        name: value
        for name, value in vars(tensor).items()
        if name.startswith(_PREFIX) or name == "_has_dynamo_dim_marking"
    }


@contextlib.contextmanager
def auto_dims_contained(tree: Any) -> Iterator[None]:
    """While active, torch's notes on dims specialized to 0/1 go to DEBUG and anything may
    mark the tensors of ``tree``; on exit each has the size markings it had on entry (copies:
    export edits the sets in place)."""
    tensors = [v for v in pytree.tree_leaves(tree) if isinstance(v, torch.Tensor)]
    before = [{k: _copy_of(v) for k, v in _marks(t).items()} for t in tensors]
    _EXPORT_LOG.addFilter(_specialization_note_to_debug)
    try:
        yield
    finally:
        _EXPORT_LOG.removeFilter(_specialization_note_to_debug)
        for tensor, marks in zip(tensors, before, strict=True):
            for name in _marks(tensor):
                if name not in marks:
                    delattr(tensor, name)
            for name, value in marks.items():
                setattr(tensor, name, value)


def _copy_of(value: Any) -> Any:
    return set(value) if isinstance(value, set) else value


def auto_dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
    """``Dim.AUTO`` for every dim of every tensor input, keyed as export wants: by the
    forward's parameter names (a tuple when there are no keyword arguments)."""

    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return {d: Dim.AUTO for d in range(value.dim())} or None
        return None

    def specs(tree: Any) -> Any:
        return pytree.tree_map(spec, tree, is_leaf=lambda v: isinstance(v, torch.Tensor))

    if not kwargs:
        return specs(tuple(args))
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    return {name: specs(value) for name, value in bound.arguments.items()}


__all__ = ["auto_dims_contained", "auto_dynamic_shapes"]
