"""Which casts backward recomputes, by what it costs where the graph runs (issue 41, part 3).

``Policy(recompute_casts="auto")``, the default, weighs a cost measured once per device
(:mod:`amp_graph.ops.recompute_cost`): a copy smaller than what the device casts in the
fixed host time of one recompute is kept, a graph whose saved-tensor hooks would cost
more than all its recasts' bytes take keeps every copy (and runs no hook), and the
recomputes, largest copy first, take at most 1% of the step the graph's matmul FLOPs make
at the measured matmul rate (issue 58, part 1: the default path no slower than
torch.autocast, which keeps every copy). The tests pin
the cost (the measured one differs by machine; conftest pins one for the whole suite) by
patching the one function the entry points ask, and check the split, what it holds, that
gradients are the same bits whichever way a cast is decided, and what report and explain
say. The measurement itself is checked for what it must not disturb, and once for what it
decides on this CPU.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
import torch.nn as nn
from amp_graph.passes.meta import FSDP_UNIT
from amp_graph.passes.recompute_casts import recompute_casts
from dispatch_helpers import CountOps

import amp_graph
from amp_graph.frontends import front_door
from amp_graph.inspect.held import held_for_backward
from amp_graph.ops import recompute_cost
from amp_graph.ops.recompute_cost import RecomputeCost
from amp_graph.ops.recompute_ops import recomputed_cast

BF16 = torch.bfloat16
KIB = 1024
# copies below 64 KiB kept; the hooks free
SPLIT_AT_64_KIB = RecomputeCost(per_cast_ns=64 * KIB, per_saved_ns=0.0, copy_bytes_per_ns=1.0)


class SmallAndLarge(nn.Module):
    """A 16 KiB weight copy (16x512 in bf16) and a 512 KiB one (512x512)."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(16, 512, bias=False)
        self.large = nn.Linear(512, 512, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.large(torch.relu(self.small(x)))


def pinned(monkeypatch: pytest.MonkeyPatch, cost: RecomputeCost) -> list[str]:
    """Make the entry points weigh ``cost``; returns the devices they asked for."""
    asked: list[str] = []

    def measured(device: Any) -> RecomputeCost:
        asked.append(str(device))
        return cost

    monkeypatch.setattr(front_door, "measured_cost", measured)
    return asked


def recomputed_sources(compiled: Any) -> set[str]:
    return {
        n.args[0].target.rpartition(".")[0].removeprefix("model.")
        for n in compiled.graph.nodes
        if n.target is recomputed_cast
    }


def o1(recompute: bool | str | int) -> amp_graph.Policy:
    return dataclasses.replace(amp_graph.Policy.preset("O1"), recompute_casts=recompute)


def test_auto_is_the_default_and_the_field_is_checked() -> None:
    assert amp_graph.Policy.preset("O1").recompute_casts == "auto"
    for good in ("auto", True, False, 0, 65536):
        assert o1(good).recompute_casts == good
    for bad in ("always", -1, 1.5, None):
        with pytest.raises(ValueError, match="recompute_casts is 'auto'"):
            o1(bad)


def test_auto_recomputes_the_large_copy_and_keeps_the_small(monkeypatch) -> None:
    asked = pinned(monkeypatch, SPLIT_AT_64_KIB)
    model, x = SmallAndLarge(), torch.randn(8, 16)
    compiled = amp_graph.compile(model, "O1", BF16, example_inputs=(x,))
    assert asked == ["cpu"]
    assert recomputed_sources(compiled) == {"large"}
    report = amp_graph.report(compiled)
    assert (report.casts_recomputed, report.casts_recompute_declined) == (1, 1)
    assert report.recomputed_cast_bytes == 512 * 512 * 2
    assert "kept where recomputing does not pay: 1" in report.totals()
    small_cast = next(
        n
        for n in compiled.graph.nodes
        if n.meta["amp"].role.value == "cast" and n.args[0].target.endswith("small.weight")
    )
    text = str(amp_graph.explain(compiled, small_cast.name))
    assert "Backward keeps this cast" in text and "16 KiB" in text and "64 KiB" in text
    assert "recompute_casts=True" in text


def test_a_byte_count_decides_without_measuring(monkeypatch) -> None:
    def refuse(device: Any) -> RecomputeCost:
        raise AssertionError("a byte count needs no measurement")

    monkeypatch.setattr(front_door, "measured_cost", refuse)
    x = torch.randn(8, 16)
    split = amp_graph.compile(SmallAndLarge(), o1(64 * KIB), BF16, example_inputs=(x,))
    every = amp_graph.compile(SmallAndLarge(), o1(0), BF16, example_inputs=(x,))
    assert recomputed_sources(split) == {"large"}
    assert recomputed_sources(every) == {"small", "large"}
    assert "below Policy(recompute_casts=65536)" in str(
        amp_graph.explain(split, next(iter(_kept_casts(split))))
    )


def _kept_casts(compiled: Any) -> list[str]:
    return [n.name for n in compiled.graph.nodes if n.meta["amp"].recompute_declined]


def test_an_fsdp2_units_casts_are_recomputed_whatever_their_size() -> None:
    """A unit's copies are of its unsharded parameters: kept, they would hold the whole
    unsharded model on every rank (the pass reads the unit fsdp_hooks marks on a read)."""
    model, x = SmallAndLarge(), torch.randn(8, 16)
    compiled = amp_graph.compile(model, o1(False), BF16, example_inputs=(x,))
    gm = compiled.graph_module
    small = next(n for n in gm.graph.nodes if str(n.target).endswith("small.weight"))
    small.meta[FSDP_UNIT] = "small"
    result = recompute_casts(gm, "auto", SPLIT_AT_64_KIB)
    assert result.stats["casts_recomputed"] == 2
    assert result.stats["casts_recompute_declined"] == 0


def test_hooks_that_cost_more_than_the_bytes_keep_every_copy(monkeypatch) -> None:
    """The hooks run for every tensor the forward saves once one cast is recomputed: where
    that costs more than all the recasts' bytes, the graph keeps every copy and runs no
    hook at all."""
    pinned(monkeypatch, dataclasses.replace(SPLIT_AT_64_KIB, per_saved_ns=float(2**20)))
    model, x = SmallAndLarge(), torch.randn(8, 16)
    compiled = amp_graph.compile(model, "O1", BF16, example_inputs=(x,))
    assert recomputed_sources(compiled) == set()
    assert "_amp_graph_recompute_handles" not in compiled.graph_module.__dict__
    texts = {
        name.removeprefix("model_").split("_")[0]: str(amp_graph.explain(compiled, name))
        for name in _kept_casts(compiled)
    }
    assert "64 KiB" in texts["small"]  # below the size where a recast pays anyway
    assert "saved-tensor hooks" in texts["large"] and "keeps every copy" in texts["large"]


def test_held_bytes_and_gradient_bits_whichever_way_a_cast_is_decided(monkeypatch) -> None:
    pinned(monkeypatch, SPLIT_AT_64_KIB)
    # an input that requires grad: the first linear saves its weight's copy too
    model, x = SmallAndLarge(), torch.randn(8, 16, requires_grad=True)
    held, grads = {}, {}
    for recompute in (True, "auto", False):
        compiled = amp_graph.compile(model, o1(recompute), BF16, example_inputs=(x,))
        model.zero_grad(set_to_none=True)
        held[recompute], out = held_for_backward(lambda c=compiled: c(x), list(model.parameters()))
        out.float().square().mean().backward()
        grads[recompute] = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
        x.grad = None
    assert held[False] - held["auto"] == 512 * 512 * 2  # the large copy
    assert held["auto"] - held[True] == 16 * 512 * 2  # the small one
    for variant in (True, "auto"):
        assert all(torch.equal(a, b) for a, b in zip(grads[variant], grads[False], strict=True))


def test_a_small_model_on_this_cpu_keeps_its_copies_and_runs_no_hooks(monkeypatch) -> None:
    """With the cost measured here (the suite pins one elsewhere): a model of kilobytes pays
    no Python for its copies."""
    monkeypatch.setattr(front_door, "measured_cost", recompute_cost.measured_cost)
    model = nn.Sequential(nn.Linear(8, 16), nn.Softmax(-1), nn.Linear(16, 8))
    compiled = amp_graph.compile(model, "O1", BF16, example_inputs=(torch.randn(4, 8),))
    report = amp_graph.report(compiled)
    assert report.casts_recomputed == 0 and report.casts_recompute_declined == 5
    assert "_amp_graph_recompute_handles" not in compiled.graph_module.__dict__
    assert "on cpu a recomputed cast costs" in report.totals()


def test_a_compiled_graph_leaves_its_casts_to_the_partitioner(monkeypatch) -> None:
    """Where AOTAutograd compiles the graph (the backend with an inner compiler other than
    eager; Graph's enable_compile), "auto" tags no cast: the partitioner decides what
    backward keeps, as for torch.compile under autocast, and nothing is measured. True still
    tags every cast it may; explain says why a kept one is kept."""
    asked = pinned(monkeypatch, dataclasses.replace(SPLIT_AT_64_KIB, per_cast_ns=float(2**30)))
    model, x = SmallAndLarge(), torch.randn(8, 16)
    counts, graphs = {}, {}
    for inner, recompute in (("aot_eager", "auto"), ("aot_eager", True), ("eager", "auto")):
        torch._dynamo.reset()
        backend = amp_graph.backend(policy=o1(recompute), dtype=BF16, inner=inner)
        torch.compile(model, backend=backend)(x).float().sum().backward()
        [gm] = backend.graphs
        stats = gm.meta["amp_graph"].stats
        counts[inner, recompute] = (stats["casts_recomputed"], stats["casts_recompute_declined"])
        graphs[inner, recompute] = gm
    assert counts == {("aot_eager", "auto"): (0, 2), ("aot_eager", True): (2, 0),
                      ("eager", "auto"): (0, 2)}  # fmt: skip
    assert asked == ["cpu"]  # eager only
    said = amp_graph.explain(graphs["aot_eager", "auto"], _weight_cast(graphs["aot_eager", "auto"]))
    assert "its partitioner decides" in str(said)
    assert not [n for n in graphs["aot_eager", "auto"].graph.nodes if n.meta.get("recompute")]


def _weight_cast(gm: torch.fx.GraphModule) -> str:
    from amp_graph.passes import AMP, Role

    return next(
        n.name
        for n in gm.graph.nodes
        if n.meta.get(AMP) is not None and n.meta[AMP].role is Role.CAST
        and n.args[0].meta[AMP].role is Role.PARAM
    )  # fmt: skip


class TrainSmallAndLarge(amp_graph.Graph):
    def __init__(self, model: nn.Module, policy: amp_graph.Policy, compiled: bool) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        self.config.enable_amp(True, policy=policy, dtype=BF16)
        if compiled:
            self.config.enable_compile(backend="aot_eager")

    def build(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.model(x).float().square().mean()
        loss.backward()
        return loss


def test_graph_decides_as_compile_does_and_steps_the_same_bits(monkeypatch) -> None:
    """The same policy through Graph: the eager step graph weighs the measured cost (the
    large copy recomputed, the small kept); with enable_compile the partitioner decides
    (nothing tagged, nothing measured), and True tags every cast. Weights after two steps
    are the same bits as keeping all."""
    asked = pinned(monkeypatch, SPLIT_AT_64_KIB)
    x = torch.randn(8, 16, requires_grad=True)
    weights, decided = {}, {}
    for name, policy, compiled in (
        ("auto", o1("auto"), False),
        ("auto, compiled", o1("auto"), True),
        ("every, compiled", o1(True), True),
        ("none", o1(False), False),
    ):
        torch.manual_seed(0)
        model = SmallAndLarge()
        graph = TrainSmallAndLarge(model, policy, compiled)
        for _ in range(2):
            graph(x)
        weights[name] = [p.detach().clone() for p in model.parameters()]
        decided[name] = (
            graph.step_graph.get_submodule("build").meta["amp_graph"].stats["casts_recomputed"]
        )
    # every, compiled: both weights and the float32 copy of the output that square saves
    assert decided == {"auto": 1, "auto, compiled": 0, "every, compiled": 3, "none": 0}
    assert asked == ["cpu"]  # the eager Graph's capture only
    for name in ("auto", "auto, compiled", "every, compiled"):
        assert all(torch.equal(a, b) for a, b in zip(weights[name], weights["none"], strict=True))


def test_a_shared_copy_is_cast_per_consumer_up_to_what_a_read_writes() -> None:
    """The bytes a read's host time writes, from a source in the caches where that rate is
    measured (a consumer casts an activation just computed), else at the cold rate; none
    where no read time is known."""
    cold = RecomputeCost(per_cast_ns=7e3, per_saved_ns=2e3, copy_bytes_per_ns=10.0)
    assert cold.max_own_cast_bytes == 0
    timed = dataclasses.replace(cold, per_read_ns=1500.0)
    assert timed.max_own_cast_bytes == 15_000
    assert dataclasses.replace(timed, fresh_copy_bytes_per_ns=30.0).max_own_cast_bytes == 45_000


def test_the_measurement_is_sane_remembered_and_disturbs_nothing() -> None:
    recompute_cost._measure.cache_clear()
    rng = torch.get_rng_state()
    with CountOps() as mode, torch.inference_mode(), torch.autocast("cpu", BF16):
        cost = recompute_cost.measured_cost("cpu")
    assert not mode.ops  # the caller's dispatch mode saw none of it
    assert torch.equal(rng, torch.get_rng_state())
    assert recompute_cost.measured_cost(torch.device("cpu")) is cost  # once per device
    figures = (cost.per_cast_ns, cost.per_saved_ns, cost.copy_bytes_per_ns, cost.flops_per_ns)
    assert all(math.isfinite(f) and f >= 0 for f in figures) and cost.copy_bytes_per_ns > 0
    assert cost.flops_per_ns > 1  # a bf16 matmul on any CPU: above 1 GFLOP/s
    # a recast costs host time (Python, a dispatch): never measured free
    assert cost.per_cast_ns > 0 and cost.min_copy_bytes > 0
    assert cost.device == "cpu" and "copies below" in cost.describe()
    assert "TFLOP/s" in cost.describe()
    # a read is a Python autograd.Function, forward and backward: never cheaper than a cast
    assert math.isfinite(cost.per_read_ns) and cost.per_read_ns >= 0
    assert cost.fresh_copy_bytes_per_ns > 0
    assert cost.max_own_cast_bytes == math.floor(cost.per_read_ns * cost.fresh_copy_bytes_per_ns)


def test_a_recast_never_measures_cheaper_than_one_cast(monkeypatch) -> None:
    """On a busy machine the recomputed variant can time at or below the kept one; the
    estimate is then one cast's dispatch, timed on its own, not zero (which would make
    every recompute look free)."""
    variants = iter([100.0, 200.0, 150.0] * 5)  # kept, hooks, recomputed: a negative difference
    consumers = iter([3000.0, 3200.0] * 5)  # reads, own casts: reads measured the faster

    def timed(run, sync, calls: int, rounds: int, before=None) -> float:
        if calls == 32:  # one cast's dispatch
            return 1500.0
        if calls == 4:  # the shared cast's consumers
            return next(consumers)
        if calls == 16:  # the 4 MiB cast, its source in the caches
            return 2e5
        if calls == 2:  # the 512x512 bf16 matmul
            return 1e6
        if calls == 1:  # the cold 4 MB cast, the caches flushed before each round
            assert before is not None
            return 4e5
        return next(variants)

    monkeypatch.setattr(recompute_cost, "best_ns", timed)
    recompute_cost._measure.cache_clear()
    try:
        cost = recompute_cost.measured_cost("cpu")
    finally:
        recompute_cost._measure.cache_clear()
    assert cost.per_cast_ns == 1500.0
    assert cost.per_saved_ns == pytest.approx(100.0 / (2 * 32))
    assert cost.flops_per_ns == pytest.approx(2 * 512**3 / 1e6)
    assert cost.copy_bytes_per_ns == pytest.approx(2 * 2**20 / 4e5)
    # reads timed below casts of their own: no consumer gets its own cast, not a negative size
    assert cost.per_read_ns == 0.0 and cost.max_own_cast_bytes == 0
    assert cost.fresh_copy_bytes_per_ns == pytest.approx(2 * 2**20 / 2e5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_measurement_on_cuda() -> None:
    cost = recompute_cost.measured_cost("cuda")
    assert cost.device == f"cuda:{torch.cuda.current_device()}"
    assert cost.per_cast_ns > 1e3 and cost.copy_bytes_per_ns > 50  # a launch; HBM
    assert recompute_cost.measured_cost(torch.device("cuda")) is cost


def test_the_timings_wait_for_the_device_they_measure(monkeypatch) -> None:
    """recompute_casts='auto' times casts; on an accelerator that means waiting for its queue
    (on XPU and MPS it did not: launches alone were timed, and every recompute looked free)."""
    from amp_graph.ops.recompute_cost import synchronizer

    waited: list[str] = []
    for name in ("xpu", "mps"):
        monkeypatch.setattr(getattr(torch, name), "synchronize", lambda n=name: waited.append(n))
        synchronizer(torch.device(name))()
    assert waited == ["xpu", "mps"]
    synchronizer(torch.device("cpu"))()  # nothing to wait for
    monkeypatch.delattr(torch.mps, "synchronize")
    with pytest.raises(RuntimeError, match=r"no torch\.mps\.synchronize.*recompute_casts=True"):
        synchronizer(torch.device("mps"))


class MidAndLarge(nn.Module):
    """A 256 KiB weight copy (512x256 in bf16) and a 512 KiB one (512x512): 786,432 forward
    FLOPs a token."""

    def __init__(self) -> None:
        super().__init__()
        self.mid = nn.Linear(256, 512, bias=False)
        self.large = nn.Linear(512, 512, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.large(torch.relu(self.mid(x)))


# SPLIT_AT_64_KIB with a matmul rate: a step of M tokens is 3 * 786,432 * M / 100 ns, the
# large copy's recompute 64 Ki + 2 * 512 Ki ns (its bytes at half the measured rate, as in
# backward), both 2 * 64 Ki + 2 * 768 Ki ns: 1% of the step covers the large copy from
# about 4,700 tokens, both from about 7,200.
WITH_A_MATMUL_RATE = dataclasses.replace(SPLIT_AT_64_KIB, flops_per_ns=100.0)


@pytest.mark.parametrize(
    "tokens, recomputed",
    [(64, set()), (6000, {"large"}), (8192, {"mid", "large"})],
    ids=["short-gemms", "room-for-one", "room-for-both"],
)
def test_the_recomputes_take_at_most_a_share_of_the_step(monkeypatch, tokens, recomputed):
    """A recast moves the bytes the first cast moved, time torch.autocast (which keeps every
    copy) does not spend: "auto" recomputes, largest copy first, only while the recomputes
    stay within STEP_SHARE of the step its matmul FLOPs make at the measured rate."""
    assert (recompute_cost.STEP_SHARE, recompute_cost.IN_BACKWARD_SLOWDOWN) == (0.01, 2.0)
    pinned(monkeypatch, WITH_A_MATMUL_RATE)
    x = torch.randn(tokens, 256)
    compiled = amp_graph.compile(MidAndLarge(), "O1", BF16, example_inputs=(x,))
    assert recomputed_sources(compiled) == recomputed
    for name in _kept_casts(compiled):
        text = str(amp_graph.explain(compiled, name))
        assert "past 1% of its step" in text and "GFLOP" in text
        assert "recompute_casts=True" in text
    # without the rate (a cost made by hand), size alone decides, as before
    pinned(monkeypatch, SPLIT_AT_64_KIB)
    every = amp_graph.compile(MidAndLarge(), "O1", BF16, example_inputs=(x,))
    assert recomputed_sources(every) == {"mid", "large"}


def test_an_hf_llama_at_few_tokens_keeps_its_copies_by_default(monkeypatch) -> None:
    """An HF Llama at a few tokens a step (the suite's pinned CPU cost): its GEMMs are short
    against its weights, so recasting them would show in the step, and "auto" keeps every
    copy, as torch.autocast does; True still recomputes them, with the same gradients."""
    transformers = pytest.importorskip("transformers")
    from hf_configs import small_llama_config

    model = transformers.LlamaForCausalLM(small_llama_config()).train()
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    grads = {}
    for recompute in ("auto", True):
        compiled = amp_graph.compile(model, o1(recompute), BF16, example_inputs=(ids,))
        model.zero_grad(set_to_none=True)
        compiled(ids).logits.float().logsumexp(-1).mean().backward()
        grads[recompute] = [p.grad.clone() for p in model.parameters()]
        report = amp_graph.report(compiled)
        if recompute == "auto":
            assert report.casts_recomputed == 0 and report.casts_recompute_declined > 0
            assert "_amp_graph_recompute_handles" not in compiled.graph_module.__dict__
        else:
            assert report.casts_recomputed > 0
    assert all(torch.equal(a, b) for a, b in zip(grads["auto"], grads[True], strict=True))
