"""The per-GEMM fp8 decision (issue 58, part 4): a cost model of each linear's three GEMMs and
its quantizations (:mod:`amp_graph.policy.fp8_cost`), its figures given or measured once per
device (:mod:`amp_graph.ops.fp8_speed`), deciding in the fp8 pass by the GEMM's shape,
tokens included, and saying why in ``explain`` and ``report``.

The decisions are checked with given figures (what a GPU would measure is not on this
machine). The measurement runs here on the CPU, whose float8 products are emulated: the
model it fits must agree with the pass's decision for every GEMM.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.nn as nn

import amp_graph
from amp_graph.frontends.compiler import compile_record
from amp_graph.ops.fp8_ops import fp8_matmul_error
from amp_graph.ops.fp8_speed import fit_model, measured_fp8_cost
from amp_graph.policy import Fp8Config, Fp8CostModel, GemmSpeed
from amp_graph.policy.fp8_filters import LinearFacts, decide
from amp_graph.policy.policy_data import policy_as_data, policy_from_data

# An H100-like device: bf16 600 TFLOP/s, fp8 1200, quantization at 2 TB/s
HOPPER = Fp8CostModel(GemmSpeed(20e3, 600e3), GemmSpeed(40e3, 1200e3), 2e3, "")

needs_fp8 = pytest.mark.skipif(
    fp8_matmul_error("cpu") is not None, reason=f"no fp8 matmul here: {fp8_matmul_error('cpu')}"
)


class TwoLayers(nn.Module):
    """A Llama-sized projection (4096 -> 4096) and a narrow head (4096 -> 64)."""

    def __init__(self) -> None:
        super().__init__()
        self.large = nn.Linear(4096, 4096)
        self.head = nn.Linear(4096, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.large(x)))


def _shape(why: str) -> tuple[int, int, int]:
    found = re.search(r"for M=(\d+), K=(\d+), N=(\d+)", why)
    assert found, why
    return int(found[1]), int(found[2]), int(found[3])


def _facts(m: int, k: int, n: int) -> LinearFacts:
    return LinearFacts("aten.linear", "layer", None, in_features=k, out_features=n, tokens=m)


# ---- the model -------------------------------------------------------------------------------


def test_large_gemms_pay_and_small_ones_do_not() -> None:
    assert HOPPER.pays(8192, 4096, 4096)  # Llama-sized: the FLOPs dominate
    assert not HOPPER.pays(1024, 1024, 1024)  # the fixed time and the quantizations do
    assert HOPPER.ratio(8192, 4096, 4096) < HOPPER.ratio(8192, 1024, 1024)
    # tokens count: the same layer pays at many tokens and not at few
    assert HOPPER.pays(65536, 4096, 4096) and not HOPPER.pays(64, 4096, 4096)
    bf16, fp8 = HOPPER.predict_ns(8192, 4096, 4096)
    assert bf16 == pytest.approx(20e3 + 6 * 8192 * 4096 * 4096 / 600e3)
    moved = 5 * 8192 * 4096 + 9 * 4096 * 4096 + 5 * 8192 * 4096
    assert fp8 == pytest.approx(40e3 + 6 * 8192 * 4096 * 4096 / 1200e3 + moved / 2e3)


def test_the_margin_keeps_a_close_call_in_bf16() -> None:
    m, k, n = 8192, 2048, 2048
    ratio = HOPPER.ratio(m, k, n)
    assert Fp8CostModel(HOPPER.bf16, HOPPER.fp8, 2e3, margin=min(1.0, ratio + 0.01)).pays(m, k, n)
    assert not Fp8CostModel(HOPPER.bf16, HOPPER.fp8, 2e3, margin=ratio - 0.01).pays(m, k, n)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: GemmSpeed(-1.0, 1.0), ValueError, "fixed_ns is a finite number >= 0"),
        (lambda: GemmSpeed(0.0, 0.0), ValueError, "flops_per_ns must be positive"),
        (lambda: Fp8CostModel(HOPPER.bf16, HOPPER.fp8, 0.0), ValueError, "positive"),
        (lambda: Fp8CostModel(HOPPER.bf16, HOPPER.fp8, 1.0, margin=1.5), ValueError, "margin"),
        (lambda: Fp8CostModel(1.0, HOPPER.fp8, 1.0), TypeError, "a GemmSpeed for bf16"),
        (lambda: Fp8Config(cost_model="fast"), TypeError, "'measured'"),
        (lambda: Fp8Config(cost_model=HOPPER, auto_filter=True), ValueError, "pass one of"),
    ],
)
def test_bad_figures_and_configs_are_refused(make, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make()


def test_the_fit_recovers_the_figures_it_was_timed_from() -> None:
    shapes = ((1024, 1024, 1024), (4096, 1024, 1024), (4096, 4096, 4096), (8192, 4096, 8192))
    bf16 = [HOPPER.predict_ns(*s)[0] for s in shapes]
    fp8 = [HOPPER.predict_ns(*s)[1] for s in shapes]
    fitted = fit_model(shapes, bf16, fp8, HOPPER.quantize_bytes_per_ns, "cuda:0")
    for got, want in ((fitted.bf16, HOPPER.bf16), (fitted.fp8, HOPPER.fp8)):
        assert got.fixed_ns == pytest.approx(want.fixed_ns, rel=1e-6)
        assert got.flops_per_ns == pytest.approx(want.flops_per_ns, rel=1e-6)
    assert fitted.device == "cuda:0"


def test_a_decision_says_what_the_model_predicts() -> None:
    config = Fp8Config(cost_model=HOPPER)
    kept = decide(_facts(64, 4096, 4096), config)
    assert not kept.fp8
    assert kept.reason.startswith("not fp8: the cost model (given) predicts")
    assert "M=64, K=4096, N=4096" in kept.reason
    taken = decide(_facts(8192, 4096, 4096), config)
    assert taken.fp8 and "the cost model (given) predicts 0." in taken.reason
    unknown = decide(LinearFacts("aten.linear", "", None, 4096, 4096), config)
    assert unknown.fp8 and "tokens are not known at capture" in unknown.reason


def test_the_cost_model_is_data() -> None:
    for cost in (HOPPER, "measured"):
        policy = amp_graph.Policy.preset("fp8").with_fp8(cost_model=cost)
        assert policy_from_data(policy_as_data(policy)).fp8 == policy.fp8


def test_the_pass_refuses_a_cost_model_nobody_measured() -> None:
    with pytest.raises(ValueError, match="reached the fp8 pass unmeasured"):
        decide(_facts(64, 64, 64), Fp8Config(cost_model="measured"))


# ---- through compile -------------------------------------------------------------------------


@needs_fp8
def test_compile_decides_each_gemm_by_its_shape_and_says_why() -> None:
    policy = amp_graph.Policy.preset("fp8").with_fp8(cost_model=HOPPER)
    model = TwoLayers()
    # at 8192 tokens the projection pays and the narrow head does not ...
    x = torch.randn(8192, 4096)
    compiled = amp_graph.compile(model, policy, example_inputs=(x,))
    gemms = amp_graph.report(compiled).fp8_gemms
    assert sorted(_shape(why) for why in gemms.values()) == [(8192, 4096, 64), (8192, 4096, 4096)]
    for why in gemms.values():
        assert why.startswith("fp8") == (_shape(why)[2] == 4096), why
    [head] = [name for name, why in gemms.items() if why.startswith("not fp8")]
    assert "fp8 GEMMs: 1 of 2 in float8" in amp_graph.report(compiled).totals()
    assert "the cost model (given) predicts" in str(amp_graph.explain(compiled, head))
    # ... and at 16 tokens neither does: the decision reads the tokens of the capture
    few = amp_graph.compile(model, policy, example_inputs=(torch.randn(16, 4096),))
    assert all(w.startswith("not fp8") for w in amp_graph.report(few).fp8_gemms.values())


@needs_fp8
def test_measured_on_this_cpu_the_model_and_the_pass_agree(caplog) -> None:
    """The CPU's float8 products are emulated: the measured figures say whether fp8 pays
    here, and every GEMM's decision must be the model's for its shape."""
    model = measured_fp8_cost("cpu")
    assert model.device == "cpu" and model.bf16.flops_per_ns > 0 and model.fp8.flops_per_ns > 0
    assert measured_fp8_cost("cpu") is model  # once per device
    policy = amp_graph.Policy.preset("fp8").with_fp8(cost_model="measured")
    with caplog.at_level(logging.WARNING):
        x = torch.randn(256, 4096)
        compiled = amp_graph.compile(TwoLayers(), policy, example_inputs=(x,))
    record = compile_record(compiled)
    assert record.policy.fp8.cost_model is model  # the request carries the measurement
    gemms = amp_graph.report(compiled).fp8_gemms
    assert sorted(_shape(why) for why in gemms.values()) == [(256, 4096, 64), (256, 4096, 4096)]
    for name, why in gemms.items():
        assert why.startswith("fp8") == model.pays(*_shape(why)), (name, why)
        assert "measured on cpu" in why
