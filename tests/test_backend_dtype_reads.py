"""Model code that reads a dtype from a tensor, through ``torch.compile(backend=...)``.

Dynamo traces the model's Python with the values it is called with and bakes what that
Python reads from a tensor (``w.dtype``, ``x.to(input_dtype)``) into the graph as a
constant. Called on float32 values, it bakes float32 where torch.autocast, and amp_graph's
plan, give bfloat16. The models are written as people write them: a top-k router that
scatters its weights into a dense matrix made with ``dtype=w.dtype`` (the issue's MoE
crash), a Qwen3-style attention whose q/k RMSNorms cast back to the dtype they read, and a
Llama-style pre-norm MLP whose norm reads the float32 residual stream.

What must hold, and why it can fail:

* An op whose kernel takes one floating dtype (``scatter``, ``index_add``) never fails in
  the passes because a baked dtype met a planned one: its inputs are promoted to the
  widest. Before, ``assign_dtypes`` raised "scatter(): Expected self.dtype to be equal to
  src.dtype".
* Called under ``torch.autocast``, dynamo traces the dtypes autocast gives: the backend
  under ``policy="autocast"`` then computes exactly what eager torch.autocast computes,
  output and gradients bit for bit, and autocast is off inside its graphs (its policy alone
  decides: a float32 override holds under the ambient autocast).
* Called in float32, where a baked dtype can change what the model computes, the backend
  says so at WARNING, once per backend, naming the nodes and the two ways out.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_graph

LOG = "amp_graph.frontends.dynamo_backend"
BAKED = "dynamo traced"


class TopKRouter(nn.Module):
    """The issue's router: dense routing weights made with the dtype of the weights."""

    def __init__(self, dim: int = 16, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = torch.topk(self.gate(x).softmax(-1), self.k, dim=-1)
        dense = torch.zeros(x.shape[0], len(self.experts), dtype=w.dtype).scatter(1, idx, w)
        return sum(dense[:, i : i + 1] * expert(x) for i, expert in enumerate(self.experts))


class RMSNorm(nn.Module):
    """HF's Llama/Qwen3 RMSNorm: float32 inside, cast back to the dtype it read."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + 1e-6)
        return self.weight * hidden_states.to(input_dtype)


class QKNormAttention(nn.Module):
    """Qwen3's attention: RMSNorm on each head's queries and keys."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.o_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.q_norm, self.k_norm = RMSNorm(self.head_dim), RMSNorm(self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        shape = (b, t, self.heads, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class PreNormMLP(nn.Module):
    """A Llama-style MLP behind its RMSNorm, on the float32 residual stream: the norm reads
    float32 under autocast too, so nothing is baked differently."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.silu(self.up(self.norm(x))))


MODELS = {
    "router": (TopKRouter, (8, 16)),
    "qk_norm_attention": (QKNormAttention, (2, 6, 32)),
    "pre_norm_mlp": (PreNormMLP, (4, 16)),
}


def _model_and_input(name: str) -> tuple[nn.Module, torch.Tensor]:
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make()
    return model, torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", list(MODELS))
def test_under_autocast_the_backend_computes_what_autocast_computes(name: str) -> None:
    model, x = _model_and_input(name)
    reference, _ = _model_and_input(name)
    with torch.autocast("cpu", torch.bfloat16):
        expected = reference(x)
    expected.float().square().sum().backward()
    backend = amp_graph.backend("autocast", torch.bfloat16, inner="aot_eager")
    compiled = torch.compile(model, backend=backend)
    with torch.autocast("cpu", torch.bfloat16):
        out = compiled(x)
    out.float().square().sum().backward()
    assert out.dtype == expected.dtype
    assert torch.equal(out, expected)
    ours, theirs = _grads(model), _grads(reference)
    assert ours.keys() == theirs.keys()
    for key, grad in theirs.items():
        assert torch.equal(ours[key], grad), key
    assert backend.graphs, "the backend rewrote the graph"


def test_under_autocast_the_policy_alone_decides_inside_the_graph() -> None:
    """A float32 override of the router's gate holds under an ambient torch.autocast, which
    would otherwise compute the gate's linear in bfloat16 again."""
    model, x = _model_and_input("router")
    pinned = amp_graph.Policy.preset("O1").override(modules={"gate": "fp32"})
    backend = amp_graph.backend(pinned, torch.bfloat16, inner="eager")
    with torch.autocast("cpu", torch.bfloat16):
        torch.compile(model, backend=backend)(x)
    [gm] = backend.graphs
    assert str(amp_graph.explain(gm, "linear")).startswith(
        "'linear' (aten.linear in module 'gate') returns fp32"
    )
    unpinned, _ = _model_and_input("router")
    with torch.autocast("cpu", torch.bfloat16):
        ambient = unpinned.gate(x)
    assert ambient.dtype == torch.bfloat16  # what autocast alone would have computed


@pytest.mark.parametrize("policy", ["autocast", "O1"])
@pytest.mark.parametrize("name", ["router"])
def test_ops_that_take_one_dtype_promote_where_a_baked_dtype_meets_a_planned_one(
    caplog: pytest.LogCaptureFixture, name: str, policy: str
) -> None:
    model, x = _model_and_input(name)
    for ambient in (False, True):
        torch._dynamo.reset()
        backend = amp_graph.backend(policy, torch.bfloat16, inner="eager")
        with torch.autocast("cpu", torch.bfloat16, enabled=ambient):
            out = torch.compile(model, backend=backend)(x)
        assert torch.isfinite(out).all()
        reference = amp_graph.compile(model, policy, torch.bfloat16)(x)
        torch.testing.assert_close(out.float(), reference.float(), rtol=0, atol=3e-2)


@pytest.mark.parametrize("name", ["router", "qk_norm_attention"])
def test_called_in_float32_a_baked_dtype_is_said_once_with_the_way_out(
    caplog: pytest.LogCaptureFixture, name: str
) -> None:
    model, x = _model_and_input(name)
    backend = amp_graph.backend("autocast", torch.bfloat16, inner="eager")
    compiled = torch.compile(model, backend=backend)
    with caplog.at_level(logging.WARNING, logger=LOG):
        compiled(x)
        compiled(x)
    [warning] = [
        r.getMessage() for r in caplog.records if r.name == LOG and BAKED in r.getMessage()
    ]
    assert "torch.autocast('cpu', torch.bfloat16)" in warning and "amp_graph.compile" in warning
    caplog.clear()
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger=LOG), torch.autocast("cpu", torch.bfloat16):
        torch.compile(model, backend=amp_graph.backend("autocast", inner="eager"))(x)
    assert not [r for r in caplog.records if r.name == LOG and BAKED in r.getMessage()]


def test_a_model_whose_reads_are_float32_under_autocast_too_gets_no_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The pre-norm MLP's RMSNorm reads the dtype of the float32 residual stream, float32
    under autocast as in the trace: nothing is baked wrong, the backend computes as
    torch.autocast, and says nothing."""
    model, x = _model_and_input("pre_norm_mlp")
    with torch.autocast("cpu", torch.bfloat16):
        expected = model(x)
    with caplog.at_level(logging.WARNING, logger=LOG):
        out = torch.compile(model, backend=amp_graph.backend("autocast", inner="eager"))(x)
    assert torch.equal(out, expected)
    assert not [r for r in caplog.records if r.name == LOG and BAKED in r.getMessage()]


def test_an_ambient_autocast_in_another_dtype_is_refused_naming_both() -> None:
    model, x = _model_and_input("qk_norm_attention")
    compiled = torch.compile(model, backend=amp_graph.backend("O1", torch.bfloat16, inner="eager"))
    refused = pytest.raises(Exception, match=r"torch.autocast\('cpu', fp16\).*computes in bf16")
    with refused, torch.autocast("cpu", torch.float16):
        compiled(x)
