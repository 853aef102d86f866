"""amp_graph.numerics (the shadow run's report) and amp_graph.accuracy.autopolicy_search.

Each breaking model has one known node that fails in float16 under O3. The report must
name it (node and module), autopolicy must fix it with at most 3 float32 overrides, and the
fixed policy must hold on a sample it never saw. The shadow's numbers are checked against
the compiled module and the float32 model run directly by torch.
"""

from __future__ import annotations

import math
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.nn as nn
from amp_graph.passes import AMP
from zoo import GPTConfig, NanoGPT

import amp_graph
from amp_graph.accuracy.shadow import shadow_run

FP16 = torch.float16


# ---- models where one known node breaks ------------------------------------------------------


class OverflowBeforeNorm(nn.Module):
    """A projection whose float16 output exceeds 65504, normalised right after."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 4)
        with torch.no_grad():
            self.up.weight.mul_(3e4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.up(x)))


class ExpOfLargeActivations(nn.Module):
    """A hand-written softmax: exp of logits around 15 is over float16's range."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.exp(self.proj(x) * 20.0)
        return self.head(weights / weights.sum(-1, keepdim=True))


class OverflowingReduction(nn.Module):
    """A sum over 4096 activations of about 50: each fits float16, the sum does not."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 4096)
        self.head = nn.Linear(4096, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.proj(x)) * 100.0
        return self.head(h / h.sum(-1, keepdim=True))


class LayerScaleBranch(nn.Module):
    """A residual branch scaled by a LayerScale of 1e-5 (CaiT's init): without loss
    scaling, the branch's gradients are under float16's smallest subnormal."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.skip = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)
        self.gamma = nn.Parameter(torch.full((32,), 1e-5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.skip(x) + torch.tanh(self.fc(x)) * self.gamma)


class Healthy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.b = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.norm(self.a(x))))


def square_loss(output: torch.Tensor) -> torch.Tensor:
    return output.float().square().mean()


def samples(n: int = 2, seed: int = 0) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=generator),) for _ in range(n)]


def o3(model: nn.Module, policy: amp_graph.Policy | str = "O3") -> amp_graph.CompiledModule:
    return amp_graph.compile(model, policy, FP16)


# ---- the report names the breaking node ------------------------------------------------------


@pytest.mark.parametrize(
    ("model_type", "node", "module", "op"),
    [
        (OverflowBeforeNorm, "linear", "up", "linear"),
        (ExpOfLargeActivations, "exp", "", "exp"),
        (OverflowingReduction, "sum_1", "", "sum"),
    ],
)
def test_report_names_the_first_nonfinite_node(model_type, node, module, op):
    torch.manual_seed(0)
    model = model_type()
    (x,) = samples(1)[0]
    report = amp_graph.numerics(o3(model), x)
    first = report.first_nonfinite
    assert first is not None
    assert (first.node, first.module) == (node, module)
    assert op in first.op
    assert first.dtype == FP16
    assert first.forward.shadow_max_abs > torch.finfo(FP16).max  # float32 is out of range
    assert first.forward.new_nonfinite > 0
    # nodes before it are finite; the text names it
    before = report.rows[: report.rows.index(first)]
    assert all(r.forward.new_nonfinite == 0 for r in before)
    assert f"first non-finite: '{node}'" in str(report)


@pytest.mark.parametrize(
    "model_type", [OverflowBeforeNorm, ExpOfLargeActivations, OverflowingReduction]
)
def test_autopolicy_fixes_forward_failures_with_few_overrides(model_type):
    torch.manual_seed(0)
    model = model_type()
    policy = amp_graph.autopolicy(model, "O3", FP16, sample_inputs=samples(2))
    assert 1 <= len(policy.nodes) <= 3
    assert set(policy.nodes.values()) == {amp_graph.Rule.DENY}
    assert policy.name == "O3+autopolicy"
    unseen = samples(1, seed=7)[0]
    report = amp_graph.numerics(o3(model, policy), *unseen)
    assert report.first_nonfinite is None
    assert report.output_error <= 10 * torch.finfo(FP16).eps
    # every demotion was needed: giving any one back breaks a sample again
    for node in policy.nodes:
        rest = {n: r for n, r in policy.nodes.items() if n != node}
        fewer = amp_graph.Policy.preset("O3").override(nodes=rest)
        broken = amp_graph.numerics(o3(model, fewer), *samples(1)[0])
        assert broken.first_nonfinite is not None or broken.output_error > 1e-2


