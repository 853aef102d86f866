"""Edges of amp_graph.GradScaler, each against torch as the oracle: a skipped first step of fused
SGD with momentum, the clipping norm of uncoalesced sparse gradients, setters and
``load_state_dict`` held to the constructor's checks, and torch's state dict keeping the entries
it lacks."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn
from graph_helpers import TrainGraph
from scaler_helpers import SyncCounter, make_data, make_model

from amp_graph.scaler import GradScaler, NonFiniteGuard

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _buffers(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [opt.state[p]["momentum_buffer"] for g in opt.param_groups for p in g["params"]]


def _assert_equal(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e), (a - e).abs().max()


# ---- fused SGD with momentum whose first step overflows ---------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("options", "host_reads"),
    [
        ({}, []),  # torch's default: the skip repaired on the device
        ({"nesterov": True}, []),
        ({"dampening": 0.3}, ["item"]),  # decided on the host, that step only
    ],
)
def test_fused_sgd_first_step_skipped_as_if_never_run(options, host_reads, device) -> None:
    """After an overflowing first step and three finite ones, weights and momentum buffers are
    bit-equal to torch's scaler and fused SGD with that first step simply not called, and close
    to torch's scaler with plain SGD (which skips by not calling step)."""
    model = make_model().to(device)
    sgd = dict(lr=0.05, momentum=0.9, **options)
    runs = {
        "ours": (copy.deepcopy(model), GradScaler(device, init_scale=2.0**10), True),
        "fused": (copy.deepcopy(model), torch.amp.GradScaler(device, init_scale=2.0**10), True),
        "plain": (copy.deepcopy(model), torch.amp.GradScaler(device, init_scale=2.0**10), False),
    }
    opts = {k: torch.optim.SGD(m.parameters(), fused=f, **sgd) for k, (m, _, f) in runs.items()}
    for i, (x, y) in enumerate(make_data(4)):
        x, y = x.to(device), y.to(device)
        for name, (m, scaler, _) in runs.items():
            opt = opts[name]
            opt.zero_grad()
            scaler.scale(mse(m(x), y)).backward()
            if i == 0:
                m[2].weight.grad[0, 0] = float("inf")
            if name == "fused" and i == 0:
                scaler.unscale_(opt)  # records the overflow; the step is not called at all
            elif name == "ours" and i == 0:
                with SyncCounter() as counter:
                    assert scaler.step(opt) is None
            else:
                scaler.step(opt)
            scaler.update()
    ours, fused, plain = (runs[k][0] for k in ("ours", "fused", "plain"))
    _assert_equal(list(ours.parameters()), list(fused.parameters()))
    _assert_equal(_buffers(opts["ours"]), _buffers(opts["fused"]))
    for a, e in zip(ours.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, e)
    for a, e in zip(_buffers(opts["ours"]), _buffers(opts["plain"]), strict=True):
        torch.testing.assert_close(a, e)
    assert runs["ours"][1].skipped_steps == 1
    assert counter.calls == host_reads


