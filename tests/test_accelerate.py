"""The accelerate recipe of docs/integrations.md: ``Accelerator(mixed_precision="no")``
(accelerate adds no torch.autocast and no scaler), amp_graph's graph for the dtypes, and
amp_graph's GradScaler around ``accelerator.backward`` for float16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import amp_graph
from amp_graph.demo import models

accelerate = pytest.importorskip("accelerate")


def _batches(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
    return [(x, y)] * n


def _prepare(dtype: torch.dtype):
    accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True)
    model = amp_graph.compile_(models.MLP(), "O1", dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_accelerator_without_mixed_precision_trains_through_amp_graph(dtype):
    accelerator, model, optimizer = _prepare(dtype)
    assert accelerator.scaler is None and isinstance(model, models.MLP)
    scaler = amp_graph.GradScaler(enabled=dtype == torch.float16)  # a no-op for bfloat16
    losses = []
    for x, y in _batches():
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(scaler.scale(loss))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    assert (
        dtype == torch.float16
        or "bfloat16" in amp_graph.frontends.compiler.as_graph_module(model).code
    )
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_float16_step_with_an_inf_gradient_is_skipped_and_the_scale_halves():
    accelerator, model, optimizer = _prepare(torch.float16)
    scaler = amp_graph.GradScaler(init_scale=2.0**10)
    x, y = _batches(1)[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    accelerator.backward(scaler.scale(F.cross_entropy(model(x), y)))
    model.fc1.weight.grad[0, 0] = float("inf")
    scaler.step(optimizer)
    scaler.update()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert scaler.get_scale() == 2.0**9