def test_explain_quotes_the_autopolicy_evidence():
    torch.manual_seed(0)
    model = OverflowBeforeNorm()
    policy = amp_graph.autopolicy(model, "O3", FP16, sample_inputs=samples(1))
    assert "linear" in policy.nodes
    compiled = o3(model, policy)
    compiled(*samples(1)[0])
    text = amp_graph.explain(compiled, "linear")
    peak = amp_graph.numerics(o3(model), *samples(1)[0]).row("linear").forward.shadow_max_abs
    assert f"demoted by autopolicy: max |x| {peak:.2g} > float16 max 65504 on sample 0" in text
    linear = next(n for n in compiled.graph.nodes if n.name == "linear")
    assert linear.meta["val"].dtype == torch.float32


def test_gradient_underflow_report_and_autopolicy():
    torch.manual_seed(0)
    model = LayerScaleBranch()
    (x,) = samples(1)[0]
    compiled = o3(model)
    unscaled = amp_graph.numerics(compiled, x, backward=True, loss_fn=square_loss, scale=1.0)
    scaled = amp_graph.numerics(compiled, x, backward=True, loss_fn=square_loss)
    assert scaled.scale == 2.0**16  # GradScaler's initial scale is the default for float16
    lost = unscaled.grad_underflow_by_module()
    assert lost["fc"] > 0.9  # the branch's weights get (almost) no gradient without scaling
    assert scaled.grad_underflow_by_module()["fc"] < lost["fc"] / 10
    assert f"at scale 2**0, {100 * lost['fc']:.1f}% of 'fc' grads underflow (fp16)" in str(unscaled)
    # the forward is fine: the failure is in the gradients only
    assert unscaled.first_nonfinite is None and unscaled.output_error < 1e-2

    policy = amp_graph.autopolicy(
        model, "O3", FP16, sample_inputs=samples(2), loss_fn=square_loss, scale=1.0
    )
    assert 1 <= len(policy.nodes) <= 3
    assert any("gradient underflow" in note for note in policy.notes.values())
    fixed = amp_graph.numerics(
        o3(model, policy), *samples(1, seed=3)[0], backward=True, loss_fn=square_loss, scale=1.0
    )
    assert max(p.grad.rel_error for p in fixed.params) <= 10 * torch.finfo(FP16).eps


def test_grad_underflow_matches_the_compiled_models_own_gradients():
    """The report's per-parameter underflow is what the compiled module's real backward
    gives, counted independently here."""
    torch.manual_seed(0)
    model = LayerScaleBranch()
    (x,) = samples(1)[0]
    compiled = o3(model)
    report = amp_graph.numerics(compiled, x, backward=True, loss_fn=square_loss, scale=1.0)
    mixed = torch.autograd.grad(square_loss(compiled(x)), list(model.parameters()))
    full = torch.autograd.grad(square_loss(model(x)), list(model.parameters()))
    tiny = torch.finfo(FP16).tiny
    for (name, _), m, f in zip(model.named_parameters(), mixed, full, strict=True):
        row = next(p for p in report.params if p.name == name)
        expected = ((m.abs() < tiny) & (f != 0)).float().mean().item()
        assert row.grad.underflow == pytest.approx(expected, abs=1e-6), name
        assert row.grad.rel_error == pytest.approx(
            ((m - f).norm() / f.norm()).item(), rel=1e-3, abs=1e-6
        )


