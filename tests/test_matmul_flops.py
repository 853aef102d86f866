"""passes.matmul_flops counts a graph's matrix products as torch's own FLOP counter does.

The oracle is ``torch.utils.flop_counter.FlopCounterMode`` on the eager model (forward), on
layers as people write them: linears, a matmul of two activations, attention through SDPA,
convolutions (grouped, transposed), an RNN-free MLP in a checkpointed block, and an HF
Llama. The recompute decision estimates a step from this count, so a count above torch's
would make recomputes look cheaper than they are: the test asserts equality where every
product is one of the counted ops, and a lower bound where the model has others (einsum).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from amp_graph.passes.matmul_flops import forward_matmul_flops
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_flop_count

import amp_graph

BF16 = torch.bfloat16


class Attention(nn.Module):
    """nanoGPT's attention: one qkv linear, SDPA, an output projection; and a score matmul
    of two activations besides, as eager attention writes it."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        scores = (q @ k.transpose(-2, -1)).softmax(-1)  # eager attention's products
        y = y + scores @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Convolutions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.grouped = nn.Conv2d(8, 8, 3, groups=4)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.head = nn.Conv1d(4, 6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up(F.relu(self.grouped(F.relu(self.conv(x)))))
        return self.head(y.flatten(2))


class CheckpointedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + checkpoint(lambda y: self.down(F.gelu(self.up(y))), x, use_reentrant=False)


def torch_counted(model: nn.Module, *inputs: torch.Tensor) -> int:
    """torch's count, and SDPA's where torch has no formula for the kernel that ran (the
    CPU's flash kernel): torch's own ``sdpa_flop_count`` of the shapes."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(*inputs)
    uncounted = 0
    for call in sdpa_calls(model, *inputs):
        uncounted += sdpa_flop_count(*(t.shape for t in call[:3]))
    return counter.get_total_flops() + uncounted


def sdpa_calls(model: nn.Module, *inputs: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """The (query, key, value) of each SDPA call whose kernel torch's counter does not know."""
    calls: list[tuple[torch.Tensor, ...]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            packet = getattr(func, "overloadpacket", None)
            if "scaled_dot_product" in str(func) and packet not in flop_registry:
                calls.append(tuple(args[:3]))
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Record():
        model(*inputs)
    return calls


def graph_counted(model: nn.Module, *inputs: torch.Tensor, policy: str = "O0") -> int:
    compiled = amp_graph.compile(model, policy, BF16, example_inputs=inputs)
    return forward_matmul_flops(compiled.graph_module)


@pytest.mark.parametrize(
    "make, shape",
    [
        (Attention, (2, 8, 32)),
        (Convolutions, (2, 3, 10, 10)),
        (CheckpointedMLP, (4, 5, 16)),
    ],
    ids=["attention", "convolutions", "checkpointed"],
)
def test_the_count_is_torchs(make, shape) -> None:
    model, x = make(), torch.randn(*shape)
    expected = torch_counted(model, x)
    assert expected > 0
    for policy in ("O0", "O1"):  # O1: products reading casts the passes inserted
        assert graph_counted(model, x, policy=policy) == expected


def test_an_hf_llama_counts_as_torch_does() -> None:
    """Under every preset: O1's casts and "autocast"'s reads of shared casts carry no
    example value of their own, and count with their source's shape."""
    transformers = pytest.importorskip("transformers")
    from hf_configs import small_llama_config

    model = transformers.LlamaForCausalLM(small_llama_config()).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    expected = torch_counted(model, ids)
    assert expected > 0
    for policy in ("O0", "O1", "O2", "autocast"):
        assert graph_counted(model, ids, policy=policy) == expected, policy


def test_what_it_does_not_count_leaves_a_lower_bound() -> None:
    class Einsum(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(16, 16))
            self.linear = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(torch.einsum("btc,cd->btd", x, self.weight))

    model, x = Einsum(), torch.randn(2, 4, 16)
    counted = graph_counted(model, x)
    assert 0 < counted < torch_counted(model, x)
    assert counted == 2 * 2 * 4 * 16 * 16  # the linear's


def test_an_fp8_linear_counts_half() -> None:
    """The fp8 policy's linears run at twice bf16's rate on Hopper, and the step is timed at
    bf16's: each counts half its FLOPs (the MLP's two hidden linears become fp8, its 10-class
    head stays a bf16 linear)."""
    from amp_graph.passes.fp8_linears import fp8_linears

    from amp_graph.demo import models

    model, x = models.MLP(), torch.randn(32, 1, 8, 8)
    gm = torch.export.export(model, (x,), strict=False).module()
    before = forward_matmul_flops(gm)
    assert before == torch_counted(model, x)
    head = 2 * 32 * model.head.in_features * model.head.out_features
    assert fp8_linears(gm, root=model).stats["fp8_linears"] == 2
    gm.recompile()
    assert forward_matmul_flops(gm) == head + (before - head) // 2
