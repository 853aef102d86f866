"""A torchtitan-style LM and its tensor-parallel plan, shared by the tests of tensor and
pipeline parallelism (``test_tensor_parallel.py``, ``test_pipeline_parallel.py``).

Written as people write them: pre-norm blocks of attention (``scaled_dot_product_attention``)
and a SiLU MLP; the plan is torchtitan's for its Llama (sequence-parallel norms, inputs
prepared by ``PrepareModuleInput``, column-then-row projections).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, HEADS, VOCAB, SEQ, BATCH = 32, 4, 64, 8, 2
STEPS = 3


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: each rank computes its own heads (column-parallel projections)
        q = self.wq(x).view(b, t, -1, DIM // HEADS).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, DIM // HEADS).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, DIM // HEADS).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, 4 * DIM)
        self.w2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.LayerNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def parallel_lm(
    mesh: Any,
    loss_parallel: bool = False,
    dp_mesh: Any = None,
    vocab_parallel: bool = True,
) -> LM:
    """torchtitan's plan for its Llama, on :class:`LM`; with ``dp_mesh``, FSDP2 over it.
    ``vocab_parallel``: the embedding row-parallel (torchtitan's), else column-parallel."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = LM()
    parallelize_module(
        model,
        mesh,
        {
            "tok_embeddings": (RowwiseParallel if vocab_parallel else ColwiseParallel)(
                input_layouts=Replicate(), output_layouts=Shard(1)
            ),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        },
    )
    for block in model.layers:
        prepare = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
        parallelize_module(
            block,
            mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": prepare,
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": prepare,
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    if dp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


def lm_batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + seed)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
        )
        for _ in range(STEPS)
    ]


def full(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    return {n: whole(p.grad if grads else p) for n, p in model.named_parameters()}
