"""The training step of amp_graph.Graph without loss scaling (bfloat16, AMP off), and its cost:
no host reads in a step, inf/nan steps still skipped exactly, O2 gradients accumulated in
float32, each weight cast once per step for all micro-batches, and the compiled mode."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from graph_helpers import TrainGraph
from torch.utils._python_dispatch import TorchDispatchMode

from amp_graph.demo import models
from amp_graph.training import master_weights
from amp_graph.training.master_weights import HAS_GRAD_DTYPE
from amp_graph.training.nn_graph import Graph

BF16 = torch.bfloat16


def Step(model, optimizer, **options):
    """The bfloat16 training Graph of these tests."""
    return TrainGraph(model, optimizer, dtype=BF16, **options)


OPTIMIZERS = {
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "sgd_momentum_fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
}


def data(steps: int = 10, batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(batch, 64), torch.randint(0, 10, (batch,))) for _ in range(steps)]


# ---- host reads ------------------------------------------------------------------------------


class _LocalScalars(TorchDispatchMode):
    """Counts aten._local_scalar_dense: .item(), bool(t), float(t), int(t) of a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_reads() -> Iterator[list[int]]:
    """Count every way a step could read a tensor on the host: the dispatch mode sees
    .item()/bool()/float(); .tolist(), .cpu() and .numpy() are patched for the duration."""
    counts = [0]
    patched = {}
    for name in ("tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            counts[0] += 1
            return _original(self, *args, **kwargs)

        patched[name] = counting
    with contextlib.ExitStack() as stack:
        for name, fn in patched.items():
            stack.enter_context(mock.patch.object(torch.Tensor, name, fn))
        mode = stack.enter_context(_LocalScalars())
        yield counts
        counts[0] += mode.count


@pytest.mark.parametrize(
    ("policy", "optimizer", "clip", "accumulation"),
    [
        ("O1", "adamw_fused", None, 1),
        ("O1", "sgd_momentum_fused", 1.0, 1),
        ("O2", "adamw_fused", None, 1),
        ("autocast", "adamw_fused", None, 4),
        ("O2", "sgd_momentum_fused", 1.0, 2),
    ],
)
def test_a_step_reads_nothing_on_the_host(policy, optimizer, clip, accumulation):
    model = models.MLP()
    g = Step(
        model, OPTIMIZERS[optimizer](model.parameters()), policy=policy, clip=clip,
        accumulation=accumulation,
    )  # fmt: skip
    batches = data(3)
    g(*batches[0])  # capture; fused SGD's first step reads once (its buffers are created)
    for x, y in batches[1:]:
        with host_reads() as reads:
            g(x, y)
        assert reads[0] == 0


def test_an_optimizer_without_found_inf_costs_one_host_read_per_step():
    """torch.optim.Adam(foreach=True) reads its step counts on the host by itself; the Graph
    adds exactly one read (deciding whether to step)."""
    base = models.MLP()
    x, y = data(1)[0]
    eager_model = copy.deepcopy(base)
    eager_opt = torch.optim.Adam(eager_model.parameters(), lr=1e-2, foreach=True)

    def eager_step():
        eager_opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", BF16):
            loss = F.cross_entropy(eager_model(x).float(), y)
        loss.backward()
        eager_opt.step()

    model = copy.deepcopy(base)
    g = Step(model, torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True))
    g(x, y)
    eager_step()
    with host_reads() as graph_reads:
        g(x, y)
    with host_reads() as eager_reads:
        eager_step()
    assert graph_reads[0] == eager_reads[0] + 1


