"""One answer to "does this call set its own dtype?" (passes.meta.sets_a_dtype), asked by
classify (a float32-list op called with a dtype is left alone, as torch.autocast leaves it)
and by place_casts (such an op's result does not follow its inputs' dtype)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from amp_graph.passes.meta import sets_a_dtype
from torch import nn

import amp_graph

aten = torch.ops.aten


def _call(*args: object, **kwargs: object) -> fx.Node:
    graph = fx.Graph()
    x = graph.placeholder("x")
    return graph.call_function(aten.sum.dim_IntList, (x, *args), kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs", "sets"),
    [
        (([1], False, torch.float32), {}, True),  # positional, as export writes softmax's
        (([1],), {"dtype": torch.float16}, True),
        (([1],), {"out_dtype": torch.bfloat16}, True),  # _scaled_mm's and the like
        (([1], True), {}, False),
        (([1],), {"dtype": None}, False),  # the default: the input's dtype
    ],
)
def test_a_dtype_given_positionally_or_by_any_keyword_is_set(
    args: tuple, kwargs: dict, sets: bool
) -> None:
    assert sets_a_dtype(_call(*args, **kwargs)) is sets


class SumInFloat16(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).sum(-1, dtype=torch.float16)


def test_a_float32_op_given_a_dtype_runs_in_it_as_under_autocast() -> None:
    """``sum`` is on torch.autocast's float32 list; called with ``dtype=float16`` autocast
    leaves it, and so does O1: the same dtype as the oracle, and explain says why."""
    torch.manual_seed(0)
    model, x = SumInFloat16(), torch.randn(4, 16)
    with torch.autocast("cpu", torch.bfloat16):
        want = model(x)
    compiled = amp_graph.compile(model, "O1", torch.bfloat16, example_inputs=(x,))
    got = compiled(x)
    assert got.dtype == want.dtype == torch.float16
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    node = next(n for n in compiled.graph.nodes if n.target is aten.sum.dim_IntList)
    assert "the call sets dtype= itself" in str(amp_graph.explain(compiled, node.name))
