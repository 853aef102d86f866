"""Pass low_extremes: float32's extremes baked as a scalar (``torch.finfo(x.dtype).min``, read
where dynamo traced float32) become the low dtype's where an op is planned low, as
torch.autocast's run reads them; nothing else changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from amp_graph.passes import AMP

import amp_graph

BF16, FP16 = torch.bfloat16, torch.float16
F32_MIN = torch.finfo(torch.float32).min


class MaskedScores(nn.Module):
    """Scores masked with their dtype's minimum, then a softmax (HF's usual attention mask);
    and a float32 value masked with float32's, which must stay."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        wide = x.float().sum(-1).masked_fill(mask[..., 0], torch.finfo(torch.float32).min)
        return scores.softmax(-1), wide


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(2, 5, 8), torch.rand(2, 5, 5) < 0.3


def _fills(gm: torch.fx.GraphModule) -> list[tuple[torch.dtype, float]]:
    return [
        (n.meta[AMP].out_dtype, n.args[2])
        for n in gm.graph.nodes
        if n.target is torch.ops.aten.masked_fill.Scalar
    ]


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_backend_fills_with_the_low_dtypes_minimum_as_autocast_does(dtype, fresh_dynamo):
    torch.manual_seed(0)
    model = MaskedScores()
    x, mask = _inputs()
    dynamo = torch.compile(model, backend=amp_graph.backend("autocast", dtype, inner="eager"))
    ours = dynamo(x, mask)  # before the pass: "value cannot be converted ... without overflow"
    with torch.autocast("cpu", dtype):
        theirs = model(x, mask)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    [gm] = amp_graph.captured_graphs(dynamo)
    # the low op fills with its dtype's minimum; the float32 one keeps float32's
    assert _fills(gm) == [(dtype, torch.finfo(dtype).min), (torch.float32, F32_MIN)]


def test_compile_reads_the_planned_dtype_and_the_pass_changes_nothing():
    torch.manual_seed(0)
    compiled = amp_graph.compile(MaskedScores(), "autocast", BF16)
    compiled(*_inputs())
    gm = amp_graph.frontends.compiler.as_graph_module(compiled)
    assert _fills(gm) == [(BF16, torch.finfo(BF16).min), (torch.float32, F32_MIN)]
    assert (
        "float32_extremes_lowered"
        not in amp_graph.frontends.compiler.compile_record(compiled).stats
    )
