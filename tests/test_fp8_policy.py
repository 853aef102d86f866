"""policy="fp8" through every front end: amp_graph.compile, the torch.compile backend and the
policy API; its numbers against a float32 quantize/dequantize reference are in
test_fp8_ops.py, its training in test_fp8_training.py."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import zoo
from amp_graph.passes import AMP
from fp8_helpers import ScaledMatmulProbe

import amp_graph
from amp_graph.ops.fp8_ops import Fp8UnsupportedError
from amp_graph.policy import Fp8Config

BF16, FP32 = torch.bfloat16, torch.float32
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def nanogpt() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return zoo.NanoGPT(), torch.randint(0, 96, (2, 16))


def fp8_nodes(gm) -> list:
    return [n for n in gm.graph.nodes if "fp8_linear" in str(n.target)]


def test_preset_is_o1_with_fp8_linears():
    policy = amp_graph.Policy.preset("fp8")
    o1 = amp_graph.Policy.preset("O1")
    assert policy.name == "fp8" and policy.fp8 == Fp8Config()
    assert (policy.allow, policy.deny, policy.promote) == (o1.allow, o1.deny, o1.promote)
    assert "fp8" in amp_graph.PRESETS


@pytest.mark.usefixtures("torch_scaled_mm")
def test_compile_runs_every_eligible_linear_as_one_scaled_matmul_forward_two_backward():
    model, idx = nanogpt()
    compiled = amp_graph.compile(model, "fp8", check_each_pass=True)
    compiled.capture(idx, idx)  # capture first: its fake runs are not the step
    probe = ScaledMatmulProbe()
    with probe:
        logits, loss = compiled(idx, idx)
        forward = list(probe.calls)
        loss.backward()
    backward = probe.calls[len(forward) :]
    linears = fp8_nodes(compiled.graph_module)
    assert len(linears) == 2 * 4 + 1  # qkv, proj, fc, proj per block; the tied head (96 = 6*16)
    assert forward == [(E4M3, E4M3)] * len(linears)
    assert Counter(backward) == Counter({(E5M2, E4M3): 2 * len(linears)})  # g @ W, gT @ x
    assert logits.dtype == BF16 and loss.dtype == FP32
    assert all(p.grad.dtype == FP32 and torch.isfinite(p.grad).all() for p in model.parameters())
    assert compiled.meta["amp_graph"].dtype == BF16  # the non-fp8 ops: O1 in bf16


def test_report_and_explain_say_why_a_node_is_or_is_not_fp8():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
    compiled = amp_graph.compile(model, "fp8", example_inputs=(torch.randn(4, 32),))
    report = amp_graph.report(compiled)
    fp8 = [r for r in report.rows if r.op == "fp8 linear"]
    assert len(fp8) == 1 and fp8[0].decided_by == "fp8"
    # two products (the quantizations are none), each counted in the dtype it computes in
    assert report.products == 2 and report.low_products == {"bf16": 1, "e4m3": 1}
    assert "convolutions: 2 of 2 low: 1 in bf16, 1 in e4m3" in report.totals()
    text = str(amp_graph.explain(compiled, fp8[0].name))
    assert "float8 scaled matmul" in text and "K=32, N=64" in text
    assert "keep this layer in bf16" in text and "'linear': 'fp32'" in text
    pinned = amp_graph.Policy.preset("fp8").override(nodes={"linear": "fp32"})
    kept = amp_graph.compile(model, pinned, example_inputs=(torch.randn(4, 32),))
    assert not [n for n in kept.graph.nodes if "fp8_linear" in str(n.target)]
    kept = next(n for n in compiled.graph.nodes if n.meta[AMP].aten == "linear")
    assert "not fp8" in kept.meta[AMP].detail and "16" in kept.meta[AMP].detail
    assert "e4m3" in compiled.code or "float8_e4m3fn" in compiled.code


def test_module_filter_keeps_chosen_layers_in_bf16():
    model, idx = nanogpt()
    policy = amp_graph.Policy.preset("fp8").with_fp8(
        module_filter=lambda module, path: not path.endswith("mlp.c_proj")
    )
    compiled = amp_graph.compile(model, policy, example_inputs=(idx, idx))
    kept = [n for n in compiled.graph.nodes if n.meta[AMP].aten == "linear"]
    assert {n.meta[AMP].module_path for n in kept} == {
        "transformer.h.0.mlp.c_proj",
        "transformer.h.1.mlp.c_proj",
    }
    assert {n.meta[AMP].compute_dtype for n in kept} == {BF16}


def test_an_fp32_override_outranks_fp8():
    model, idx = nanogpt()
    policy = amp_graph.Policy.preset("fp8").override(modules={"lm_head": "fp32"})
    compiled = amp_graph.compile(model, policy, example_inputs=(idx, idx))
    head = [n for n in compiled.graph.nodes if n.meta[AMP].module_path == "lm_head"]
    assert not any("fp8" in str(n.target) for n in head)
    assert {n.meta[AMP].compute_dtype for n in head if n.meta[AMP].aten == "linear"} == {FP32}


def test_backend_runs_the_same_fp8_linears():
    model, idx = nanogpt()
    compiled = torch.compile(model, backend=amp_graph.backend("fp8", inner="eager"))
    _, loss = compiled(idx, idx)
    [gm] = amp_graph.captured_graphs(compiled)
    assert len(fp8_nodes(gm)) == 9 and loss.dtype == FP32
    eager = amp_graph.compile(model, "fp8")
    _, expected = eager(idx, idx)
    assert torch.equal(loss, expected)


def test_bad_input_gets_a_clear_error():
    with pytest.raises(ValueError, match="bfloat16, not float16"):
        amp_graph.compile(nn.Linear(16, 16), "fp8", torch.float16)
    with pytest.raises(ValueError, match="bfloat16, not float16"):
        amp_graph.backend("fp8", torch.float16)
    with pytest.raises(TypeError, match="Fp8Config"):
        amp_graph.Policy("mine", fp8="tensorwise")
    with pytest.raises(ValueError, match="delayed"):
        amp_graph.Policy.preset("O1").with_fp8(recipe="delayed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a build without CUDA")
def test_a_device_without_float8_matmuls_is_refused_before_capture():
    from amp_graph.frontends.policy_request import resolve_dtype

    with pytest.raises(Fp8UnsupportedError, match="no float8 matmul on device 'cuda'"):
        resolve_dtype(amp_graph.Policy.preset("fp8"), None, "cuda")


def test_fp8_graph_trains_a_step_like_bf16():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    x, y = torch.randn(32, 32), torch.randint(0, 16, (32,))
    first = F.cross_entropy(model(x), y).item()
    losses = {}
    for policy in ("O1", "fp8"):
        copy = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
        copy.load_state_dict(model.state_dict())
        compiled = amp_graph.compile(copy, policy, BF16)
        opt = torch.optim.Adam(copy.parameters(), lr=1e-2)
        for _ in range(60):
            loss = F.cross_entropy(compiled(x).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses[policy] = loss.item()
    assert losses["fp8"] < first / 4, (first, losses)  # it learns (memorizes the batch)
    assert abs(losses["fp8"] - losses["O1"]) < 0.1, losses


def test_fp8_nodes_show_in_print_draw_dataflow_and_numerics():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(4, 32)
    compiled = amp_graph.compile(model, "fp8", example_inputs=(x,))
    assert "fp8_linear" in compiled.code and "fp8_quantize" in compiled.code
    svg = amp_graph.inspect.draw(compiled, renderer="networkx")
    assert "e4m3" in svg.text
    flow = amp_graph.inspect.dataflow(compiled)
    quantized = [c for c in flow.conversions if c.kind == "fp8 quantize"]
    # x and the first weight, the GELU output and the second weight: one byte per element out
    assert sorted(c.node for c in quantized) == sorted(
        ["input_1_e4m3", "model_0_weight_e4m3", "gelu_e4m3", "model_2_weight_e4m3"]
    )
    for c in quantized:
        assert c.target == "e4m3"
        assert c.forward_bytes == c.numel * ({"fp32": 4, "bf16": 2}[c.source] + 1)
        assert c.backward_bytes == 0
    report = amp_graph.numerics(compiled, x)
    rows = {r.node: r for r in report.rows}
    assert rows["input_1_e4m3"].dtype == E4M3 and rows["input_1_e4m3"].max_abs == 448
    assert report.first_nonfinite is None
    with torch.no_grad():
        expected = model(x)
        got = compiled(x).float()
    error = ((got - expected).norm() / expected.norm()).item()
    assert report.output_error == pytest.approx(error, rel=1e-3)