def test_a_model_that_needs_nothing_keeps_its_policy():
    torch.manual_seed(0)
    model = Healthy()
    base = amp_graph.Policy.preset("O3")
    policy = amp_graph.autopolicy(model, base, FP16, sample_inputs=samples(3))
    assert policy is base
    by_name = amp_graph.autopolicy(model, "O3", FP16, sample_inputs=samples(3))
    assert by_name == base and not by_name.nodes
    with_grads = amp_graph.autopolicy(
        model, base, FP16, sample_inputs=samples(2), loss_fn=square_loss
    )
    assert with_grads is base


def test_autopolicy_says_when_tol_cannot_be_met():
    torch.manual_seed(0)
    model = Healthy()
    with pytest.raises(amp_graph.AutopolicyError, match="could not meet tol") as caught:
        amp_graph.autopolicy(model, "O3", FP16, sample_inputs=samples(1), tol=1e-9)
    assert isinstance(caught.value.policy, amp_graph.Policy)


# ---- the numbers are the compiled module's and the float32 model's ---------------------------


def test_shadow_and_mixed_values_are_the_real_runs():
    torch.manual_seed(0)
    model = NanoGPT(GPTConfig(dropout=0.0)).eval()
    idx = torch.randint(0, 96, (2, 16))
    compiled = amp_graph.compile(model, "O1", torch.bfloat16)
    report = amp_graph.numerics(compiled, idx)
    with torch.no_grad():
        logits, _ = compiled(idx)
        reference, _ = model(idx)
    expected = ((logits.float() - reference).norm() / reference.norm()).item()
    assert report.outputs[0].rel_error == pytest.approx(expected, rel=1e-4)
    assert report.outputs[0].dtype is None or report.outputs[0].numel == logits.numel()
    assert report.rows[-1].forward.numel == logits.numel()
    # nanoGPT masks attention with -inf: that is float32's value too, not a finding
    assert any(r.forward.nonfinite for r in report.rows)
    assert report.first_nonfinite is None


def test_rows_cover_every_node_with_a_floating_value():
    torch.manual_seed(0)
    model = Healthy()
    compiled = o3(model)
    (x,) = samples(1)[0]
    report = amp_graph.numerics(compiled, x)
    gm = compiled.graph_module
    expected = [
        n.name
        for n in gm.graph.nodes
        if n.op != "output"
        and isinstance(n.meta[AMP].out_dtype, torch.dtype)
        and n.meta[AMP].out_dtype.is_floating_point
    ]
    assert [r.node for r in report.rows] == expected
    casts = [r for r in report.rows if r.role == "cast"]
    to_low = [r for r in casts if r.users != ("output",)]
    assert to_low and all(r.dtype == FP16 for r in to_low)
    # O3 returns its output in float32 (Policy.output_dtype, as Apex's O3)
    assert [r.dtype for r in casts if r.users == ("output",)] == [torch.float32]
    params = [r for r in report.rows if r.role == "param"]
    assert len(params) == 6 and all(r.rel_error == 0 and r.dtype == torch.float32 for r in params)
    assert [r.node for r in report.worst(2)] == [
        r.node for r in sorted(report.rows[1:], key=lambda r: -r.rel_error)[:2]
    ]


def test_shadow_run_never_changes_the_model():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 4)
    ).train()
    compiled = amp_graph.compile(model, "O1", torch.bfloat16)
    (x,) = samples(1)[0]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    x_before = x.clone()
    report = amp_graph.numerics(compiled, x, backward=True, loss_fn=square_loss)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(x, x_before)
    # dropout drew the same mask in both runs: otherwise the error after it would be ~1
    dropout = next(r for r in report.rows if "dropout" in r.op)
    assert dropout.rel_error < 0.05
    # and the model still trains as before: a real step moves the running stats
    model(x)
    assert not torch.equal(state["1.running_mean"], model.state_dict()["1.running_mean"])


