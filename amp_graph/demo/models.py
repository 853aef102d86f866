"""Small reference models used by the demo, the tests and the benchmarks.

Each is traceable by ``torch.fx.symbolic_trace`` and exercises something AMP must get
right: matmuls next to reductions, batch norm and residual adds, attention with a causal
mask and a tied output head, recurrent layers, in-place ops and integer/bool tensors, and
a model that upcasts to float32 on purpose.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """Linear-GELU-Linear-GELU-Linear classifier."""

    def __init__(self, in_features: int = 64, hidden: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.fc1(x.flatten(1)))
        x = F.gelu(self.fc2(x))
        return self.head(x)


class ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + x)


class ConvNet(nn.Module):
    """A small ResNet: conv stem, two residual blocks with BatchNorm, pooling, linear head."""

    def __init__(self, in_channels: int = 1, channels: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(in_channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.block1 = ResidualBlock(channels)
        self.block2 = ResidualBlock(channels)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stem(x)))
        x = self.block2(self.block1(x))
        return self.head(self.pool(x).flatten(1))


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        shape = (b, t, self.heads, d // self.heads)
        q = self.q(x).view(shape).transpose(1, 2)
        k = self.k(x).view(shape).transpose(1, 2)
        v = self.v(x).view(shape).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-style decoder: token and position embeddings, pre-LN blocks with causal
    scaled_dot_product_attention and a GELU MLP, final LayerNorm, output head tied to the
    token embedding. ``forward(idx)`` returns logits; pass ``targets`` for the loss."""

    def __init__(
        self, vocab: int = 64, block: int = 32, dim: int = 64, heads: int = 4, layers: int = 2
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(DecoderBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class NanoAttention(nn.Module):
    """nanoGPT's causal self-attention as written without flash attention (``att @ ...``,
    ``masked_fill`` with a ``tril`` buffer, ``F.softmax``), then a log-softmax head: what O1
    computes in float32 reads a bf16 matmul's output."""

    def __init__(self, dim: int = 32, heads: int = 4, block: int = 16, classes: int = 11) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return F.log_softmax(self.head(self.c_proj(y)), dim=-1)


class GPTWithLoss(nn.Module):
    """GPT plus cross-entropy, so that the loss is part of the graph."""

    def __init__(self, **kwargs: int) -> None:
        super().__init__()
        self.gpt = GPT(**kwargs)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(idx)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class WithCrossEntropy(nn.Module):
    """A classifier plus cross-entropy over its logits, so that the loss is part of the graph."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(inputs), labels)


class RecurrentNet(nn.Module):
    """Reads a (batch, rows, features) image row by row with an LSTM, then a GRU, and
    classifies the last step."""

    def __init__(self, features: int = 8, hidden: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, batch_first=True)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        out, _ = self.gru(out)
        return self.head(out[:, -1])


class MixedOpsNet(nn.Module):
    """In-place ops, cat/stack, integer index tensors and boolean masks."""

    def __init__(self, dim: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.head = nn.Linear(3 * dim, classes)
        self.register_buffer("perm", torch.randperm(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.relu_()  # in place: never cast
        g = self.b(x)
        g += h  # symbolic tracing records this as g + h
        g.mul_(0.5)  # in place: never cast
        mask = g > 0  # bool
        g = g.masked_fill(~mask, 0.0)
        picked = x[:, self.perm]  # integer index tensor
        best = torch.argmax(g, dim=-1, keepdim=True)  # int64
        gathered = torch.gather(h, 1, best).expand_as(h)
        stacked = torch.stack([g, gathered], dim=0).sum(0)
        return self.head(torch.cat([stacked, picked, h], dim=-1))


class RMSNorm(nn.Module):
    """Llama's RMSNorm: it computes in float32 on purpose and casts back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.type_as(x)


class LlamaMLP(nn.Module):
    """RMSNorm then a SwiGLU MLP: the explicit float32 upcast must survive every policy."""

    def __init__(self, dim: int = 32, hidden: int | None = None) -> None:
        super().__init__()
        hidden = 2 * dim if hidden is None else hidden
        self.norm = RMSNorm(dim)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class ResidualMLP(nn.Module):
    """Residual MLP blocks (4x hidden), the FSDP2 memory benchmark's first model."""

    def __init__(self, width: int = 256, blocks: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


class LlamaBlock(nn.Module):
    """RMSNorm, causal attention, RMSNorm, SwiGLU: a Llama decoder layer's shape."""

    def __init__(self, dim: int = 128, heads: int = 4, hidden: int | None = None) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.mlp = LlamaMLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x + self.attn(self.norm(x)))


class LlamaStyle(nn.Module):
    """Llama-style decoder layers on embeddings (no vocabulary), for the FSDP2 benchmark."""

    def __init__(
        self, dim: int = 128, blocks: int = 4, heads: int = 4, hidden: int | None = None
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(LlamaBlock(dim, heads, hidden) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class LlamaWithLoss(nn.Module):
    """A Llama-style language model: token embedding, :class:`LlamaStyle` layers (SwiGLU of
    width ``hidden``), RMSNorm, an untied head, and cross-entropy, so that the loss is part of
    the graph (the fp8 step benchmark's model, at Llama-3-8B's layer shapes there)."""

    def __init__(
        self,
        vocab: int = 256,
        dim: int = 64,
        blocks: int = 2,
        heads: int = 4,
        hidden: int | None = None,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = LlamaStyle(dim, blocks, heads, hidden)
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(self.layers(self.tok(idx))))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def shard_blocks(model: nn.Module, **fully_shard_kwargs: Any) -> nn.Module:
    """``model`` sharded with FSDP2 as the tests and benchmarks shard these models:
    ``fully_shard`` on each of ``model.blocks``, then on the root, with the same arguments.
    Returns ``model``."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, **fully_shard_kwargs)
    fully_shard(model, **fully_shard_kwargs)
    return model
