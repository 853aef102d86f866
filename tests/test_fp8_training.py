"""fp8 training reaches bf16's accuracy: the digits MLP and the GPT-style decoder.

Both runs start from the same weights and see the same batches. The bf16 run is
``amp_graph.compile(model, "O1", torch.bfloat16)``; the fp8 run is
``amp_graph.compile(model, "fp8")`` (O1 in bf16 around float8 linears). Stated tolerance:
test accuracy within 0.02 of bf16.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_graph
from amp_graph.demo import models
from amp_graph.demo.digits import batches, load_digits

BF16 = torch.bfloat16
TOLERANCE = 0.02


def compiled(model: nn.Module, use_fp8: bool) -> nn.Module:
    return amp_graph.compile(model, "fp8" if use_fp8 else "O1", BF16)


def test_digits_mlp_fp8_accuracy_within_002_of_bf16():
    train, test = load_digits()
    base = models.MLP()

    def accuracy(use_fp8: bool) -> float:
        model = copy.deepcopy(base)
        net = compiled(model, use_fp8)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        for x, y in batches(train, 64, 200):
            loss = F.cross_entropy(net(x).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if use_fp8:
            fp8_nodes = [n for n in net.graph.nodes if "fp8_linear" in str(n.target)]
            assert len(fp8_nodes) == 2  # fc1, fc2; the 10-class head stays bf16 (dims)
        with torch.no_grad():
            return (net(test.x).argmax(1) == test.y).float().mean().item()

    bf16, fp8 = accuracy(False), accuracy(True)
    assert bf16 > 0.9
    assert abs(fp8 - bf16) <= TOLERANCE, (fp8, bf16)


def strided_sequences(n: int, generator: torch.Generator, length: int = 33) -> torch.Tensor:
    """Token i+1 = token i + stride (mod 64), stride drawn per sequence from {1, 2, 3, 5}: the
    model must read the stride off the previous tokens (attention) and add it (MLP)."""
    start = torch.randint(0, 64, (n, 1), generator=generator)
    stride = torch.tensor([1, 2, 3, 5])[torch.randint(0, 4, (n, 1), generator=generator)]
    return (start + stride * torch.arange(length)) % 64


def test_gpt_decoder_fp8_next_token_accuracy_within_002_of_bf16():
    base = models.GPT(layers=1)  # one pre-LN block: attention, GELU MLP, tied head
    held_out = strided_sequences(16, torch.Generator().manual_seed(99))

    def accuracy(use_fp8: bool) -> float:
        model = copy.deepcopy(base)
        data = torch.Generator().manual_seed(1)
        net = compiled(model, use_fp8)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(250):
            seq = strided_sequences(16, data)
            logits = net(seq[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), seq[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            predicted = net(held_out[:, :-1]).argmax(-1)
        # from the third token on the stride is known
        return (predicted[:, 2:] == held_out[:, 3:]).float().mean().item()

    bf16, fp8 = accuracy(False), accuracy(True)
    assert bf16 > 0.9
    assert abs(fp8 - bf16) <= TOLERANCE, (fp8, bf16)