def test_in_place_updates_are_measured_when_they_happen():
    class Accumulate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            first = h * 2
            h.add_(1000.0)
            return first + h

    torch.manual_seed(0)
    model = Accumulate()
    (x,) = samples(1)[0]
    report = amp_graph.numerics(amp_graph.compile(model, "O1", torch.bfloat16), x)
    linear = report.row("linear")
    assert linear.max_abs < 100  # measured before the in-place add changed it
    with torch.no_grad():
        expected = model(x)
        got = amp_graph.compile(model, "O1", torch.bfloat16)(x)
    error = ((got.float() - expected).norm() / expected.norm()).item()
    assert report.outputs[0].rel_error == pytest.approx(error, rel=1e-3)


def test_the_shadow_runs_fp8_nodes_as_their_float32_math():
    """The shadow's fx.Interpreter runs an fp8 node's float32 substitute (shadow_targets),
    given the node's own float8 dtype argument: the linear is ``F.linear``, the activation's
    scale is 448 over the float32 activation's amax, the quantized input is ``x * scale``
    unrounded. Run as written, the shadow would equal the fp8 run (no error)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(4, 32)
    report = amp_graph.numerics(amp_graph.compile(model, "fp8", example_inputs=(x,)), x)
    with torch.no_grad():
        linear = model[0](x)
        gelu = model[1](linear)
    rows = {r.node: r.forward for r in report.rows}
    assert rows["linear_fp8"].shadow_max_abs == pytest.approx(linear.abs().max().item(), rel=1e-6)
    assert rows["linear_fp8"].rel_error > 1e-3
    scale = 448.0 / gelu.abs().max().item()  # float8_e4m3fn's max over the amax
    assert rows["gelu_scale"].shadow_max_abs == pytest.approx(scale, rel=1e-6)
    assert rows["input_1_e4m3"].shadow_max_abs == pytest.approx(448.0, rel=1e-6)
    assert rows["input_1_e4m3"].rel_error > 1e-3


# ---- views, errors, CLI ------------------------------------------------------------------------


def test_text_html_and_plot():
    torch.manual_seed(0)
    report = amp_graph.numerics(o3(ExpOfLargeActivations()), *samples(1)[0])
    text = str(report)
    assert "rel. error" in text and "exp" in text
    html = report._repr_html_()
    assert html.count("<tr") == len(report.rows) + 1 and "background:#ffd6d6" in html
    svg = report.plot()
    root = ET.fromstring(svg.text)
    legend = [e for e in root if e.get("class") == "legend"]
    marks = [e for e in root if e.tag.rsplit("}", 1)[-1] in ("circle", "g") and e not in legend]
    assert len(marks) == len([r for r in report.rows if r.role != "input"])
    assert "exp" in svg.text
    assert "first non-finite 'exp'" in repr(report)


def test_plot_of_hf_gpt2_with_a_hot_mlp_says_what_it_shows():
    """The plot as a new user meets it (issue 25): HF GPT-2 under O3 fp16 with one MLP
    scaled until it overflows. The legend names every mark, the first non-finite node is
    labelled with its module, the modules are named along the x axis, the y axis is named."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight.mul_(3e4)
    ids = torch.randint(0, 64, (2, 16))
    compiled = amp_graph.compile(model, "O3", torch.float16)
    report = amp_graph.numerics(compiled, input_ids=ids, use_cache=False)
    first = report.first_nonfinite
    assert first is not None and first.module.startswith("transformer.h.1.mlp")
    root = ET.fromstring(report.plot().text)
    texts = {e.get("class"): e.text for e in root.iter() if e.get("class")}
    assert texts["first-nonfinite"] == f"first non-finite: {first.node} ({first.module})"
    legend = next(e for e in root if e.get("class") == "legend")
    legend_text = " ".join(t.text for t in legend.iter() if t.text)
    drawn = {_dtype_name(r.dtype) for r in report.rows if r.role != "input"}
    assert drawn >= {"fp32", "fp16", "other"}  # O3 fp16: layer norms in fp32, int indices
    assert all(name in legend_text for name in drawn) and "inf/nan" in legend_text
    modules = [e.text for e in root.iter() if e.get("class") == "module"]
    assert "transformer.h.1" in " ".join(modules) and len(modules) >= 3
    assert any("relative error against float32" in (e.text or "") for e in root.iter())


