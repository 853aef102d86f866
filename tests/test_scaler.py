"""Semantics of amp_graph.GradScaler / StaticGradScaler on CPU, against torch.amp.GradScaler."""

from __future__ import annotations

import doctest
import logging
import pickle
import random
import warnings

import pytest
import torch
from scaler_helpers import SyncCounter, make_data, make_model

import amp_graph.ops.scaler_ops
import amp_graph.scaler
import amp_graph.scaler.grad_scaler
from amp_graph.ops import scaler_ops as ops
from amp_graph.scaler import GradScaler, StaticGradScaler

mse = torch.nn.functional.mse_loss


def _iteration(model, opt, scaler, x, y, *, poison: bool = False):
    opt.zero_grad()
    loss = mse(model(x), y)
    scaler.scale(loss).backward()
    if poison:
        model[2].weight.grad[0, 0].fill_(float("nan"))  # a kernel, no host-to-device copy
    result = scaler.step(opt)
    scaler.update()
    return result


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


# ---- pass-through, return values, attributes ------------------------------------------------


def test_disabled_scaler_is_a_pass_through() -> None:
    model, ref = make_model(), make_model()
    opt, ref_opt = _sgd(model), _sgd(ref)
    scaler = GradScaler(enabled=False)
    for x, y in make_data(3):
        loss = mse(model(x), y)
        assert scaler.scale(loss) is loss
        loss.backward()
        scaler.unscale_(opt)
        assert scaler.step(opt, closure=lambda: 7.0) == 7.0  # closures pass through too
        scaler.update()
        opt.zero_grad()
        mse(ref(x), y).backward()
        ref_opt.step(closure=lambda: 7.0)
        ref_opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {} and scaler.skipped_steps == 0
    assert not scaler.is_enabled()
    scaler.load_state_dict({"anything": 1})  # no-op
    assert pickle.loads(pickle.dumps(scaler)).is_enabled() is False
    assert bool(scaler.last_step_taken)


def test_step_returns_the_optimizers_value_or_none_when_skipped() -> None:
    class Returning(torch.optim.SGD):
        def step(self, closure=None):
            super().step()
            return "stepped"

    model = make_model()
    x, y = make_data(1)[0]
    for scaler in (GradScaler("cpu"), torch.amp.GradScaler("cpu")):
        opt = Returning(model.parameters(), lr=0.1)
        assert _iteration(model, opt, scaler, x, y) == "stepped"
        assert _iteration(model, opt, scaler, x, y, poison=True) is None


@pytest.mark.parametrize("fused", [False, True])
def test_last_step_taken_and_skip_counter(fused: bool) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)
    scaler = GradScaler("cpu", init_scale=4.0)
    assert scaler.last_step_taken is None
    poison = [False, True, True, False, True]
    for (x, y), bad in zip(make_data(len(poison)), poison, strict=True):
        _iteration(model, opt, scaler, x, y, poison=bad)
        taken = scaler.last_step_taken
        assert isinstance(taken, torch.Tensor) and taken.dtype == torch.bool and taken.ndim == 0
        assert bool(taken) is (not bad)
    assert scaler.skipped_steps == 3
    assert scaler.consecutive_skipped_steps == 1
    # Adam's own step counter advanced only on the taken steps.
    assert int(opt.state[model[0].weight]["step"]) == 2


def test_no_lr_scheduler_warning_on_skipped_steps() -> None:
    """torch's scaler triggers "lr_scheduler.step() before optimizer.step()" when the first step
    is skipped (the test can see the warning); ours must not."""
    x, y = make_data(1)[0]
    messages = {}
    for name, scaler in (("torch", torch.amp.GradScaler("cpu")), ("ours", GradScaler("cpu"))):
        model = make_model()
        opt = _sgd(model)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _iteration(model, opt, scaler, x, y, poison=True)
            sched.step()
        messages[name] = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    assert messages["torch"], "torch's scaler should show the warning this test guards against"
    assert messages["ours"] == []


