"""One consumer's read of a cast that several consumers share: the op and its gradient.

torch.autocast casts an activation once per op that reads it, so three projections of one
LayerNorm output make three bf16 copies, and backward converts each projection's gradient
to float32 on its own before autograd sums them at the float32 source. amp_graph makes the
copy once (``passes.simplify_casts``), and left alone, autograd would sum the three
gradients at the shared bf16 copy, in bf16, before converting the sum: two more roundings
to bf16 per value, and other bits than autocast's.

:func:`cast_read` is the graph op ``passes.shared_cast_gradients`` puts between a shared
cast and each of its consumers, where the copy is too large for a cast per consumer (as
autocast makes) to cost less than the read's Python (about 5 us forward and more backward,
where a small cast is one native kernel). Forward, it returns the cast itself, as a view
(no copy, no kernel): the consumers read, and backward keeps, one copy as before.
Backward, it converts its consumer's gradient to the source's dtype and hands it to the
source directly, so the gradients meet where autocast's meet, in the source's dtype, in
the same order. Without autograd (``no_grad``, a source that needs no gradient) it is the cast.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cast_read"]


class _CastRead(torch.autograd.Function):
    """Forward: ``cast`` as a view (of ``cast`` itself, so that what keeps a view of the
    copy for backward, ``recompute_ops``' hooks among them, sees one). Backward: the
    gradient in ``source``'s dtype, to ``source``; none to the shared copy."""

    # forward takes ctx itself, with no setup_context: with one, Function.apply binds its
    # arguments through inspect.signature on every call (15 us of a 20 us read on a CPU)
    @staticmethod
    def forward(ctx: Any, source: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:
        ctx.source_dtype = source.dtype
        return torch.ops.aten.alias.default(cast)  # a view named as one: it computes nothing

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.source_dtype), None


def _autocast_caches(source: torch.Tensor, cast: torch.Tensor) -> bool:
    """torch.autocast makes one cast of ``source`` for the whole region, as of a weight:
    a float32 leaf that requires grad, not a view, cast to a low dtype (its cache's rule in
    ``autocast_mode.cpp``). Its consumers' gradients then meet at that copy there too."""
    return (
        source.is_leaf
        and not source._is_view()
        and source.dtype == torch.float32
        and cast.dtype in (torch.float16, torch.bfloat16)
    )


def cast_read(source: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:
    """``cast`` (``source`` cast to another dtype) as one of its consumers reads it: the
    same values, its gradient converted to ``source``'s dtype on its own (as torch.autocast's
    cast per consumer converts it), not summed with the other consumers' first. Where
    autocast would share one cast too (a graph input that is a leaf requiring grad, read as
    it reads a weight) or nothing needs a gradient, it is ``cast`` itself."""
    if not (torch.is_grad_enabled() and source.requires_grad) or _autocast_caches(source, cast):
        return cast
    return _CastRead.apply(source, cast)
