"""amp_graph.Graph: the OneFlow-style training step as one graph."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from amp_graph.passes.meta import Role
from graph_helpers import TrainGraph

from amp_graph.demo import models
from amp_graph.demo.digits import batches, load_digits
from amp_graph.scaler import GradScaler, StaticGradScaler
from amp_graph.training.nn_graph import Graph

FP16, BF16 = torch.float16, torch.bfloat16


class EvalGraph(Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config.enable_amp(True, dtype=BF16)

    def build(self, x):
        return self.model(x)


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_step_graph_has_the_expected_nodes_in_order():
    model = models.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 5)
    g = TrainGraph(model, opt, scheduler=sched, scaler=GradScaler(), clip=1.0)
    assert "not compiled yet" in repr(g)
    loss = g(torch.randn(8, 64), torch.randint(0, 10, (8,)))
    assert loss.dtype == torch.float32 and loss.dim() == 0
    order = [
        n.name for n in g.step_graph.graph.nodes if n.op == "call_function" or n.op == "call_module"
    ]
    assert order == [
        "zero_grad_0",
        "build_0",
        "loss_0_0",
        "loss_0_0_scaled",
        "backward_0_0",
        "output_0",
        "unscale_clip_0",
        "step_0",
        "update_scale",
        "lr_step_0",
    ]
    scaled = next(n for n in g.step_graph.graph.nodes if n.name == "loss_0_0_scaled")
    assert "loss scale" in scaled.meta["amp"].detail and scaled.meta["amp"].role is Role.RUNTIME
    assert [u.name for u in scaled.users] == ["backward_0_0"]
    build_ops = {str(n.target) for n in g.build_graph.graph.nodes}
    assert "aten.linear.default" in build_ops and not any("backward" in t for t in build_ops)
    text = repr(g)
    for name in (
        "step graph:",
        "build graph:",
        "scale_loss",
        "unscale_and_clip",
        "optimizer_step",
        "update_scale",
        "scheduler_step",
        "to(torch.float16)",
    ):
        assert name in text


def test_returned_loss_is_unscaled_and_matches_eager():
    model = models.MLP()
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    net = copy.deepcopy(model)
    g = TrainGraph(
        net,
        torch.optim.SGD(net.parameters(), lr=0.0),
        scaler=GradScaler(init_scale=2.0**10),
        policy="autocast",
        dtype=BF16,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = g(x, y)
    with torch.autocast("cpu", BF16):
        reference = F.cross_entropy(g.model(x).float(), y)
    assert torch.equal(loss, reference)


def test_digits_training_reaches_fp32_accuracy_in_fp16_and_bf16():
    train_split, test_split = load_digits()
    base = models.MLP()

    def run(dtype, amp, policy="O1"):
        model = copy.deepcopy(base)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        scaler = GradScaler() if amp and dtype == FP16 else None
        g = TrainGraph(model, opt, dtype=dtype, amp=amp, scaler=scaler, policy=policy)
        for x, y in batches(train_split, 64, 200):
            g(x, y)
        with torch.no_grad():
            x = test_split.x.to(next(model.parameters()).dtype)  # O2: low-precision weights
            pred = model(x).argmax(1)
        return (pred == test_split.y).float().mean().item()

    fp32 = run(FP16, amp=False)
    # stated tolerance: within 3 accuracy points of fp32 on the same batches
    assert fp32 > 0.9
    assert abs(run(FP16, amp=True) - fp32) <= 0.03
    assert abs(run(BF16, amp=True) - fp32) <= 0.03
    assert abs(run(BF16, amp=True, policy="O2") - fp32) <= 0.03


def test_injected_nonfinite_steps_are_skipped_exactly():
    torch.manual_seed(0)
    base = models.MLP()
    data = [(torch.randn(16, 64), torch.randint(0, 10, (16,))) for _ in range(12)]
    poisoned = {2, 5, 6, 9}

    def run(skip_poisoned: bool, hysteresis: int = 8):
        # With hysteresis the scale does not back off on these few overflows, so both runs
        # compute with the same scale and fp16 rounds identically: equality is exact.
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = GradScaler(init_scale=2.0**8, growth_interval=1000, hysteresis=hysteresis)
        g = TrainGraph(model, opt, scaler=scaler)
        for step, (x, y) in enumerate(data):
            if step in poisoned:
                if skip_poisoned:
                    continue
                x = x.clone()
                x[step % 16, step] = float("inf") if step % 2 else float("nan")
            g(x, y)
        return model, g

    injected, g = run(skip_poisoned=False)
    control, _ = run(skip_poisoned=True)
    assert g._scaler.skipped_steps == len(poisoned)
    for a, b in zip(injected.parameters(), control.parameters(), strict=True):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)
    # without hysteresis the scale backs off at each overflow; the weights stay finite and
    # the skipped steps are still skipped (values differ only by fp16 rounding at the scale)
    backed_off, g = run(skip_poisoned=False, hysteresis=1)
    assert g._scaler.get_scale() == 2.0**8 / 2 ** len(poisoned)
    for a, b in zip(backed_off.parameters(), control.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize(
    ("policy", "dtype", "accumulation"),
    [
        ("O1", FP16, 1),
        ("O2", FP16, 1),
        ("O1", FP16, 4),
        ("O2", FP16, 2),
        ("O2", BF16, 4),
        ("fp8", BF16, 2),
    ],
)
def test_checkpoint_resume_is_bit_exact(policy, dtype, accumulation):
    torch.manual_seed(0)
    base = models.MLP()
    data = [(torch.randn(16, 64), torch.randint(0, 10, (16,))) for _ in range(8)]

    def make():
        model = copy.deepcopy(base)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.5)
        return TrainGraph(
            model,
            opt,
            scheduler=sched,
            policy=policy,
            dtype=dtype,
            accumulation=accumulation,
            scaler=GradScaler(init_scale=2.0**12, growth_interval=2) if dtype == FP16 else None,
        )

    straight = make()
    for x, y in data:
        straight(x, y)

    first = make()
    for x, y in data[:4]:
        first(x, y)
    checkpoint = copy.deepcopy(first.state_dict())
    resumed = make()
    resumed(*data[0])  # compile (and, for O2, create the master weights) ...
    resumed.load_state_dict(checkpoint)  # ... then overwrite everything with the checkpoint
    for x, y in data[4:]:
        resumed(x, y)
    assert resumed.steps == straight.steps == 8
    if dtype == FP16:
        assert resumed._scaler.get_scale() == straight._scaler.get_scale()
    final_a, final_b = straight.state_dict(), resumed.state_dict()
    for key, value in final_a["modules"]["model"].items():
        assert torch.equal(value, final_b["modules"]["model"][key]), key
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_fp8_graph_trains_without_a_loss_scaler_with_accumulation_and_clipping():
    model = models.MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = TrainGraph(model, opt, policy="fp8", dtype=BF16, accumulation=2, clip=1.0)
    with pytest.warns(UserWarning, match="e5m2 gradients have the range"):
        g.set_grad_scaler(GradScaler())
        g(torch.randn(16, 64), torch.randint(0, 10, (16,)))
    assert g.grad_scaler is None  # fp8 needs no loss scaling: the guard checks inf/nan
    fp8 = [n for n in g.build_graph.graph.nodes if "fp8_linear" in str(n.target)]
    assert len(fp8) == 2  # fc1, fc2 (the 10-class head stays bf16)
    nodes = [n.name for n in g.step_graph.graph.nodes]
    assert "low_precision_weights" in nodes and "clip_0" in nodes and "update_scale" not in nodes
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    x[0, 0] = float("inf")
    before = params(model)
    g(x, y)
    assert g.skipped_steps == 1 and all(
        torch.equal(a, b) for a, b in zip(before, params(model), strict=True)
    )


def test_o2_stores_low_precision_params_with_fp32_masters_in_sync():
    model = models.GPTWithLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    class GPTGraph(Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.enable_amp(True, policy="O2", dtype=BF16)

        def build(self, idx, targets):
            loss = self.model(idx, targets)
            loss.backward()
            return loss

    g = GPTGraph()
    idx = torch.randint(0, 64, (2, 16))
    g(idx, idx)
    master = g._builder.master
    assert master is not None and master.pairs
    for name, low, fp32 in master.pairs:
        assert low.dtype == BF16 and fp32.dtype == torch.float32
        assert torch.equal(low, fp32.to(BF16)), name
    assert model.gpt.blocks[0].ln1.weight.dtype == torch.float32  # normalization stays fp32
    assert all(p.dtype == torch.float32 for group in opt.param_groups for p in group["params"])
    state = g.state_dict()
    assert all(
        v.dtype == torch.float32
        for v in state["modules"]["model"].values()
        if v.is_floating_point()
    )
    with torch.no_grad():
        for _, _, fp32 in master.pairs:
            fp32.add_(1.0)
    g.load_state_dict(state)
    for name, low, fp32 in master.pairs:
        assert torch.equal(fp32, state["modules"]["model"][name.split(".", 1)[1]]), name
        assert torch.equal(low, fp32.to(BF16)), name


def test_accumulation_and_clipping_match_a_handwritten_torch_amp_loop():
    torch.manual_seed(0)
    base = models.MLP()
    data = [(torch.randn(16, 64), torch.randint(0, 10, (16,))) for _ in range(5)]

    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = TrainGraph(
        model,
        opt,
        policy="autocast",
        dtype=FP16,
        accumulation=4,
        clip=0.5,
        scaler=GradScaler("cpu", init_scale=2.0**10),
    )
    for x, y in data:
        g(x, y)

    ref = copy.deepcopy(base)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for x, y in data:
        ref_opt.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True):
            with torch.autocast("cpu", FP16):
                loss = F.cross_entropy(ref(xs).float(), ys) / 4
            scaler.scale(loss).backward()
        scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        scaler.step(ref_opt)
        scaler.update()
    assert g._scaler.get_scale() == scaler.get_scale()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        # the clip coefficient comes from our fused sum of squares rather than torch's norm:
        # the same value up to float32 rounding
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_several_losses_each_with_backward_and_static_scaler():
    class TwoLosses(Graph):
        def __init__(self, a, b, opt):
            super().__init__()
            self.a, self.b = a, b
            self.add_optimizer(opt)
            self.config.enable_amp(True, dtype=FP16)
            self.set_grad_scaler(StaticGradScaler(2.0**8))

        def build(self, x):
            la = self.a(x).float().pow(2).mean()
            la.backward()
            lb = self.b(x).float().abs().mean()
            lb.backward()
            return la, lb

    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    g = TwoLosses(a, b, opt)
    before = params(a) + params(b)
    la, lb = g(torch.randn(8, 4))
    assert la.dtype == lb.dtype == torch.float32
    assert sum(n.name.startswith("backward_") for n in g.step_graph.graph.nodes) == 2
    assert not any("backward" in str(n.target) for n in g.build_graph.graph.nodes)
    assert all(not torch.equal(p, q) for p, q in zip(params(a) + params(b), before, strict=True))
    assert g._scaler.get_scale() == 2.0**8


def test_evaluation_graph_runs_forward_only_without_grad():
    model = models.MLP()
    g = EvalGraph(model)
    out = g(torch.randn(4, 64))
    assert out.dtype == BF16 and not out.requires_grad
    assert g.step_graph.get_submodule("build") is g.build_graph
    step_nodes = [n.name for n in g.step_graph.graph.nodes if n.op.startswith("call")]
    assert step_nodes == ["build_0", "output_0"]  # no backward, no optimizer, no scaler


def test_changed_input_structure_retraces():
    g = EvalGraph(models.MLP())
    g(torch.randn(4, 64))
    g(torch.randn(7, 64))  # new sizes: one capture with symbolic sizes, for all sizes
    g(torch.randn(9, 64))
    assert len(g._builder.cache.captures) == 2
    g(torch.randn(4, 64, dtype=torch.float64).float().half())
    assert len(g._builder.cache.captures) == 3


def test_bad_input_errors():
    class NoBackward(TrainGraph):
        def build(self, x, y):
            return self.loss_fn(self.model(x), y)

    model = models.MLP()
    g = NoBackward(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=r"never calls loss\.backward"):
        g(torch.randn(2, 64), torch.randint(0, 10, (2,)))

    class BackwardNoOptimizer(Graph):
        def __init__(self):
            super().__init__()
            self.model = models.MLP()

        def build(self, x):
            loss = self.model(x).sum()
            loss.backward()
            return loss

    with pytest.raises(RuntimeError, match="no optimizer is registered"):
        BackwardNoOptimizer()(torch.randn(2, 64))

    with pytest.raises(ValueError, match=r"unknown policy preset 'O7'.*Did you mean"):
        Graph().config.enable_amp(True, policy="O7")
    with pytest.raises(TypeError, match="GradScaler"):
        Graph().set_grad_scaler(torch.amp.GradScaler("cpu"))

    model = models.MLP()
    g = TrainGraph(
        model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=BF16, scaler=GradScaler()
    )
    with pytest.warns(UserWarning, match="does nothing") as caught:
        g(torch.randn(2, 64), torch.randint(0, 10, (2,)))
    assert {w.filename for w in caught if "does nothing" in str(w.message)} == {__file__}

    g = TrainGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation=4)
    with pytest.raises(ValueError, match="divisible by 4"):
        g(torch.randn(6, 64), torch.randint(0, 10, (6,)))


def test_accumulation_on_a_model_whose_shapes_come_from_the_batch():
    """The GPT reshapes by ``x.size()``: build is captured on one micro-batch, the batch
    size it runs with, and matches a hand-written torch.autocast loop over micro-batches."""
    torch.manual_seed(0)
    base = models.GPT(vocab=64, block=16, dim=32, heads=4, layers=1)
    data = [torch.randint(0, 64, (8, 16)) for _ in range(3)]

    class GPTStep(Graph):
        def __init__(self, model, opt):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.enable_amp(True, policy="autocast", dtype=BF16)
            self.config.set_gradient_accumulation_steps(4)

        def build(self, idx):
            loss = self.model(idx).float().logsumexp(-1).mean()
            loss.backward()
            return loss

    model = copy.deepcopy(base)
    g = GPTStep(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for idx in data:
        g(idx)
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for idx in data:
        ref_opt.zero_grad(set_to_none=True)
        for part in idx.chunk(4):
            with torch.autocast("cpu", BF16):
                loss = ref(part).float().logsumexp(-1).mean() / 4
            loss.backward()
        ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        # weights cast once per step, shared casts summing their gradients in bf16 (README,
        # known limits): a bf16 ulp or two apart
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-5)