def test_graph_fused_sgd_first_step_overflow_matches_torch() -> None:
    """A float16 Graph with GradScaler and fused SGD with momentum, inf in the first batch:
    the same weights and momentum as torch's autocast loop with its scaler and plain SGD."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    batches = [(torch.randn(5, 8), torch.randint(0, 4, (5,))) for _ in range(4)]
    batches[0][0][0, 0] = float("inf")

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
    graph = TrainGraph(model, opt, scaler=GradScaler(init_scale=2.0**10))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the slow-float16-on-this-CPU notice
        for x, y in batches:
            graph(x, y)

    ref_opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for x, y in batches:
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(twin(x).float(), y)
        ref_scaler.scale(loss).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()

    assert graph.skipped_steps == 1
    for a, e in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
    for a, e in zip(_buffers(opt), _buffers(ref_opt), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


# ---- clipping uncoalesced sparse gradients ----------------------------------------------------


def _clip_sparse(clip: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An embedding's uncoalesced sparse gradient (index 1 twice) clipped to a norm of 1 by the
    scaler or the guard: (returned norm, clipped gradient, unclipped gradient), dense."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    loss = (emb(torch.tensor([1, 1, 2])) * torch.arange(1.0, 5.0)).sum()
    if clip == "scaler":
        scaler = GradScaler("cpu", init_scale=2.0**8)
        scaler.scale(loss).backward()
        assert not emb.weight.grad.is_coalesced()
        expected = emb.weight.grad.to_dense() / 2.0**8
        norm = scaler.unscale_and_clip_grad_norm_(opt, 1.0)
    else:
        loss.backward()
        expected = emb.weight.grad.to_dense()
        guard = NonFiniteGuard()
        norm = guard.clip_and_check(opt, 1.0)
    return norm, emb.weight.grad.to_dense(), expected


@pytest.mark.parametrize("clip", ["scaler", "guard"])
def test_clip_norm_of_uncoalesced_sparse_gradient(clip: str) -> None:
    """The norm is the dense gradient's (index 1's two contributions add before squaring), and
    the gradient is clipped with torch's rule. (torch's clip_grad_norm_ refuses sparse.)"""
    norm, clipped, dense = _clip_sparse(clip)
    expected_norm = torch.linalg.vector_norm(dense)
    torch.testing.assert_close(norm, expected_norm)
    torch.testing.assert_close(clipped, dense * (1.0 / (expected_norm + 1e-6)))


# ---- setters and load_state_dict: the constructor's checks -------------------------------------


@pytest.mark.parametrize(
    ("setter", "argument", "value"),
    [
        ("set_growth_factor", "growth_factor", 0.5),
        ("set_growth_factor", "growth_factor", 1.0),
        ("set_backoff_factor", "backoff_factor", 0.0),
        ("set_backoff_factor", "backoff_factor", 1.0),
        ("set_growth_interval", "growth_interval", 0),
    ],
)
def test_setters_refuse_what_the_constructor_refuses(setter, argument, value) -> None:
    with pytest.raises(ValueError) as constructed:
        GradScaler("cpu", **{argument: value})
    scaler = GradScaler("cpu")
    before = scaler.state_dict()
    with pytest.raises(type(constructed.value), match=re.escape(str(constructed.value))):
        getattr(scaler, setter)(value)
    assert scaler.state_dict() == before
    GradScaler("cpu", enabled=False).set_growth_factor(0.5)  # torch checks nothing then either


@pytest.mark.parametrize(
    ("entry", "value", "message"),
    [
        ("backoff_factor", 0.0, "backoff_factor must be > 0"),
        ("growth_factor", 1.0, "The growth factor must be > 1.0"),
        ("growth_interval", 0, "growth_interval must be >= 1"),
        ("scale", 0.0, "scale must be finite and > 0"),
        ("scale", float("nan"), "scale must be finite and > 0"),
    ],
)
def test_load_state_dict_refuses_what_the_constructor_refuses(entry, value, message) -> None:
    """torch's scaler saves these without complaint; ours refuses them and loads nothing."""
    scaler = GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(torch.ones(()))
    before = scaler.state_dict()
    theirs = torch.amp.GradScaler("cpu").state_dict()
    with pytest.raises(ValueError, match=message):
        scaler.load_state_dict({**theirs, entry: value})
    assert scaler.state_dict() == before


@pytest.mark.parametrize(
    ("bounds", "expected"), [({"max_scale": 1024.0}, 1024.0), ({"min_scale": 2.0**20}, 2.0**20)]
)
def test_loaded_scale_outside_the_bounds_is_clamped_with_a_warning(bounds, expected) -> None:
    """torch's default state dict (scale 65536) into a scaler with a ceiling or a floor."""
    scaler = GradScaler("cpu", init_scale=expected, **bounds)
    with pytest.warns(UserWarning, match="outside this scaler's"):
        scaler.load_state_dict(torch.amp.GradScaler("cpu").state_dict())
    assert scaler.get_scale() == expected
    assert scaler.scale(torch.ones(())).item() == expected


# ---- torch's state dict keeps the entries it lacks ----------------------------------------------


def test_torch_state_dict_keeps_the_counters_it_lacks() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ours = GradScaler("cpu", init_scale=2.0**10, hysteresis=3)
    for x, y in make_data(2):  # two overflows: allowance 1 of 3 left
        opt.zero_grad()
        ours.scale(mse(model(x), y)).backward()
        model[2].weight.grad[0, 0] = float("nan")
        ours.step(opt)
        ours.update()
    kept = {k: ours.state_dict()[k] for k in ("_hysteresis_tracker", "_skipped_steps")}
    kept["_consecutive_skips"] = ours.state_dict()["_consecutive_skips"]
    assert kept == {"_hysteresis_tracker": 1, "_skipped_steps": 2, "_consecutive_skips": 2}

    theirs = torch.amp.GradScaler("cpu", init_scale=32.0, growth_interval=7)
    ours.load_state_dict(theirs.state_dict())
    loaded = ours.state_dict()
    assert {k: loaded[k] for k in kept} == kept
    assert {k: loaded[k] for k in theirs.state_dict()} == theirs.state_dict()
