"""FusedStep: a fused torch optimizer's step without torch.optim's per-call Python.

Every case runs the same steps through ``optimizer.step()`` and through ``FusedStep`` from the
same start and compares weights and optimizer state bit for bit after each step; each also
counts the steps FusedStep took itself, so that a fast path that silently never runs fails.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import torch.nn as nn
import torch.optim.optimizer as torch_optimizer
from graph_helpers import TrainGraph

from amp_graph.demo import models
from amp_graph.scaler import GradScaler
from amp_graph.training.fused_step import FusedStep

BF16 = torch.bfloat16
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]
HAS_DECOUPLED = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam).parameters


def _model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(device)


def _grads(model: nn.Module, step: int, skip: set[str] = frozenset()) -> None:
    """Deterministic gradients of a step (no backward: the test is about the optimizer)."""
    gen = torch.Generator().manual_seed(step)
    for name, p in model.named_parameters():
        p.grad = None if name in skip else torch.randn(p.shape, generator=gen).to(p.device)


def _assert_same(ref_model, ref_opt, model, opt) -> None:
    for (name, a), b in zip(ref_model.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), name
        ref_state, state = ref_opt.state.get(a, {}), opt.state.get(b, {})
        assert ref_state.keys() == state.keys(), name
        for key in ref_state:
            assert torch.equal(torch.as_tensor(ref_state[key]), torch.as_tensor(state[key])), key


ADAMS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "adam_amsgrad_maximize_decay": lambda p: torch.optim.Adam(
        p, lr=1e-2, betas=(0.8, 0.95), amsgrad=True, maximize=True, weight_decay=0.1, fused=True
    ),
    "adamw_tensor_lr": lambda p: torch.optim.AdamW(p, lr=torch.tensor(3e-3), fused=True),
    "adamw_device_lr": lambda p: torch.optim.AdamW(
        p, lr=torch.tensor(3e-3, device=p[0].device), fused=True
    ),
    "sgd_nesterov_decay": lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, fused=True
    ),
    "sgd_dampening": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5, dampening=0.3, fused=True),
    "sgd_no_momentum": lambda p: torch.optim.SGD(p, lr=0.05, fused=True),
}
if HAS_DECOUPLED:
    ADAMS["adam_decoupled"] = lambda p: torch.optim.Adam(
        p, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, fused=True
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(ADAMS))
def test_bit_identical_to_optimizer_step(name, device):
    ref_model, model = _model(device), _model(device)
    ref_opt = ADAMS[name](list(ref_model.parameters()))
    opt = ADAMS[name](list(model.parameters()))
    fused = FusedStep(opt)
    for step in range(5):
        skip = {"2.bias"} if step == 3 else set()  # a parameter without a gradient this step
        _grads(ref_model, step, skip)
        _grads(model, step, skip)
        ref_opt.step()
        assert fused() is None
        _assert_same(ref_model, ref_opt, model, opt)
    assert fused.direct_steps == 4  # the first step creates the state through torch's step


@pytest.mark.parametrize("device", DEVICES)
def test_two_groups_and_a_skipped_step_with_found_inf_and_grad_scale(device):
    """The attributes a scaler or guard sets: a skipped step changes nothing (step counts
    included); grad_scale divides inside the kernel, as in torch's step."""

    def make(model):
        return torch.optim.AdamW(
            [
                {"params": model[0].parameters(), "lr": 1e-3},
                {"params": model[2].parameters(), "lr": 1e-2, "weight_decay": 0.0},
            ],
            fused=True,
        )

    ref_model, model = _model(device), _model(device)
    ref_opt, opt = make(ref_model), make(model)
    fused = FusedStep(opt)
    for step, found in enumerate([0.0, 0.0, 1.0, 0.0]):
        _grads(ref_model, step)
        _grads(model, step)
        for o in (ref_opt, opt):
            o.found_inf = torch.tensor(found, device=device)
            o.grad_scale = torch.tensor(4.0, device=device)
        before = [p.clone() for p in model.parameters()]
        ref_opt.step()
        fused()
        _assert_same(ref_model, ref_opt, model, opt)
        if found:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert fused.direct_steps == 3
    assert int(opt.state[model[0].weight]["step"]) == 3  # the skipped step is not counted


def test_a_scheduler_changes_the_learning_rate_and_sees_the_step():
    ref_model, model = _model(), _model()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    fused = FusedStep(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()"
        for step in range(4):
            _grads(ref_model, step)
            _grads(model, step)
            ref_opt.step()
            fused()
            ref_sched.step()
            sched.step()
            _assert_same(ref_model, ref_opt, model, opt)
    assert fused.direct_steps == 3
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 16)


def test_load_state_dict_mid_run_is_seen():
    ref_model, model = _model(), _model()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    fused = FusedStep(opt)
    for step in range(3):
        _grads(ref_model, step)
        _grads(model, step)
        ref_opt.step()
        fused()
    saved = copy.deepcopy(ref_opt.state_dict())
    for step in range(3, 5):  # steps the load takes back
        _grads(model, step)
        fused()
    opt.load_state_dict(saved)
    model.load_state_dict(ref_model.state_dict())
    for step in range(5, 7):
        _grads(ref_model, step)
        _grads(model, step)
        ref_opt.step()
        fused()
        _assert_same(ref_model, ref_opt, model, opt)
    assert fused.direct_steps == 6


class _MyAdamW(torch.optim.AdamW):
    pass