# ---- the scale update ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_update_op_matches_torch_amp_update_scale(seed: int) -> None:
    rng = random.Random(seed)
    growth, backoff, interval = rng.choice([(2.0, 0.5, 3), (1.7, 0.3, 2), (3.0, 0.25, 1)])
    scale, tracker = torch.tensor(2.0**10), torch.tensor(0, dtype=torch.int32)
    our_scale, trackers = torch.tensor(2.0**10), torch.tensor([0, 1, 0, 0])
    for _ in range(60):
        found = torch.tensor(float(rng.random() < 0.3))
        torch._amp_update_scale_(scale, tracker, found, growth, backoff, interval)
        ops.update_scale_(our_scale, trackers, found, growth, backoff, interval, 1, 0.0, 1e38)
        assert our_scale.item() == scale.item()
        assert trackers[ops.GROWTH_TRACKER].item() == tracker.item()


def _trajectory(scaler: GradScaler, flags: str) -> list[float]:
    model = make_model()
    opt = _sgd(model)
    out = []
    for (x, y), flag in zip(make_data(len(flags)), flags, strict=True):
        _iteration(model, opt, scaler, x, y, poison=flag == "1")
        out.append(scaler.get_scale())
    return out


def test_hysteresis_backs_off_after_consecutive_overflows_only() -> None:
    scaler = GradScaler("cpu", init_scale=64.0, growth_interval=100, hysteresis=3)
    #                         1     1     0     1     1     1     1     0     1
    assert _trajectory(scaler, "110111101") == [64, 64, 64, 64, 64, 32, 16, 16, 16]
    assert scaler.skipped_steps == 7


def test_min_and_max_scale_clamp() -> None:
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=1, min_scale=2.0, max_scale=32.0)
    assert _trajectory(scaler, "0001111") == [16, 32, 32, 16, 8, 4, 2]
    assert _trajectory(scaler, "1") == [2]


def test_static_scaler_keeps_its_scale_and_still_skips() -> None:
    scaler = StaticGradScaler(128.0)
    assert _trajectory(scaler, "0101100") == [128.0] * 7
    assert scaler.skipped_steps == 3
    with pytest.raises(ValueError, match="fixed scale"):
        scaler.update(64.0)


def test_update_with_new_scale() -> None:
    scaler = GradScaler("cpu")
    scaler.scale(torch.ones(()))
    scaler.update(16.0)
    assert scaler.get_scale() == 16.0
    scaler.update(torch.tensor(8.0))
    assert scaler.get_scale() == 8.0


# ---- misuse --------------------------------------------------------------------------------


def test_invalid_arguments_are_refused_early() -> None:
    """Arguments torch accepts but that cannot work (torch's refusals: test_scaler_torch_parity)."""
    for kwargs in (
        {"backoff_factor": 0.0},
        {"growth_interval": 0},
        {"hysteresis": 0},
        {"min_scale": 4.0, "max_scale": 2.0},
        {"init_scale": 2.0**30, "max_scale": 2.0**24},
        {"init_scale": -1.0},
        {"warn_after_skipped_steps": 0},
    ):
        with pytest.raises(ValueError):
            GradScaler("cpu", **kwargs)
    with pytest.raises(ValueError, match="hysteresis"):
        GradScaler("cpu").set_hysteresis(0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_cuda_scaler_without_cuda_warns_and_disables() -> None:
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = GradScaler("cuda")
    assert not scaler.is_enabled()


# ---- dtypes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gradients_of_every_float_dtype(dtype: torch.dtype) -> None:
    """fp16/bf16/fp32 parameters and grads. float16 gradients go through a fused optimizer:
    unscale_ refuses them, as torch does (test_scaler_torch_parity)."""
    model, control = make_model(dtype=dtype), make_model(dtype=dtype)
    fused = dtype == torch.float16
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
    control_opt = torch.optim.SGD(control.parameters(), lr=0.1, fused=fused)
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    poison = [False, False, True, False]
    for (x, y), bad in zip(make_data(4, dtype=dtype), poison, strict=True):
        _iteration(model, opt, scaler, x, y, poison=bad)
        assert bool(scaler.last_step_taken) is (not bad)
        control_opt.zero_grad()
        mse(control(x), y).backward()
        if not bad:
            control_opt.step()
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for a, b in zip(model.parameters(), control.parameters(), strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_sparse_gradients_match_torch() -> None:
    results = []
    for scaler in (GradScaler("cpu", init_scale=4.0), torch.amp.GradScaler("cpu", init_scale=4.0)):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.5)
        for step in range(3):
            opt.zero_grad()
            scaler.scale(emb(torch.tensor([1, 2, 2, 7])).sum()).backward()
            if step == 1:
                emb.weight.grad._values()[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        results.append((emb.weight.detach().clone(), scaler.get_scale()))
    assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1]


# ---- fused clipping --------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True])
def test_unscale_and_clip_grad_norm_matches_unscale_then_clip(fused: bool) -> None:
    runs = []
    for ours in (True, False):
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)
        scaler = GradScaler("cpu", init_scale=2.0**10)
        norms = []
        for i, (x, y) in enumerate(make_data(4)):
            opt.zero_grad()
            scaler.scale(mse(model(x), y)).backward()
            if i == 2:
                model[0].bias.grad[1] = float("inf")
            if ours:
                norms.append(scaler.unscale_and_clip_grad_norm_(opt, 0.05))
            else:
                scaler.unscale_(opt)
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
            scaler.step(opt)
            scaler.update()
        runs.append(([p.detach().clone() for p in model.parameters()], norms))
    (ours_p, ours_n), (ref_p, ref_n) = runs
    for a, b in zip(ours_n, ref_n, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0.0, equal_nan=True)
    for a, b in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# ---- diagnosis -------------------------------------------------------------------------------


