"""How far a program's outputs are from float32: :class:`OutputError` (autopolicy's check
against the float32 model, and the exported programs')."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree


@dataclass(frozen=True)
class OutputError:
    """Over every floating output leaf: the largest absolute difference, and the largest
    relative L2 error (``|a - b| / |b|``, autopolicy's measure, against its ``tol``)."""

    max_abs: float
    rel_l2: float

    @staticmethod
    def worst(errors: Iterable[OutputError]) -> OutputError:
        errors = list(errors)
        return OutputError(
            max((e.max_abs for e in errors), default=0.0),
            max((e.rel_l2 for e in errors), default=0.0),
        )


def output_error(outputs: Any, reference: Any) -> OutputError:
    """The error of ``outputs`` against ``reference`` (same structure; non-finite values
    give ``inf``)."""
    got = [v for v in pytree.tree_leaves(outputs) if isinstance(v, torch.Tensor)]
    want = [v for v in pytree.tree_leaves(reference) if isinstance(v, torch.Tensor)]
    if len(got) != len(want):
        raise ValueError(f"{len(got)} output tensors against {len(want)} of the reference")
    max_abs, rel = 0.0, 0.0
    for a, b in zip(got, want, strict=True):
        if not b.is_floating_point():
            continue
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        if not torch.isfinite(a).all():
            return OutputError(math.inf, math.inf)
        max_abs = max(max_abs, (a - b).abs().max().item() if a.numel() else 0.0)
        rel = max(rel, ((a - b).norm() / b.norm().clamp_min(1e-30)).item())
    return OutputError(max_abs, rel)