@pytest.mark.parametrize(
    "case", ["subclass", "not_fused", "instance_hook", "global_hook", "step_replaced", "profiler"]
)
def test_defers_to_optimizer_step_when_torch_would_do_more(case):
    """Each case makes ``step()`` do something FusedStep does not: it must run torch's step
    (whose result, and hooks, then follow), never the kernel alone."""
    model = _model()
    maker = {"subclass": _MyAdamW}.get(case, torch.optim.AdamW)
    opt = maker(model.parameters(), lr=1e-2, fused=case != "not_fused")
    fused = FusedStep(opt)
    seen = []
    handle = None
    if case == "instance_hook":
        opt.register_step_post_hook(lambda *args: seen.append("hook"))
    elif case == "global_hook":
        handle = torch_optimizer.register_optimizer_step_post_hook(
            lambda *args: seen.append("hook")
        )
    elif case == "step_replaced":
        torch_step = opt.step
        opt.step = lambda *a, **k: (seen.append("replaced"), torch_step(*a, **k))[1]
    try:
        for step in range(3):
            _grads(model, step)
            if case == "profiler":
                with torch.profiler.profile() as prof:
                    fused()
                names = {e.name for e in prof.events()}
                seen.append(any(n.startswith("Optimizer.step#") for n in names))
            else:
                fused()
    finally:
        if handle is not None:
            handle.remove()
    assert fused.direct_steps == 0
    assert len(opt.state) == 4  # torch's step ran and created the state
    if case in ("instance_hook", "global_hook", "step_replaced", "profiler"):
        assert seen and all(seen) and len(seen) == 3


def test_defers_with_a_closure_and_with_mixed_dtypes_in_a_group():
    model = _model()
    model[2].to(BF16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    fused = FusedStep(opt)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        fused()
    assert fused.direct_steps == 0 and len(opt.state) == 4
    single = _model()
    opt = torch.optim.AdamW(single.parameters(), lr=1e-2, fused=True)
    fused = FusedStep(opt)
    for step in range(2):
        _grads(single, step)
        assert fused(lambda: torch.tensor(1.0)) == torch.tensor(1.0)  # closure: torch's step
    assert fused.direct_steps == 0


def test_an_unsupported_optimizer_is_stepped_by_torch():
    model = _model()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-2)
    fused = FusedStep(opt)
    _grads(model, 0)
    before = model[0].weight.clone()
    fused()
    assert fused.direct_steps == 0 and not torch.equal(before, model[0].weight)


# ---- in a Graph ------------------------------------------------------------------------------


def _graph(model, fused_steps: bool, dtype: torch.dtype):
    scaler = GradScaler(init_scale=2.0**10, growth_interval=2) if dtype == torch.float16 else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    g = TrainGraph(model, opt, dtype=dtype, scaler=scaler)
    if not fused_steps:
        build_step = g._builder._step_graph

        def torch_steps(captured):
            step = build_step(captured)
            step.fused_step_0 = None  # the step node then calls optimizer.step()
            return step

        g._builder._step_graph = torch_steps
    return g


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16_guard", "fp16_scaler"])
def test_a_graph_steps_through_it_bit_for_bit_with_torch_step_and_skips_inf(dtype, device):
    base = models.MLP().to(device)
    torch.manual_seed(1)
    batches = [
        (torch.randn(16, 64, device=device), torch.randint(0, 10, (16,), device=device))
        for _ in range(6)
    ]
    batches[3][0][0, 0] = float("inf")  # non-finite gradients: the step is skipped
    graphs = [_graph(copy.deepcopy(base), fused, dtype) for fused in (True, False)]
    for x, y in batches:
        losses = [g(x, y) for g in graphs]
        torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0, equal_nan=True)
        for a, b in zip(graphs[0].model.parameters(), graphs[1].model.parameters(), strict=True):
            assert torch.equal(a, b)
    assert graphs[0].skipped_steps == graphs[1].skipped_steps == 1
    if dtype == torch.float16:  # backed off once, grown twice: the same scale either way
        scales = [g.grad_scaler.get_scale() for g in graphs]
        assert scales[0] == scales[1] == 2.0**10 / 2 * 2 * 2
    step = graphs[0].step_graph
    # every step after the first, the skipped one included (the kernel skips on found_inf)
    assert "fused_step_0" in step.code and step.fused_step_0.direct_steps == 5
    assert graphs[1].step_graph.fused_step_0 is None


def test_found_inf_on_another_device_than_the_parameters_defers():
    """torch's step would move the flag; FusedStep leaves that to it."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    fused = FusedStep(opt)
    _grads(model, 0)
    fused()  # creates the state
    _grads(model, 1)
    opt.found_inf = torch.tensor(0.0, device="meta")
    with pytest.raises(NotImplementedError):  # torch's step, moving a meta flag, fails
        fused()
    del opt.found_inf
    assert fused.direct_steps == 0


@cuda
def test_a_cuda_graph_capture_defers_and_replays_the_same_steps():
    """Inside a capture FusedStep runs torch's step (which checks ``capturable``); the
    warm-up steps before it are its own; the replays equal torch's eager steps."""
    ref_model, model = _model("cuda"), _model("cuda")

    def make(m):
        return torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True, capturable=True)

    ref_opt, opt = make(ref_model), make(model)
    fused = FusedStep(opt)
    for m in (ref_model, model):
        _grads(m, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            ref_opt.step()
            fused()
    torch.cuda.current_stream().wait_stream(side)
    assert fused.direct_steps == 2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused()
    assert fused.direct_steps == 2  # the capture ran torch's step
    for _ in range(3):
        graph.replay()
        ref_opt.step()
    torch.cuda.synchronize()
    _assert_same(ref_model, ref_opt, model, opt)
