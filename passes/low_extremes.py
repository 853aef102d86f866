"""Pass low_extremes: float32's extremes given as a scalar to an op that runs in float16 or
bfloat16 become that dtype's own.

Model code fills masked positions with the most negative value of the scores' dtype:
``scores.masked_fill(mask, torch.finfo(scores.dtype).min)`` (HF DeBERTa-v2 and many
others). Where the model's Python ran with float32 values, as dynamo traces it for the
torch.compile backend, that read gives float32's ``-3.4028e38``, baked into the graph as a
constant; the plan then computes the op in bf16 or fp16, where the value does not exist and
torch refuses it at run time ("value cannot be converted to type c10::BFloat16 without
overflow"). torch.autocast's own run reads the low dtype there, and fills with its minimum:
so does the graph after this pass.

Reads: ``meta["amp"]`` (``out_dtype`` of each op, from assign_dtypes). Writes: the op's scalar
arguments equal to ``±torch.finfo(torch.float32).max``, replaced by ``±torch.finfo(low).max``.
Guarantees: nothing else changes; only ops whose output the plan makes float16 or bfloat16
(where float32's extremes would overflow) are touched, and only the exact float32 extremes,
which no such op can take otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .meta import AMP, LOW_PRECISION, Role
from .result import PassResult

_FLOAT32_MAX = torch.finfo(torch.float32).max


def _replaced(value: Any, low: torch.dtype) -> Any:
    if isinstance(value, float) and abs(value) == _FLOAT32_MAX:
        return torch.finfo(low).max if value > 0 else torch.finfo(low).min
    return value


def low_extremes(gm: fx.GraphModule) -> PassResult:
    """Replace float32's extremes among the scalar arguments of ops planned low."""
    changed = 0
    for node in gm.graph.nodes:
        amp = node.meta.get(AMP)
        if node.op != "call_function" or amp is None or amp.role is not Role.OP:
            continue
        low = amp.out_dtype
        if low not in LOW_PRECISION:
            continue
        args = tuple(_replaced(a, low) for a in node.args)
        kwargs = {k: _replaced(v, low) for k, v in node.kwargs.items()}
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs = args, kwargs
            changed += 1
    return PassResult(gm, bool(changed), {"float32_extremes_lowered": changed} if changed else {})


__all__ = ["low_extremes"]
