"""A compiled module's repro bundle keeps the gradients backward computed, at the loss scale.

After backward the loop changes the gradients in place: ``scaler.step`` (or ``unscale_``)
divides them by the scale, ``clip_grad_norm_`` multiplies them, ``zero_grad(set_to_none=
False)`` zeroes them. The bundle must hold them as backward left them, which replay
recomputes. The model has no BatchNorm, so the overflowing step leaves most gradients
finite: a bundle holding unscaled gradients differs from the replay by exactly the scale.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import amp_graph

HOT_STEP = 2
SCALE = 2.0**8
SCALERS = {
    "torch GradScaler": lambda: torch.amp.GradScaler("cpu", init_scale=SCALE),
    "amp_graph GradScaler": lambda: amp_graph.GradScaler(init_scale=SCALE),
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def train(tmp_path, make_scaler, *, clip: bool = False, set_to_none: bool = True):
    """The docs' loop; returns (monitor, the gradients of HOT_STEP as backward left them)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = make_scaler()
    compiled = amp_graph.compile(model, "O1", torch.float16, output_dtype=torch.float32)
    monitor = amp_graph.monitor(compiled, every=1, repro_dir=tmp_path, scaler=scaler, optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    hot = {}
    for step in range(4):
        x = torch.randn(8, 16, generator=gen) * (1e4 if step == HOT_STEP else 1.0)
        y = torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad(set_to_none=set_to_none)
        scaler.scale(nn.functional.cross_entropy(compiled(x), y)).backward()
        if step == HOT_STEP:
            hot = {n: p.grad.clone() for n, p in model.named_parameters()}
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    monitor.close()
    return monitor, hot


LOOPS = {
    "step": {},
    "unscale_ and clip": {"clip": True},
    "zero_grad(set_to_none=False)": {"set_to_none": False},
}


@pytest.mark.parametrize("loop", LOOPS.values(), ids=LOOPS.keys())
@pytest.mark.parametrize("make_scaler", SCALERS.values(), ids=SCALERS.keys())
def test_the_bundle_keeps_the_gradients_at_the_loss_scale_and_replays_bit_for_bit(
    tmp_path, make_scaler, loop
):
    monitor, hot = train(tmp_path, make_scaler, **loop)
    path = monitor.repro_path
    assert path == tmp_path / f"step_{HOT_STEP}"
    recorded = torch.load(path / "step_result.pt", weights_only=True)["grads"]
    assert recorded.keys() == hot.keys()
    for name, grad in hot.items():  # bit for bit, NaNs in the same places
        assert torch.equal(recorded[name].nan_to_num(), grad.nan_to_num()), name
    finite = torch.cat([g[g.isfinite()] for g in hot.values()])
    assert finite.count_nonzero() > 100  # the case where scaled and unscaled differ
    assert any(not g.isfinite().all() for g in hot.values())  # the step was skipped
    result = amp_graph.replay(path, model=_model(), numerics=False)
    assert result.skipped and result.reproduced, result.mismatches
