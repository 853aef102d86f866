"""Models written the way people write them, for the front-end tests.

Nothing here is written to please a tracer: shapes come from ``x.size()``, masks are
sliced from buffers, modules are torch's own (``nn.TransformerEncoder``,
``nn.MultiheadAttention``, ``nn.LSTM``), hidden states are tuples carried across
batches, updates happen in place, and the model opens its own ``torch.autocast`` blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# --- nanoGPT (Karpathy's model.py, trimmed) --------------------------------------------


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 96
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    flash: bool = False


class LayerNorm(nn.Module):
    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.flash = config.flash
        if not self.flash:
            mask = torch.tril(torch.ones(config.block_size, config.block_size))
            self.register_buffer("bias", mask.view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        config = config or GPTConfig()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()  # noqa: RUF059 (nanoGPT as written)
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


# --- torch's own Transformer layers -------------------------------------------------------


class EncoderClassifier(nn.Module):
    """Token classification with nn.TransformerEncoder (the PyTorch tutorial's shape)."""

    def __init__(
        self, vocab: int = 50, d_model: int = 32, heads: int = 4, layers: int = 2,
        classes: int = 5, batch_first: bool = True, norm_first: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=64, dropout=0.0,
            batch_first=batch_first, norm_first=norm_first,
        )  # fmt: skip
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens, padding_mask=None):
        x = self.embed(tokens) * math.sqrt(self.embed.embedding_dim)
        x = self.encoder(x, src_key_padding_mask=padding_mask)
        pooled = x.mean(dim=1 if self.batch_first else 0)
        return self.head(pooled)


class SelfAttention(nn.Module):
    """nn.MultiheadAttention used directly, returning the attention weights too."""

    def __init__(self, dim: int = 16, heads: int = 2, batch_first: bool = True,
                 need_weights: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=batch_first)
        self.need_weights = need_weights

    def forward(self, x):
        out, weights = self.attn(x, x, x, need_weights=self.need_weights)
        return out, weights


# --- word_language_model (pytorch/examples), LSTM and GRU --------------------------------------


class RNNModel(nn.Module):
    def __init__(self, rnn_type: str = "LSTM", ntoken: int = 40, ninp: int = 16,
                 nhid: int = 32, nlayers: int = 2) -> None:  # fmt: skip
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=0.0)
        self.decoder = nn.Linear(nhid, ntoken)
        self.rnn_type, self.nhid, self.nlayers = rnn_type, nhid, nlayers

    def forward(self, input, hidden):
        emb = self.encoder(input)
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(output)
        decoded = decoded.view(-1, decoded.size(-1))
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int):
        weight = next(self.parameters())
        if self.rnn_type == "LSTM":
            return (
                weight.new_zeros(self.nlayers, bsz, self.nhid),
                weight.new_zeros(self.nlayers, bsz, self.nhid),
            )
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


def repackage_hidden(h):
    """Detach the hidden state from its history (the example's truncated BPTT)."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


# --- in-place updates ---------------------------------------------------------------------


class UpdateBetweenUses(nn.Module):
    """``h`` is read by fc1, updated in place, then read again by fc2."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc0 = nn.Linear(dim, dim)
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x):
        h = torch.tanh(self.fc0(x)).float()
        a = self.fc1(h)
        h.mul_(2.0).add_(1.0)
        b = self.fc2(h)
        return a + b


class UpdateThroughView(nn.Module):
    """A view of ``h`` is written in place; both ``h`` and the input are read afterwards."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x):
        h = x * 1.0
        first = self.fc1(h)
        h[:, :4].mul_(3.0)
        h.transpose(0, 1)[0].zero_()
        return first + self.fc2(h)


class UpdatesInput(nn.Module):
    """Writes into its input (the caller's tensor) after reading it."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x):
        y = self.fc(x)
        x.add_(1.0)
        return y + self.fc2(x)


class EmbeddingMaxNorm(nn.Module):
    """``F.embedding(max_norm=)`` renormalizes the weight's rows in place before reading."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(20, 8) * 3)
        self.head = nn.Linear(8, 4)

    def forward(self, idx):
        a = self.head(self.weight[:3])
        e = F.embedding(idx, self.weight, max_norm=1.0)
        return self.head(e).sum(1) + a.sum()


# --- the model's own autocast blocks ------------------------------------------------------------


class DisabledRegion(nn.Module):
    """A float32 block in the model: Llama-style attention scores computed with autocast off."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        q, k = self.q(x), self.k(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            scores = q.float() @ k.float().transpose(-1, -2)
            weights = scores.softmax(-1)
        return self.out(weights.to(q.dtype) @ q)


class NestedRegion(nn.Module):
    """An inner block that asks for float16 whatever the outer dtype is."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.a(x)
        with torch.autocast(device_type=x.device.type, dtype=torch.float16):
            g = self.b(h)
        return h.float() + g.float()


class RotaryEmbedding(nn.Module):
    """transformers-4 Llama rotary: ``inv_freq`` buffer moved with ``.to(x.device)`` and the
    frequencies computed in float32 inside ``torch.autocast(enabled=False)``."""

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = (
            self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        )
        inv_freq_expanded = inv_freq_expanded.to(x.device)
        position_ids_expanded = position_ids[:, None, :].float()
        device_type = x.device.type
        with torch.autocast(device_type=device_type, enabled=False):
            freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class RotaryAttention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.rotary = RotaryEmbedding(self.head_dim)

    def forward(self, x):
        bsz, q_len, _ = x.size()
        position_ids = torch.arange(q_len, device=x.device).unsqueeze(0).expand(bsz, -1)
        q, k, v = self.qkv(x).view(bsz, q_len, 3, self.heads, self.head_dim).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        cos, sin = self.rotary(v, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(bsz, q_len, -1))


class MaybeAutocast(nn.Module):
    """HF's ``maybe_autocast``: the float32 block exists only when autocast is on."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.proj(x)
        if torch.is_autocast_enabled(x.device.type):
            with torch.autocast(device_type=x.device.type, enabled=False):
                gram = h.float() @ h.float().transpose(-1, -2)
        else:
            gram = h @ h.transpose(-1, -2)
        return gram
