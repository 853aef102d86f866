"""amp_graph.GradScaler as a drop-in for torch.amp.GradScaler: same defaults, same errors.

Every misuse is run on both scalers; ours must raise an instance of torch's exception class
(so ``except`` clauses written for torch catch it) whose message starts with torch's message.
"""

from __future__ import annotations

import inspect
import pickle
from collections.abc import Callable

import pytest
import torch
from scaler_helpers import make_data, make_model

from amp_graph.scaler import GradScaler, ScalerStateError

mse = torch.nn.functional.mse_loss


def _setup(dtype: torch.dtype = torch.float32, fused: bool = False):
    model = make_model(dtype=dtype)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True) if fused else None
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_data(1, dtype=dtype)[0]
    return model, opt, x, y


def _backward(scaler, model, x, y) -> None:
    scaler.scale(mse(model(x), y)).backward()


def step_before_scale(scaler):
    _, opt, _, _ = _setup()
    scaler.step(opt)


def unscale_before_scale(scaler):
    _, opt, _, _ = _setup()
    scaler.unscale_(opt)


def update_before_scale(scaler):
    scaler.update()


def update_before_step(scaler):
    model, _, x, y = _setup()
    _backward(scaler, model, x, y)
    scaler.update()


def step_with_closure(scaler):
    model, opt, x, y = _setup()
    _backward(scaler, model, x, y)
    scaler.step(opt, closure=lambda: 0.0)


def unscale_twice(scaler):
    model, opt, x, y = _setup()
    _backward(scaler, model, x, y)
    scaler.unscale_(opt)
    scaler.unscale_(opt)


def unscale_after_step(scaler):
    model, opt, x, y = _setup()
    _backward(scaler, model, x, y)
    scaler.step(opt)
    scaler.unscale_(opt)


def step_twice(scaler):
    model, opt, x, y = _setup()
    _backward(scaler, model, x, y)
    scaler.step(opt)
    scaler.step(opt)


def step_without_gradients(scaler):
    model, opt, x, y = _setup()
    scaler.scale(mse(model(x), y))  # no backward: no parameter has a .grad
    scaler.step(opt)


def unscale_fp16_gradients(scaler):
    model, opt, x, y = _setup(torch.float16)
    _backward(scaler, model, x, y)
    scaler.unscale_(opt)


def step_fp16_gradients(scaler):
    model, opt, x, y = _setup(torch.float16)
    _backward(scaler, model, x, y)
    scaler.step(opt)


def pickle_mid_iteration(scaler):
    model, opt, x, y = _setup()
    _backward(scaler, model, x, y)
    scaler.unscale_(opt)
    pickle.dumps(scaler)


def load_empty_state_dict(scaler):
    scaler.load_state_dict({})


def new_scale_of_two_elements(scaler):
    model, _, x, y = _setup()
    _backward(scaler, model, x, y)
    scaler.update(torch.ones(2))


def new_scale_requiring_grad(scaler):
    model, _, x, y = _setup()
    _backward(scaler, model, x, y)
    scaler.update(torch.ones((), requires_grad=True))


def scale_a_number(scaler):
    scaler.scale([torch.ones(()), 3])


MISUSES: list[Callable] = [
    step_before_scale,
    unscale_before_scale,
    update_before_scale,
    update_before_step,
    step_with_closure,
    unscale_twice,
    unscale_after_step,
    step_twice,
    step_without_gradients,
    unscale_fp16_gradients,
    step_fp16_gradients,
    pickle_mid_iteration,
    load_empty_state_dict,
    new_scale_of_two_elements,
    new_scale_requiring_grad,
    scale_a_number,
]


def _raised(misuse: Callable, scaler) -> BaseException:
    with pytest.raises(Exception) as info:
        misuse(scaler)
    return info.value


@pytest.mark.parametrize("misuse", MISUSES, ids=lambda f: f.__name__)
def test_misuse_raises_torchs_error(misuse: Callable) -> None:
    theirs = _raised(misuse, torch.amp.GradScaler("cpu"))
    ours = _raised(misuse, GradScaler("cpu"))
    assert isinstance(ours, type(theirs)), (type(ours), type(theirs), str(theirs))
    assert str(ours).startswith(str(theirs)), (str(ours), str(theirs))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"growth_factor": 1.0}, "growth factor"), ({"backoff_factor": 1.0}, "backoff factor")],
)
def test_constructor_errors_match_torch(kwargs: dict, error: str) -> None:
    with pytest.raises(AssertionError, match=error) as theirs:
        torch.amp.GradScaler("cpu", **kwargs)
    with pytest.raises(AssertionError) as ours:
        GradScaler("cpu", **kwargs)
    assert str(ours.value).startswith(str(theirs.value))
    assert isinstance(ours.value, ValueError)  # also a ValueError, like our other argument checks


def test_misuse_errors_are_also_runtime_errors() -> None:
    """Where torch asserts, ours is both an AssertionError and a RuntimeError."""
    error = _raised(step_before_scale, GradScaler("cpu"))
    assert isinstance(error, ScalerStateError)
    assert isinstance(error, RuntimeError) and isinstance(error, AssertionError)
    assert "Call scaler.scale(loss).backward() before step()" in str(error)


def test_defaults_are_torchs() -> None:
    ours = inspect.signature(GradScaler).parameters
    theirs = inspect.signature(torch.amp.GradScaler).parameters
    shared = set(theirs) - {"device"}  # device: see docs/scaler.md, "Differences"
    assert shared <= set(ours)
    for name in shared:
        assert ours[name].default == theirs[name].default, name
    scaler = GradScaler("cpu")
    assert scaler.get_max_scale() == float("inf") and scaler.get_min_scale() == 0.0
    assert scaler.get_hysteresis() == 1


def test_scale_grows_without_a_ceiling_like_torch() -> None:
    """torch's scale has no ceiling: ours neither, by default (it was 2**24 once)."""
    scales = []
    for scaler in (
        GradScaler("cpu", init_scale=2.0**22, growth_interval=1),
        torch.amp.GradScaler("cpu", init_scale=2.0**22, growth_interval=1),
    ):
        model, opt, x, y = _setup()
        trajectory = []
        for _ in range(5):
            opt.zero_grad()
            _backward(scaler, model, x, y)
            scaler.step(opt)
            scaler.update()
            trajectory.append(scaler.get_scale())
        scales.append(trajectory)
    assert scales[0] == scales[1] == [2.0**k for k in range(23, 28)]


def test_fused_optimizer_accepts_fp16_gradients_like_torch() -> None:
    """torch's fused path checks float16 gradients (no unscale_ of its own): ours too."""
    params = []
    for scaler in (GradScaler("cpu", init_scale=8.0), torch.amp.GradScaler("cpu", init_scale=8.0)):
        model, opt, x, y = _setup(torch.float16, fused=True)
        _backward(scaler, model, x, y)
        scaler.step(opt)
        scaler.update()
        params.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*params, strict=True):
        assert torch.equal(a, b)
