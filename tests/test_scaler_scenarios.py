"""torch's own GradScaler scenarios, run three ways on CPU:

* ``control``: no scaling, and the optimizer step is skipped by hand at the iteration where the
  scaled runs get an inf injected into a gradient;
* ``amp_graph``: :class:`amp_graph.GradScaler`;
* ``torch``: :class:`torch.amp.GradScaler`.

Each scenario must give the control's parameters (the scaler skipped exactly the poisoned step
and unscaled exactly), and the same parameters and scale as torch's scaler.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from scaler_helpers import inject_inf, make_data, make_model, params_of

from amp_graph.scaler import GradScaler

N_ITERS = 8
SKIP_ITER = 3
MAX_NORM = 0.2
mse = torch.nn.functional.mse_loss

Scenario = Callable[[list, list, list, Any, bool], Any]


def _step(scaler: Any, opts: list, models: list, i: int, scaling: bool) -> None:
    if scaling:
        if i == SKIP_ITER:
            inject_inf(models[0])
        for opt in opts:
            scaler.step(opt)
        scaler.update()
    elif i != SKIP_ITER:
        for opt in opts:
            opt.step()


def basic(data, models, opts, scaler, scaling):
    (model,), (opt,) = models, opts
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = mse(model(x), y)
        (scaler.scale(loss) if scaling else loss).backward()
        _step(scaler, opts, models, i, scaling)
    return scaler


def clip_after_unscale(data, models, opts, scaler, scaling):
    (model,), (opt,) = models, opts
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = mse(model(x), y)
        if scaling:
            scaler.scale(loss).backward()
            if i == SKIP_ITER:
                inject_inf(model)
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            if i != SKIP_ITER:
                opt.step()
    return scaler


def clip_threshold_times_scale(data, models, opts, scaler, scaling):
    (model,), (opt,) = models, opts
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = mse(model(x), y)
        if scaling:
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM * scaler.get_scale())
            if i == SKIP_ITER:
                inject_inf(model)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            if i != SKIP_ITER:
                opt.step()
    return scaler


def gradient_penalty(data, models, opts, scaler, scaling):
    (model,), (opt,) = models, opts
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = mse(model(x), y)
        params = list(model.parameters())
        if scaling:
            scaled = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
            inv_scale = 1.0 / scaler.get_scale()
            grads = [g * inv_scale for g in scaled]
        else:
            grads = torch.autograd.grad(loss, params, create_graph=True)
        loss = loss + torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        (scaler.scale(loss) if scaling else loss).backward()
        _step(scaler, opts, models, i, scaling)
    return scaler


def accumulation(data, models, opts, scaler, scaling):
    (model,), (opt,) = models, opts
    accumulate = 2
    for i, (x, y) in enumerate(data):
        loss = mse(model(x), y) / accumulate
        (scaler.scale(loss) if scaling else loss).backward()
        if (i + 1) % accumulate == 0:
            _step(scaler, opts, models, i, scaling)
            opt.zero_grad()
    return scaler


def two_models_two_losses_two_optimizers(data, models, opts, scaler, scaling):
    (model0, model1), (opt0, opt1) = models, opts
    for i, (x, y) in enumerate(data):
        opt0.zero_grad()
        opt1.zero_grad()
        out0, out1 = model0(x), model1(x)
        loss0 = mse(0.3 * out0 + 0.7 * out1, y)
        loss1 = mse(0.6 * out0 - 0.4 * out1, y)
        if scaling:
            scaler.scale(loss0).backward(retain_graph=True)
            scaler.scale(loss1).backward()
            if i == SKIP_ITER:
                inject_inf(model1)  # only optimizer 1 must skip
            scaler.unscale_(opt0)  # one optimizer unscaled separately, as in torch's test
            scaler.step(opt0)
            scaler.step(opt1)
            scaler.update()
        else:
            loss0.backward(retain_graph=True)
            loss1.backward()
            opt0.step()
            if i != SKIP_ITER:
                opt1.step()
    return scaler


def _resume(via: str) -> Scenario:
    """Train, then at mid-training continue with a scaler rebuilt from state_dict or pickle."""

    def scenario(data, models, opts, scaler, scaling):
        (model,), (opt,) = models, opts
        for i, (x, y) in enumerate(data):
            if scaling and i == N_ITERS // 2:
                if via == "state_dict":
                    fresh = type(scaler)("cpu", init_scale=1.0, growth_interval=1000)
                    fresh.load_state_dict(scaler.state_dict())
                    scaler = fresh
                else:
                    scaler = pickle.loads(pickle.dumps(scaler))
            opt.zero_grad()
            loss = mse(model(x), y)
            (scaler.scale(loss) if scaling else loss).backward()
            _step(scaler, opts, models, i, scaling)
        return scaler

    return scenario


SCENARIOS: dict[str, tuple[Scenario, int]] = {
    "basic": (basic, 1),
    "clip_after_unscale": (clip_after_unscale, 1),
    "clip_threshold_times_scale": (clip_threshold_times_scale, 1),
    "gradient_penalty": (gradient_penalty, 1),
    "accumulation": (accumulation, 1),
    "two_models": (two_models_two_losses_two_optimizers, 2),
    "state_dict_round_trip": (_resume("state_dict"), 1),
    "pickle_mid_training": (_resume("pickle"), 1),
}

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    # Fused: takes grad_scale/found_inf itself, so the scaler's sync-free path is used.
    "adam_fused": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
}


def _train(name: str, optimizer: str, kind: str) -> tuple[list[torch.Tensor], Any]:
    scenario, n_models = SCENARIOS[name]
    models = [make_model(seed=10 + k) for k in range(n_models)]
    opts = [OPTIMIZERS[optimizer](m.parameters()) for m in models]
    scaler: Any = None
    if kind == "amp_graph":
        scaler = GradScaler("cpu", init_scale=128.0, growth_interval=1)
    elif kind == "torch":
        scaler = torch.amp.GradScaler("cpu", init_scale=128.0, growth_interval=1)
    scaler = scenario(make_data(N_ITERS), models, opts, scaler, kind != "control")
    return params_of(*models), scaler


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_matches_control_and_torch(name: str, optimizer: str) -> None:
    control, _ = _train(name, optimizer, "control")
    ours, our_scaler = _train(name, optimizer, "amp_graph")
    theirs, torch_scaler = _train(name, optimizer, "torch")

    # The scaled run skipped the poisoned step and nothing else, and unscaled exactly.
    for mine, ref in zip(ours, control, strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6)
    # Same numbers as torch's scaler, bit for bit, and the same scale trajectory.
    for mine, ref in zip(ours, theirs, strict=True):
        assert torch.equal(mine, ref)
    assert our_scaler.get_scale() == torch_scaler.get_scale()
    assert our_scaler._get_growth_tracker() == torch_scaler._get_growth_tracker()
    assert our_scaler.skipped_steps == 1


def test_scenarios_detect_a_scaler_that_never_skips() -> None:
    """The harness can fail: a scaler that steps despite the inf poisons the parameters."""

    class NeverSkips(GradScaler):
        def step(self, optimizer, *args, **kwargs):
            if getattr(optimizer, "_step_supports_amp_scaling", False):
                return super().step(optimizer, *args, **kwargs)
            self.unscale_(optimizer)
            state = self._optimizer_state(optimizer)
            state.stage = type(state.stage).STEPPED
            return optimizer.step()

    scenario, _ = SCENARIOS["basic"]
    model = make_model(seed=10)
    opt = OPTIMIZERS["sgd"](model.parameters())
    scenario(make_data(N_ITERS), [model], [opt], NeverSkips("cpu", init_scale=128.0), True)
    control, _ = _train("basic", "sgd", "control")
    assert not all(torch.allclose(a, b) for a, b in zip(params_of(model), control, strict=True))
