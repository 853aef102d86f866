"""Casts of parameters made once and reused while the parameters stay as they are.

torch.autocast keeps the low-precision copy of each leaf parameter it casts for the rest of
the autocast region, so ``generate`` under one ``torch.autocast`` casts every weight once,
not once per token. A decode graph runs once per token over the same weights; its casts of
parameters call :func:`cast_reused`, which does the same explicitly: while a
:class:`ParameterCasts` holds casts (the decoder holds them as long as the KV cache object
of one generation lives), a cast of an unchanged parameter is the one made before.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from amp_graph.ops.recompute_ops import recomputed_cast

# (parameter, its _version and data_ptr when cast, the cast)
_Entry = tuple[torch.Tensor, int, int, torch.Tensor]


class ParameterCasts:
    """The casts of parameters one owner's calls share (a KV cache object: one generation).

    :meth:`serve` before each graph call names the owner: the casts held for it are kept,
    any others dropped; :meth:`keep_for` after the call names the owner they now belong to
    (the cache the call made or returned; None drops them). They are dropped too when the
    owner is garbage collected: nothing outlives the generation it served.
    """

    def __init__(self) -> None:
        self.held: dict[tuple[int, torch.dtype], _Entry] | None = None  # None: no reuse
        self._owner: weakref.ref | None = None

    def serve(self, owner: Any) -> None:
        if owner is None or self._owner is None or self._owner() is not owner:
            self.held, self._owner = {}, None

    def keep_for(self, owner: Any) -> None:
        if owner is None:
            self.held, self._owner = None, None
            return
        try:
            self._owner = weakref.ref(owner, self._forget)
        except TypeError:  # an owner without weak references: no reuse across calls
            self.held, self._owner = None, None

    def _forget(self, ref: weakref.ref) -> None:
        if self._owner is ref:
            self.held, self._owner = None, None


def cast_reused(
    casts: ParameterCasts, param: torch.Tensor, dtype: torch.dtype, kept_by: str | None = None
) -> torch.Tensor:
    """``param`` cast to ``dtype``: the cast ``casts`` holds while ``param`` is the same tensor
    at the same version and storage, else a new one (kept where ``casts`` holds any).
    With grad enabled it is made anew, as a graph without reuse makes it (``kept_by``: a
    :func:`~amp_graph.ops.recompute_ops.recomputed_cast`'s, whose backward casts again):
    autograd records it, and a cast made under ``inference_mode`` could not be saved for
    backward (a frozen weight's, which ``param.requires_grad`` would not tell)."""
    held = casts.held
    if held is None or torch.is_grad_enabled():
        return recomputed_cast(param, dtype, kept_by) if kept_by else param.to(dtype)
    key = (id(param), dtype)
    entry = held.get(key)
    version, pointer = param._version, param.data_ptr()
    if entry is not None and entry[0] is param and entry[1:3] == (version, pointer):
        return entry[3]
    cast = param.to(dtype)
    held[key] = (param, version, pointer, cast)
    return cast


__all__ = ["ParameterCasts", "cast_reused"]
