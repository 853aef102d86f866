"""``flex_attention`` models, as torchtitan and gpt-fast write them: the block mask made once,
outside the compiled forward, and a score_mod.

torch.autocast in eager mode is the oracle. The torch.compile backend takes such a model bit
for bit with ``inner="eager"``; ``compile`` cannot capture it (under torch.export
flex_attention runs itself through torch.compile, which refuses the capture's dispatch mode)
and says where, and what to use instead. Inference only: flex_attention has no backward on
the CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import amp_graph
from amp_graph.capture import CaptureError

BF16 = torch.bfloat16
SEQ = 128


def _causal(b, h, q, kv):
    return q >= kv


def _alibi(score, b, h, q, kv):
    return score - (q - kv).abs() * 0.1


class FlexAttention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.block_mask = create_block_mask(_causal, None, None, SEQ, SEQ, device="cpu")

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = flex_attention(q, k, v, score_mod=_alibi, block_mask=self.block_mask)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


@pytest.fixture
def model_and_input():
    torch.manual_seed(0)
    return FlexAttention(), torch.randn(2, SEQ, 32)


def test_the_backend_runs_flex_attention_as_torch_autocast(fresh_dynamo, model_and_input):
    model, x = model_and_input
    with torch.no_grad(), torch.autocast("cpu", BF16):
        want = model(x)
    compiled = torch.compile(model, backend=amp_graph.backend("autocast", BF16, inner="eager"))
    with torch.no_grad():
        got = compiled(x)
    assert got.dtype == want.dtype == BF16
    assert torch.equal(got, want)
    [graph] = amp_graph.captured_graphs(compiled)
    assert any("flex_attention" in str(n.target) for n in graph.graph.nodes)


def test_compile_says_where_flex_attention_stops_the_capture(model_and_input):
    model, x = model_and_input
    expected = (
        r"(?s)torch's flex_attention cannot run under amp_graph's capture.*"
        r"flex_attention\(q, k, v.*backend=amp_graph.backend"
    )
    with pytest.raises(CaptureError, match=expected), torch.no_grad():
        amp_graph.compile(model, "autocast", BF16)(x)


class MaskInsideForward(FlexAttention):
    """HF's way: the block mask made in forward."""

    def forward(self, x):
        self.block_mask = create_block_mask(_causal, None, None, SEQ, SEQ, device="cpu")
        return super().forward(x)


def test_the_backend_says_a_block_mask_made_in_forward_is_what_it_cannot_take(fresh_dynamo):
    torch.manual_seed(0)
    compiled = torch.compile(
        MaskInsideForward(), backend=amp_graph.backend("autocast", BF16, inner="eager")
    )
    expected = r"block mask made inside the compiled forward.*outside"
    with pytest.raises(Exception, match=expected), torch.no_grad():
        compiled(torch.randn(2, SEQ, 32))