def _dtype_name(dtype):
    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    return names.get(dtype, "other")


def test_errors_say_what_to_do():
    model = Healthy()
    with pytest.raises(TypeError, match="Compile the model first"):
        amp_graph.numerics(model, torch.randn(2, 16))
    compiled = o3(model)
    with pytest.raises(ValueError, match="loss_fn="):
        amp_graph.numerics(compiled, torch.randn(2, 16), backward=True)
    with pytest.raises(ValueError, match="sample_inputs"):
        amp_graph.autopolicy(model, sample_inputs=[])
    with pytest.raises(ValueError, match="note explains a node override"):
        amp_graph.Policy.preset("O3").override(notes={"linear": "why"})


def test_numerics_on_hf_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (2, 16))
    compiled = amp_graph.compile(model, "O1", torch.bfloat16)
    report = amp_graph.numerics(compiled, input_ids=ids, use_cache=False)
    assert report.first_nonfinite is None
    assert len(report.rows) > 50
    assert {r.module for r in report.rows} >= {"transformer.h.0.attn", "lm_head"} or any(
        r.module.startswith("transformer.h.0") for r in report.rows
    )
    assert math.isfinite(report.output_error) and report.output_error < 0.1


def test_cli_numerics(tmp_path):
    source = tmp_path / "breaking.py"
    source.write_text(
        "import torch, torch.nn as nn\n"
        "class Model(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.up = nn.Linear(16, 64); self.norm = nn.LayerNorm(64)\n"
        "        with torch.no_grad(): self.up.weight.mul_(1e5)\n"
        "    def forward(self, x): return self.norm(self.up(x))\n"
    )
    svg = tmp_path / "error.svg"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "amp_graph",
            "numerics",
            f"{source}:Model",
            "--input-shape",
            "8,16",
            "--policy",
            "O3",
            "--dtype",
            "fp16",
            "--worst",
            "2",
            "--autopolicy",
            "--svg",
            str(svg),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "first non-finite: 'linear' (aten.linear in module 'up'" in run.stdout
    assert "autopolicy: keep 'linear' in float32 (max |x|" in run.stdout
    assert svg.read_text().startswith("<svg")


def test_shadow_run_result_is_reusable_without_the_report():
    torch.manual_seed(0)
    result = shadow_run(o3(OverflowBeforeNorm()), samples(1)[0])
    assert result.dtype == FP16
    assert next(r for r in result.nodes if r.forward.new_nonfinite).node == "linear"


def test_a_model_that_writes_its_input_is_measured_on_copies():
    import zoo

    torch.manual_seed(0)
    model = zoo.UpdatesInput()
    x = torch.randn(4, 16)
    compiled = amp_graph.compile(model, "O1", torch.bfloat16)
    report = amp_graph.numerics(compiled, x.clone())
    caller = x.clone()
    amp_graph.numerics(compiled, caller)
    assert torch.equal(caller, x)  # the caller's tensor is not written by numerics
    with torch.no_grad():
        expected = model(x.clone())
        got = compiled(x.clone()).float()
    error = ((got - expected).norm() / expected.norm()).item()
    assert report.outputs[0].rel_error == pytest.approx(error, rel=1e-3)


