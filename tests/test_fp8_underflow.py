"""fp8 underflow: a quantization whose scale one outlier sets flushes the other values to zero.

With tensorwise scaling the scale is ``448 / amax``: one value 1e6 times the others' size
makes nearly every other element of the tensor zero in float8_e4m3fn, yet the relative L2
error of the outputs, which the outlier dominates, stays within autopolicy's ``tol``.
:attr:`NumericsRow.flushed` measures the share of an fp8 quantization's nonzero input values
that become zero, and autopolicy keeps the linears of a quantization that flushes more than
``flush_tol`` of them out of fp8.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import amp_graph
from amp_graph.accuracy import shadow
from amp_graph.accuracy.shadow import NumericsRow

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16)
    )


def ordinary() -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(3))


def with_outlier(value: float) -> torch.Tensor:
    x = ordinary()
    x[0, 0] = value
    return x


def quantizations(report: amp_graph.NumericsReport) -> list[NumericsRow]:
    return [r for r in report.rows if r.flushed is not None]


def quantization_of_input(report: amp_graph.NumericsReport) -> NumericsRow:
    (placeholder,) = (r.node for r in report.rows if r.role == "input")
    (row,) = (r for r in quantizations(report) if r.inputs[0] == placeholder)
    return row


def reference_flushed(x: torch.Tensor) -> float:
    """torch's own float8_e4m3fn at the tensorwise scale: nonzero values that become 0."""
    scale = (torch.finfo(E4M3).max / x.abs().amax().double()).float()
    quantized = (x * scale).clamp(-448, 448).to(E4M3).float()
    nonzero = x != 0
    return ((quantized == 0) & nonzero).sum().item() / nonzero.sum().item()


@pytest.mark.parametrize("read_back", ["per node", "at the end"])
def test_the_flushed_fraction_is_torchs_float8_count_of_new_zeros(monkeypatch, read_back):
    """At an outlier that flushes part of the tensor, with exact zeros in it (not counted):
    the measured fraction equals the count from torch's float8_e4m3fn, whether statistics
    are read back per node (CPU) or together at the end (devices)."""
    if read_back == "at the end":
        monkeypatch.setattr(shadow, "reads_back_per_node", lambda device: False)
    x = with_outlier(1e5)
    x[:, 7] = 0.0
    expected = reference_flushed(x)
    assert 0.05 < expected < 0.95  # the premise: some values flush, not all
    compiled = amp_graph.compile(model(), "fp8", BF16)
    report = amp_graph.numerics(compiled, x)
    first = quantization_of_input(report)
    assert first.flushed == pytest.approx(expected, abs=1e-12)
    # the weights flush nothing; nodes that are no quantization have no value
    weights = [r for r in quantizations(report) if r.inputs[0].endswith("weight")]
    assert len(weights) == 3 and all(r.flushed == 0.0 for r in weights)
    assert all(r.flushed is None for r in report.rows if r.op != "fp8 quantize")


def test_autopolicy_keeps_a_linear_whose_input_quantization_flushes_out_of_fp8():
    x = with_outlier(1e6)
    compiled = amp_graph.compile(model(), "fp8", BF16)
    report = amp_graph.numerics(compiled, x)
    row = quantization_of_input(report)
    assert row.flushed > 0.9
    # the failure mode: relative L2 error within autopolicy's default tol (10 x bf16 eps)
    assert report.output_error < 10 * torch.finfo(BF16).eps
    assert f"fp8 underflow: '{row.node}' flushes" in str(report)

    policy = amp_graph.autopolicy(model(), "fp8", BF16, sample_inputs=[(x,)])
    # the outlier's row stays an outlier through the stack: every linear's input flushes
    assert set(policy.nodes) == {"linear", "linear_1", "linear_2"}
    note = policy.notes["linear"]
    assert re.search(
        rf"quantization of '{row.inputs[0]}' flushes 9\d\.\d% of its nonzero values to zero", note
    ), note
    assert "one outlier (max |x| 1e+06) sets the scale, so 'linear' needs float32" in note

    kept = amp_graph.compile(model(), policy, BF16)
    kept(x)
    nodes = {n.name: n for n in kept.graph_module.graph.nodes}
    assert not any(n.target is torch.ops.amp_graph.fp8_linear.default for n in nodes.values())
    assert nodes["linear"].target is torch.ops.aten.linear.default
    assert nodes["linear"].meta["val"].dtype == torch.float32
    assert "fp8 underflow" in amp_graph.explain(kept, "linear")


def test_flush_tol_one_turns_the_rule_off():
    """Without the rule, relative L2 alone passes the outlier: nothing is demoted."""
    x = with_outlier(1e6)
    policy = amp_graph.autopolicy(model(), "fp8", BF16, sample_inputs=[(x,)], flush_tol=1.0)
    assert dict(policy.nodes) == {}
    with pytest.raises(ValueError, match="flush_tol is a fraction"):
        amp_graph.autopolicy(model(), "fp8", BF16, sample_inputs=[(x,)], flush_tol=10)


def test_ordinary_activations_keep_fp8():
    samples = [(ordinary(),), (torch.randn(16, 32, generator=torch.Generator().manual_seed(4)),)]
    compiled = amp_graph.compile(model(), "fp8", BF16)
    report = amp_graph.numerics(compiled, *samples[0])
    assert len(quantizations(report)) == 6  # each linear's input and weight
    assert all(r.flushed < 0.01 for r in quantizations(report))
    assert "fp8 underflow" not in str(report)
    policy = amp_graph.autopolicy(model(), "fp8", BF16, sample_inputs=samples)
    assert dict(policy.nodes) == {}