def test_nonfinite_grads_names_parameters() -> None:
    model = make_model()
    opt = _sgd(model)
    x, y = make_data(1)[0]
    named = GradScaler("cpu", named_parameters=model)
    anonymous = GradScaler("cpu")
    for scaler in (named, anonymous):
        opt.zero_grad()
        scaler.scale(mse(model(x), y)).backward()
        model[0].bias.grad[3] = float("-inf")
        model[2].weight.grad[1, 1] = float("nan")
        scaler.step(opt)
        scaler.update()
    assert named.nonfinite_grads() == ["0.bias", "2.weight"]
    assert anonymous.nonfinite_grads() == [
        "optimizer[0].param_groups[0][1] (shape (8,), torch.float32)",
        "optimizer[0].param_groups[0][2] (shape (8, 8), torch.float32)",
    ]
    opt.zero_grad()
    named.scale(mse(model(x), y)).backward()
    assert named.nonfinite_grads() == []  # looks at the grads as they are now


def test_one_warning_after_n_consecutive_skips(caplog: pytest.LogCaptureFixture) -> None:
    model = make_model()
    opt = _sgd(model)
    scaler = GradScaler("cpu", named_parameters=model, warn_after_skipped_steps=3)
    flags = "1111110" + "111"  # a streak of 6 (one warning), a good step, a new streak of 3
    with caplog.at_level(logging.WARNING, logger="amp_graph.scaler"):
        for (x, y), flag in zip(make_data(len(flags)), flags, strict=True):
            _iteration(model, opt, scaler, x, y, poison=flag == "1")
    warned = [r for r in caplog.records if "consecutive" in r.getMessage()]
    assert len(warned) == 2
    assert "3 consecutive" in warned[0].getMessage() and "2.weight" in warned[0].getMessage()


# ---- state -----------------------------------------------------------------------------------


def test_state_dict_round_trip_and_pickle_keep_hysteresis_and_counters() -> None:
    kwargs = {"init_scale": 64.0, "growth_interval": 3, "hysteresis": 2, "min_scale": 1.0}
    flags = "0101" + "1011010"
    reference = GradScaler("cpu", **kwargs)
    expected = _trajectory(reference, flags)

    first = GradScaler("cpu", **kwargs)
    head = _trajectory(first, flags[:4])
    state = first.state_dict()
    # Mid-allowance: one overflow tolerated, the next one backs off.
    assert state["_hysteresis_tracker"] == 1 and state["_skipped_steps"] == 2
    assert state["_growth_tracker"] == 0 and state["hysteresis"] == 2
    via_state = GradScaler("cpu")  # defaults: everything must come from the state dict
    via_state.load_state_dict(state)
    via_pickle = pickle.loads(pickle.dumps(first))
    for resumed in (via_state, via_pickle):
        assert head + _trajectory(resumed, flags[4:]) == expected
        assert resumed.state_dict() == reference.state_dict()


