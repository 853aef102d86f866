"""Which checker a Graph's step uses, and the schedulers it can step: a disabled GradScaler
must not let inf/nan gradients through, and a scheduler whose ``step`` needs a metric is
refused where it is registered, not after a step already ran."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import amp_graph

FP16 = torch.float16


class Regression(amp_graph.Graph):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler=None) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(optimizer)
        self.config.enable_amp(True, policy="O1", dtype=FP16)
        if scaler is not None:
            self.set_grad_scaler(scaler)

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ((self.model(x) - y) ** 2).mean()
        loss.backward()
        return loss


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator))]
    batches *= 3
    poisoned = batches[1][0].clone()
    poisoned[0, 0] = float("inf")  # the second step's gradients are non-finite
    batches[1] = (poisoned, batches[1][1])
    return batches


def _trained(scaler_factory) -> tuple[nn.Module, Regression]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    graph = Regression(model, torch.optim.SGD(model.parameters(), lr=1e-2), scaler_factory())
    for x, y in _batches():
        graph(x, y)
    return model, graph


@pytest.mark.parametrize(
    "scaler",
    [lambda: amp_graph.GradScaler(enabled=False), lambda: amp_graph.GradScaler("cuda")],
    ids=["enabled=False", "cuda-scaler-without-cuda"],
)
def test_a_disabled_scaler_skips_nonfinite_steps_as_the_guard_does(scaler):
    """A disabled scaler's step applies what it is given: the Graph applied the inf/nan
    gradients (the parameters turned nan, no step counted as skipped). It now checks with
    its non-finite guard, as with no scaler at all: the same parameters, bit for bit."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GradScaler("cuda") without CUDA says it is disabled
        disabled = scaler()
    if disabled.is_enabled():
        pytest.skip("GradScaler('cuda') is enabled where CUDA is")
    model, graph = _trained(lambda: disabled)
    reference, guarded = _trained(lambda: None)
    assert graph.skipped_steps == guarded.skipped_steps == 1
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.isfinite(ours).all()
        assert torch.equal(ours, theirs)


def test_a_scheduler_whose_step_needs_a_metric_is_refused_at_registration():
    """ReduceLROnPlateau's ``step(metric)``: accepted, it raised at the first call, after
    the parameters and the scale had changed and before the step was counted."""
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())

    class Step(amp_graph.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
            self.add_optimizer(optimizer, lr_sch=plateau)

    with pytest.raises(TypeError, match=r"ReduceLROnPlateau\.step needs an argument"):
        Step()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    step_lr = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)

    class WithStepLR(amp_graph.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(optimizer, lr_sch=step_lr)  # step() with no argument: taken

    assert WithStepLR().lr_schedulers == [step_lr]