# ---- inf/nan steps without a scaler -----------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "optimizer", "clip", "accumulation", "amp"),
    [
        ("O1", "adamw_fused", None, 1, True),
        ("O1", "sgd_momentum_fused", None, 1, True),
        ("O1", "adam_foreach", 1.0, 1, True),
        ("O2", "adamw_fused", None, 2, True),
        ("O2", "sgd_momentum_fused", 0.5, 1, True),
        ("O1", "sgd_momentum_fused", 1.0, 2, False),
    ],
)
def test_injected_nonfinite_steps_are_skipped_exactly_without_a_scaler(
    policy, optimizer, clip, accumulation, amp
):
    base = models.MLP()
    batches = data(10)
    poisoned = {0, 3, 4, 8}  # step 0: fused SGD's momentum buffers do not exist yet

    def run(skip_poisoned: bool):
        model = copy.deepcopy(base)
        g = Step(
            model, OPTIMIZERS[optimizer](model.parameters()), policy=policy, clip=clip,
            accumulation=accumulation, amp=amp,
        )  # fmt: skip
        for step, (x, y) in enumerate(batches):
            if step in poisoned:
                if skip_poisoned:
                    continue
                x = x.clone()
                x[step % 16, step] = float("inf") if step % 2 else float("nan")
            g(x, y)
        return g

    injected, control = run(skip_poisoned=False), run(skip_poisoned=True)
    assert injected.grad_scaler is None  # no loss scaling in bf16
    assert injected.skipped_steps == len(poisoned) and control.skipped_steps == 0
    for a, b in zip(injected.state_dict()["modules"]["model"].values(),
                    control.state_dict()["modules"]["model"].values(), strict=True):  # fmt: skip
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)
    for a, b in zip(injected.model.parameters(), control.model.parameters(), strict=True):
        assert torch.equal(a, b)  # O2: the low-precision copies as well


def test_a_skipped_first_fused_sgd_step_creates_no_momentum_buffers():
    """torch's fused SGD allocates its momentum buffers with empty_like on the first step and
    fills them in the kernel: a first step skipped on the device would leave garbage there."""
    model = models.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    g = Step(model, opt)
    x, y = data(1)[0]
    x[0, 0] = float("nan")
    g(x, y)
    assert g.skipped_steps == 1
    assert all("momentum_buffer" not in opt.state.get(p, {}) for p in model.parameters())


def test_every_optimizer_skips_when_any_gradient_is_nonfinite():
    class TwoOptimizers(Graph):
        def __init__(self, a, b):
            super().__init__()
            self.a, self.b = a, b
            self.add_optimizer(torch.optim.AdamW(a.parameters(), lr=0.1, fused=True))
            self.add_optimizer(torch.optim.SGD(b.parameters(), lr=0.1, foreach=True))
            self.config.enable_amp(True, dtype=BF16)

        def build(self, x, z):
            loss = self.a(x).float().sum() + self.b(z).float().sum()
            loss.backward()
            return loss

    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    g = TwoOptimizers(a, b)
    g(torch.ones(2, 4), torch.ones(2, 4))
    before = [p.detach().clone() for p in (*a.parameters(), *b.parameters())]
    z = torch.ones(2, 4)
    z[0, 0] = float("inf")  # only b's weight gradient is inf: a's optimizer skips as well
    g(torch.ones(2, 4), z)
    assert torch.isfinite(a.weight.grad).all() and not torch.isfinite(b.weight.grad).all()
    after = [*a.parameters(), *b.parameters()]
    assert g.skipped_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(before, after, strict=True))


def test_checkpoint_resume_keeps_the_skip_count():
    base = models.MLP()
    batches = data(6)
    bad = batches[1][0].clone()
    bad[0, 0] = float("inf")
    batches[1] = (bad, batches[1][1])

    def make():
        model = copy.deepcopy(base)
        return Step(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))

    straight = make()
    for x, y in batches:
        straight(x, y)
    first = make()
    for x, y in batches[:3]:
        first(x, y)
    resumed = make()
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    for x, y in batches[3:]:
        resumed(x, y)
    assert resumed.skipped_steps == straight.skipped_steps == 1
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


# ---- gradient accumulation ------------------------------------------------------------------