def test_shadow_copies_where_the_mixed_run_copied():
    """``h = tanh(x).float(); fc1(h); h.mul_(2)`` trains under O1 (the bf16 ``.float()`` is
    a copy); in the float32 shadow ``.float()`` returns ``h`` itself, which would make the
    in-place update corrupt tanh's saved output. The shadow copies as the mixed run did."""
    import zoo

    torch.manual_seed(0)
    model = zoo.UpdateBetweenUses()
    x = torch.randn(4, 16)
    compiled = amp_graph.compile(model, "O1", torch.bfloat16)
    report = amp_graph.numerics(compiled, x, backward=True, loss_fn=square_loss)
    mixed = torch.autograd.grad(square_loss(compiled(x)), list(model.parameters()))
    for (name, _), grad in zip(model.named_parameters(), mixed, strict=True):
        row = next(p for p in report.params if p.name == name)
        assert row.grad.nonfinite == 0 and row.grad.numel == grad.numel()
    assert report.first_nonfinite is None


def test_findings_name_nodes_whose_values_underflow():
    torch.manual_seed(0)
    model = LayerScaleBranch()
    with torch.no_grad():
        model.gamma.fill_(1e-9)  # tanh(...) * 1e-9 is below float16's smallest subnormal
    report = amp_graph.numerics(o3(model), *samples(1)[0])
    mul = report.row("mul")
    assert mul.forward.underflow > 0.9 and mul.dtype == FP16
    line = next(x for x in report.findings() if x.startswith("underflow"))
    assert f"'mul' {100 * mul.forward.underflow:.1f}% (fp16)" in line


def test_autopolicy_captures_once_per_input_signature_and_demotion_set(monkeypatch):
    """A demotion can change what is captured (the dtypes the model's Python sees), so each
    set of demotions is judged on its own capture, made once however often it is tried."""
    import amp_graph.frontends.compiler as compiler

    calls = []
    capture = compiler.capture_for_policy

    def counting(model, args, kwargs, policy, *rest, **options):
        calls.append((tuple(args[0].shape), frozenset(policy.nodes)))
        return capture(model, args, kwargs, policy, *rest, **options)

    monkeypatch.setattr(compiler, "capture_for_policy", counting)
    torch.manual_seed(0)
    model = ExpOfLargeActivations()
    inputs = [*samples(2), (torch.randn(3, 16),)]  # two signatures
    policy = amp_graph.autopolicy(model, "O3", FP16, sample_inputs=inputs)
    assert len(policy.nodes) >= 2  # several policies were tried ...
    assert len(calls) == len(set(calls))  # ... each captured once per signature
    assert {shape for shape, _ in calls} == {(8, 16), (3, 16)}
    assert len({demoted for _, demoted in calls}) >= 3  # none, one, two demotions at least
    # and the shared captures were never rewritten in place: a fresh compile agrees
    fresh = amp_graph.numerics(o3(model, policy), *samples(1, seed=5)[0])
    assert fresh.first_nonfinite is None


def test_the_deferred_read_back_path_gives_the_same_report(monkeypatch):
    """On a GPU the statistics stay on the device until one read at the end (the path no
    CPU run takes); run that path here and compare it with the per-node one."""
    import amp_graph.accuracy.shadow as shadow

    torch.manual_seed(0)
    model = OverflowBeforeNorm()
    x = samples(1)[0]
    compiled = o3(model)
    per_node = amp_graph.numerics(compiled, *x, backward=True, loss_fn=square_loss)
    monkeypatch.setattr(shadow, "reads_back_per_node", lambda device: False)
    deferred = amp_graph.numerics(compiled, *x, backward=True, loss_fn=square_loss)
    assert [r.node for r in deferred.rows] == [r.node for r in per_node.rows]
    for a, b in zip(per_node.rows, deferred.rows, strict=True):
        for field in ("numel", "zeros", "subnormals", "underflow", "nonfinite", "new_nonfinite"):
            assert getattr(a.forward, field) == pytest.approx(getattr(b.forward, field)), field
        assert a.forward.max_abs == pytest.approx(b.forward.max_abs, rel=1e-6)
        assert a.forward.rel_error == pytest.approx(b.forward.rel_error, rel=1e-5)
    assert deferred.first_nonfinite.node == per_node.first_nonfinite.node == "linear"
    assert [p.grad.nonfinite for p in deferred.params] == [
        p.grad.nonfinite for p in per_node.params
    ]
