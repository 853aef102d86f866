"""Training through the compiled module on a real dataset (scikit-learn's digits): bf16
compute with fp32 parameters reaches the fp32 run's loss and accuracy."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import amp_graph
from amp_graph.demo import models
from amp_graph.demo.digits import batches, load_digits

STEPS = 300
# Stated tolerances: final test loss within 15% (relative) and test accuracy within 3 points
# of the fp32 run trained from the same initialization on the same batches.
LOSS_RTOL, ACC_ATOL = 0.15, 0.03


def train(model, steps: int = STEPS):
    train_split, test_split = load_digits()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for x, y in batches(train_split, 64, steps):
        loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        logits = model(test_split.x).float()
    return F.cross_entropy(logits, test_split.y).item(), (
        logits.argmax(1) == test_split.y
    ).float().mean().item()


@pytest.mark.parametrize(
    ("factory", "policy"),
    [(models.MLP, "O1"), (models.ConvNet, "O1"), (models.MLP, "O2"), (models.ConvNet, "O2")],
)
def test_bf16_training_reaches_fp32(factory, policy):
    torch.manual_seed(0)
    fp32_model = factory() if factory is not models.ConvNet else factory(channels=16)
    amp_model = copy.deepcopy(fp32_model)
    fp32_loss, fp32_acc = train(fp32_model)
    compiled = amp_graph.compile(amp_model, policy, torch.bfloat16)
    amp_loss, amp_acc = train(compiled)
    assert any(n.meta["amp"].compute_dtype == torch.bfloat16 for n in compiled.graph.nodes)
    assert all(p.dtype == torch.float32 for p in amp_model.parameters())
    assert fp32_acc > 0.9  # the task is learned at all
    assert abs(amp_acc - fp32_acc) <= ACC_ATOL
    assert abs(amp_loss - fp32_loss) <= LOSS_RTOL * fp32_loss + 0.02