def test_loads_torch_state_dict() -> None:
    theirs = torch.amp.GradScaler("cpu", init_scale=32.0, growth_interval=7)
    model = make_model()
    x, y = make_data(1)[0]
    _iteration(model, _sgd(model), theirs, x, y)
    ours = GradScaler("cpu")
    ours.load_state_dict(theirs.state_dict())
    assert ours.get_scale() == 32.0 and ours.get_growth_interval() == 7
    assert ours._get_growth_tracker() == 1


def test_getters_and_setters() -> None:
    scaler = GradScaler("cpu", hysteresis=2, min_scale=1.0, max_scale=2.0**20)
    scaler.set_growth_factor(3.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(5)
    scaler.set_hysteresis(4)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (3.0, 0.25)
    assert (scaler.get_growth_interval(), scaler.get_hysteresis()) == (5, 4)
    assert (scaler.get_min_scale(), scaler.get_max_scale()) == (1.0, 2.0**20)
    assert scaler.get_scale() == 2.0**16


# ---- synchronizations ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make_optimizer", "syncs_per_step"),
    [
        (lambda p: torch.optim.Adam(p, lr=0.01, fused=True), 0),
        (lambda p: torch.optim.AdamW(p, lr=0.01, fused=True), 0),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True), 0),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1),
    ],
)
def test_synchronizations_per_iteration(make_optimizer, syncs_per_step: int) -> None:
    """Counts synchronizing tensor calls over whole iterations (scale, backward, step, update),
    overflowing ones included.

    The one extra read per streak of skips is the warning naming the non-finite gradients.
    Exempt: reads of ``scaler._skips._status_host``, the host mirror of the counters behind the
    consecutive-skip warning. On CUDA it is pinned memory filled by a non-blocking copy and read
    only after ``event.query()`` says the copy landed, so it never waits (the CUDA test below
    checks that with ``torch.cuda.set_sync_debug_mode``); on CPU it is a plain host read.
    """
    model = make_model()
    opt = make_optimizer(model.parameters())
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2, warn_after_skipped_steps=2)
    data = make_data(6)
    for i, (x, y) in enumerate(data):
        with SyncCounter(ignore=lambda t: t is scaler._skips._status_host) as counter:
            _iteration(model, opt, scaler, x, y, poison=i in (1, 2, 3))
        # Iteration 2 completes a streak of 2 skips: the warning reads the grads to name them.
        warning = ["tolist"] if i == 2 else []
        assert counter.calls == ["item"] * syncs_per_step + warning, counter.calls


def test_sync_counter_sees_synchronizations() -> None:
    """The counter is not blind: torch's scaler syncs once per step with a plain optimizer."""
    model = make_model()
    opt = _sgd(model)
    scaler = torch.amp.GradScaler("cpu")
    x, y = make_data(1)[0]
    with SyncCounter() as counter:
        _iteration(model, opt, scaler, x, y)
        scaler.get_scale()
    assert counter.calls == ["item", "item"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_path_makes_no_cuda_synchronization() -> None:
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    scaler = GradScaler("cuda", warn_after_skipped_steps=2)
    data = [(x.cuda(), y.cuda()) for x, y in make_data(4)]
    _iteration(model, opt, scaler, *data[0])  # warm-up: lazy init, extension build
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, (x, y) in enumerate(data[1:]):
            _iteration(model, opt, scaler, x, y, poison=i == 1)
    finally:
        torch.cuda.set_sync_debug_mode(0)


# ---- documentation examples ------------------------------------------------------------------


@pytest.mark.parametrize(
    "module", [amp_graph.scaler, amp_graph.scaler.grad_scaler, amp_graph.ops.scaler_ops]
)
def test_docstring_examples(module) -> None:
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