@pytest.mark.parametrize("grad_dtype", [True, False])
def test_o2_accumulates_micro_batch_gradients_in_float32(grad_dtype, monkeypatch):
    """The master gradient is the float32 sum of the micro-batches' bfloat16 gradients (not
    their bfloat16 sum), with grad_dtype and with the hook older torch versions use."""
    monkeypatch.setattr(master_weights, "HAS_GRAD_DTYPE", grad_dtype and HAS_GRAD_DTYPE)
    base = models.MLP()
    x, y = data(1, batch=32)[0]
    model = copy.deepcopy(base)
    g = Step(model, torch.optim.SGD(model.parameters(), lr=0.0), policy="O2", accumulation=4)
    g(x, y)

    reference = copy.deepcopy(base).to(BF16)
    fp32_sums = [torch.zeros_like(p, dtype=torch.float32) for p in reference.parameters()]
    bf16_sums = [torch.zeros_like(p) for p in reference.parameters()]
    for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True):
        reference.zero_grad(set_to_none=True)
        (F.cross_entropy(reference(xs.to(BF16)).float(), ys) / 4).backward()
        for total, low, p in zip(fp32_sums, bf16_sums, reference.parameters(), strict=True):
            total += p.grad.float()
            low += p.grad
    masters = [master for _, _, master in g._builder.master.pairs]
    assert all(m.grad.dtype == torch.float32 for m in masters)
    for master, total in zip(masters, fp32_sums, strict=True):
        assert torch.equal(master.grad, total)
    # the test can fail: bfloat16 accumulation rounds differently
    assert any(not torch.equal(t, low.float()) for t, low in zip(fp32_sums, bf16_sums, strict=True))


class _WeightCasts(TorchDispatchMode):
    """Counts the dtype casts (aten._to_copy) that read one of the given tensors."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func is torch.ops.aten._to_copy.default
            and args[0].dtype != kwargs.get("dtype", args[0].dtype)
            and args[0].untyped_storage().data_ptr() in self.ptrs
        ):
            self.count += 1
        return func(*args, **kwargs)


def test_weights_are_cast_once_per_step_for_all_micro_batches():
    base = models.MLP()
    x, y = data(1, batch=32)[0]
    model = copy.deepcopy(base)
    g = Step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation=4)
    g(x, y)
    with _WeightCasts(list(model.parameters())) as graph_casts:
        g(x, y)

    eager = copy.deepcopy(base)
    with _WeightCasts(list(eager.parameters())) as eager_casts:
        for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True):
            with torch.autocast("cpu", BF16):
                loss = F.cross_entropy(eager(xs).float(), ys) / 4
            loss.backward()
    weights = sum(1 for _ in model.parameters())  # every MLP parameter feeds a bf16 linear
    assert graph_casts.count == weights
    assert eager_casts.count == 4 * weights
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


# ---- compiled mode ---------------------------------------------------------------------------


def test_enable_compile_hands_the_build_graph_to_torch_compile(fresh_dynamo):
    compiled_graphs = []

    def recording_backend(gm, example_inputs):
        compiled_graphs.append(gm)
        return gm.forward

    base = models.MLP()
    batches = data(3)
    graphs = []
    for compile_ in (False, True):
        model = copy.deepcopy(base)
        g = Step(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
        if compile_:
            g.config.enable_compile(backend=recording_backend)
        for x, y in batches:
            g(x, y)
        graphs.append(g)
    eager, compiled = graphs
    assert compiled_graphs, "torch.compile never received the build graph"
    assert any(
        n.op == "call_function" and "linear" in str(n.target)
        for gm in compiled_graphs
        for n in gm.graph.nodes
    )
    assert isinstance(compiled.build_graph, torch.fx.GraphModule)
    assert "compile=" in repr(compiled.config)
    for a, b in zip(eager.model.parameters(), compiled.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_enable_compile_rejects_unknown_options():
    with pytest.raises(TypeError, match=r"unknown option 'mdoe'.*Did you mean 'mode'"):
        Graph().config.enable_compile(mdoe="max-autotune")


def test_enable_compile_passes_torch_compiles_mode_on():
    config = Graph().config
    config.enable_compile(mode="max-autotune")  # torch.compile's mode, not the on/off flag
    assert config.compile and config.compile_options == {"mode": "max-autotune"}
    config.enable_compile(False)
    assert not config.compile
