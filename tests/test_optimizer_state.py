"""A ``Graph``'s optimizer states in its ``state_dict`` (``amp_graph.training.optimizer_state``):
fillable in place by ``torch.distributed.checkpoint`` before the first step, without
changing the optimizer, and loaded back only where the optimizer had stepped.

The 2-D (FSDP2 x TP) resume is in ``test_fsdp_tp_2d.py``; here one process, where DCP runs
without a process group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import amp_graph
from amp_graph.training.optimizer_state import STEPPED

STEPS = 4


def make(lr: float | torch.Tensor = 1e-2) -> tuple[nn.Module, amp_graph.Graph]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)

    class TrainStep(amp_graph.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(opt, lr_sch=torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
            self.config.enable_amp(True, policy="O1", dtype=torch.bfloat16)

        def build(self, x: torch.Tensor) -> torch.Tensor:
            loss = self.model(x).float().square().mean()
            loss.backward()
            return loss

    return model, TrainStep()


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(16, 8, generator=gen) for _ in range(STEPS)]


def test_state_dict_of_a_fresh_graph_allocates_the_state_and_leaves_the_optimizer_as_it_was() -> (
    None
):
    for lr in (1e-2, torch.tensor(1e-2)):
        model, step = make(lr)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        [entry] = step.state_dict()["optimizers"]
        assert entry[STEPPED] is False
        assert len(entry["state"]) == 4  # two weights, two biases
        for values in entry["state"].values():
            assert not values["exp_avg"].any() and not values["exp_avg_sq"].any()
        assert entry["param_groups"][0]["lr"] == lr  # as set, not the 0 used to allocate
        [optimizer] = step.optimizers
        assert len(optimizer.state) == 0
        assert optimizer.param_groups[0]["lr"] is lr
        for name, param in model.named_parameters():
            assert param.grad is None, name
            assert torch.equal(param, params[name]), name


def test_a_saved_fresh_graph_loads_fresh_and_trains_as_a_fresh_one(tmp_path: Path) -> None:
    _, step = make()
    torch.save(step.state_dict(), tmp_path / "fresh.pt")
    reference_model, reference = make()
    losses = [reference(x).item() for x in batches()]
    model, loaded = make()
    loaded.load_state_dict(torch.load(tmp_path / "fresh.pt", weights_only=True))
    assert len(loaded.optimizers[0].state) == 0
    assert [loaded(x).item() for x in batches()] == losses
    for name, value in reference_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process
def test_dcp_checkpoint_resumes_the_optimizer_bit_for_bit(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    data = batches()
    reference_model, reference = make()
    losses = [reference(x).item() for x in data]
    _, step = make()
    before = [step(x).item() for x in data[:2]]
    dcp.save({"graph": step}, checkpoint_id=tmp_path)
    model, resumed = make()
    dcp.load({"graph": resumed}, checkpoint_id=tmp_path)
    assert before + [resumed(x).item() for x in data[2:]] == losses
    for name, value in reference_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    ours, theirs = (g.optimizers[0].state_dict()["state"] for g in (resumed, reference))
    for index, values in theirs.items():
        for key, value in values.items():
            assert torch.equal(ours[index][key], value), (index, key)


def test_a_plain_optimizer_state_dict_still_loads() -> None:
    """Graph state dicts saved before the flag existed: every state is loaded."""
    _, trained = make()
    for x in batches()[:2]:
        trained(x)
    state = trained.state_dict()
    state["optimizers"] = [o.state_dict() for o in trained.optimizers]  # no flag
    _, step = make()
    step.load_state_dict(state)
    assert len(step.optimizers[0].state) == 4
