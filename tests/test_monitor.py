"""amp_graph.monitor: per-step statistics of chosen nodes (issue 25, the monitor's core).

The oracle for the statistics is computed by hand, independently of
:mod:`amp_graph.ops.tensor_stats`: the same graph runs under an ``fx.Interpreter`` that keeps
each measured value (forward) and puts a tensor hook on it (backward), and each statistic is
computed from its definition with real casts (``(x * scale).to(fmt) == 0``), not thresholds.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils.checkpoint
from amp_graph.passes.meta import is_dtype_cast
from scaler_helpers import SyncCounter

import amp_graph
from amp_graph.demo.models import GPT, ConvNet
from amp_graph.ops import fp8_ops  # noqa: F401 (registers torch.ops.amp_graph.fp8_*)
from amp_graph.ops.cpu_extension import cpu_extension_status, load_cpu_extension
from amp_graph.ops.recompute_ops import recomputed_quantize
from amp_graph.ops.tensor_stats import STATS, WHATIF_FORMATS, accumulate, measure

BF16, FP16 = torch.bfloat16, torch.float16


# ---- the statistics, by hand --------------------------------------------------------------


def by_hand(x: torch.Tensor, run_dtype: torch.dtype, scale: torch.Tensor | None = None) -> dict:
    """Every statistic of ``x`` from its definition (fractions of numel, as History has)."""
    x = x.detach()
    exact = x.double()
    n = x.numel()
    finite = torch.isfinite(exact)
    scaled = x.float() if scale is None else x.float() * scale.float()
    nonzero = exact != 0
    out = {
        "amax": exact[finite].abs().max().item() if finite.any() else 0.0,
        "zeros": (exact == 0).sum().item() / n,
        "nonfinite": (~finite).sum().item(),
        "underflow": (nonzero & (scaled.to(run_dtype).double().abs() < torch.finfo(run_dtype).tiny))
        .sum()
        .item()
        / n,
    }
    for name, fmt in WHATIF_FORMATS.items():
        out[f"{name}_underflow"] = (nonzero & (scaled.to(fmt).double() == 0)).sum().item() / n
        over = finite & (scaled.double().abs() > torch.finfo(fmt).max)
        out[f"{name}_overflow"] = over.sum().item() / n
    return out


def _as_fractions(row: torch.Tensor) -> dict:
    values = dict(zip(STATS, row.tolist(), strict=True))
    n = values.pop("numel")
    return {k: v if k in ("amax", "nonfinite") else v / n for k, v in values.items()}


def _edge_values() -> torch.Tensor:
    """Every format's rounding boundaries, a step either side, and wide random magnitudes."""
    edges = []
    for fmt in (*WHATIF_FORMATS.values(), torch.float32):
        info = torch.finfo(fmt)
        smallest = info.tiny * info.eps
        for value in (smallest / 2, info.tiny - smallest / 2, info.tiny, info.max):
            v = torch.tensor(value, dtype=torch.float32)
            edges += [v, torch.nextafter(v, torch.tensor(0.0)), torch.nextafter(v, v * 2)]
    edges = torch.stack(edges)
    gen = torch.Generator().manual_seed(0)
    wide = torch.exp(torch.empty(4000).uniform_(-105, 90, generator=gen))
    signs = torch.where(torch.rand(4000, generator=gen) < 0.5, -1.0, 1.0)
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan])
    return torch.cat([edges, -edges, wide * signs, special])


def _computed(path: str, x: torch.Tensor, run_dtype, scale=None) -> dict:
    """One row of statistics: by the one-pass CPU kernel, or by torch ops (the fallback)."""
    if path == "torch ops":
        return _as_fractions(measure(x, run_dtype, scale))
    assert load_cpu_extension(), cpu_extension_status()  # ninja and g++ are in the dev setup
    row = torch.zeros(1, len(STATS), dtype=torch.float64)
    accumulate(row, 0, x, run_dtype, scale)
    return _as_fractions(row[0])


PATHS = ["kernel", "torch ops"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("run_dtype", [BF16, FP16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("scale", [None, 1.0, 2.0**-20, 2.0**12, 448 / 3.0])
def test_statistics_match_casts_at_every_boundary(path, run_dtype, scale) -> None:
    x = _edge_values()
    scale_t = None if scale is None else torch.tensor(scale)
    got = _computed(path, x, run_dtype, scale_t)
    want = by_hand(x, run_dtype, scale_t)
    assert got == pytest.approx(want, rel=0, abs=0), {
        k: (got[k], want[k]) for k in want if got[k] != want[k]
    }
    # the case is not vacuous: something under- and overflows in each format
    if scale is None:
        assert all(want[f"{f}_underflow"] > 0 for f in WHATIF_FORMATS)
        assert all(want[f"{f}_overflow"] > 0 for f in ("fp16", "e4m3", "e5m2"))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "dtype", [BF16, FP16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float64]
)
def test_statistics_of_every_dtype(path, dtype) -> None:
    x = _edge_values()
    x = torch.cat([x, x * 1e-3, x * 1e3]).to(dtype)  # inf and NaN included where dtype has them
    for run_dtype in (dtype, BF16):
        want = by_hand(x, run_dtype)
        assert _computed(path, x, run_dtype) == pytest.approx(want, rel=0, abs=0), run_dtype


@pytest.mark.parametrize("numel", [0, 1, 255, 256, 257, 40000])
def test_kernel_blocks_and_chunks(numel) -> None:
    """Sizes around the kernel's block (256) and chunk (32768) edges, and an empty tensor."""
    x = torch.randn(numel) * torch.logspace(-40, 10, numel)
    row = torch.zeros(1, len(STATS), dtype=torch.float64)
    accumulate(row, 0, x, BF16)
    assert torch.equal(row[0], measure(x, BF16))
    assert row[0, STATS.index("numel")] == numel


def _banded_blocks() -> torch.Tensor:
    """Blocks of the kernel's 256 values: each within one band of magnitudes (whole blocks
    below, above or across each threshold, which the kernel counts from the block's range),
    one block of each edge value of :func:`_edge_values` alone and one of its neighbours, and
    bands with a zero, inf and NaN among them."""
    gen = torch.Generator().manual_seed(1)
    signs = torch.where(torch.rand(256, generator=gen) < 0.5, -1.0, 1.0)
    bands = [
        torch.exp2(torch.empty(256).uniform_(e, e + 6, generator=gen)) * signs
        for e in range(-152, 130, 6)
    ]
    edges = _edge_values()[:60]  # every format's boundaries and their neighbours
    blocks = [*bands, *(torch.full((256,), float(v)) for v in edges)]
    for special in (0.0, math.inf, math.nan):
        for band in bands[::5]:
            with_special = band.clone()
            with_special[7] = special
            blocks.append(with_special)
    return torch.cat(blocks)


@pytest.mark.parametrize("dtype", [torch.float32, BF16, FP16])
@pytest.mark.parametrize("run_dtype", [BF16, FP16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("scale", [None, 2.0**-20, 2.0**12, 448 / 3.0])
def test_kernel_block_ranges_match_casts(dtype, run_dtype, scale) -> None:
    """The kernel counts a threshold without a pass where the whole block lies on one side:
    whole blocks on each side of every threshold, and blocks exactly at it, against the
    definitions."""
    x = _banded_blocks().to(dtype)
    scale_t = None if scale is None else torch.tensor(scale)
    got = _computed("kernel", x, run_dtype, scale_t)
    want = by_hand(x, run_dtype, scale_t)
    assert got == pytest.approx(want, rel=0, abs=0), {
        k: (got[k], want[k]) for k in want if got[k] != want[k]
    }
    # every count the shortcut takes is there: whole blocks under each format, and over
    # (float16 values have already lost both ends)
    if scale is None and dtype != FP16:
        assert all(want[f"{f}_underflow"] * x.numel() >= 256 for f in ("fp16", "e4m3", "e5m2"))
        assert all(want[f"{f}_overflow"] * x.numel() >= 256 for f in ("e4m3", "e5m2"))


def test_kernel_reads_every_float16_exactly() -> None:
    """The kernel converts float16 by moving its bit fields: every one of the 65,536 values
    (subnormals, inf, NaN), against the definitions."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(FP16)
    for run_dtype in (FP16, BF16):
        got, want = _computed("kernel", x, run_dtype), by_hand(x, run_dtype)
        assert got == pytest.approx(want, rel=0, abs=0), run_dtype
    sums = torch.zeros(1, len(STATS), dtype=torch.float64)
    accumulate(sums, 0, x, FP16)
    assert sums[0, STATS.index("amax")] == 65504.0
    assert sums[0, STATS.index("nonfinite")] == 2 * 1024  # +-inf and the NaNs


@pytest.mark.parametrize("scale", [0.0, -3.0, math.inf])
def test_kernel_any_scale_counts_as_torch_ops(scale) -> None:
    """A scale that is not positive and finite (no fp8 recipe makes one) is counted by the
    definitions' formulas, pass by pass, as the torch-ops path counts it."""
    x = _banded_blocks()
    row = torch.zeros(1, len(STATS), dtype=torch.float64)
    accumulate(row, 0, x, BF16, torch.tensor(scale))
    assert torch.equal(row[0], measure(x, BF16, torch.tensor(scale)))


# ---- the statistics in a graph, against an interpreter with hooks ---------------------------


_ROLE_ARG = {"input": ("input", "self", "x"), "weight": ("weight",), "mat2": ("mat2",)}


def _operand(node: fx.Node, role: str) -> fx.Node:
    names = [a.name for a in node.target._schema.arguments]
    for name in _ROLE_ARG.get(role.removeprefix("grad_"), (role.removeprefix("grad_"),)):
        if name in names:
            return node.args[names.index(name)]
    raise AssertionError(f"no operand {role} of {node}")


def _reference(compiled, probes, inputs, loss_fn) -> dict[tuple[str, str], dict]:
    """Each probe's statistics by hand, from the plain graph's own values and gradients."""
    gm = compiled.graph_module
    nodes = {n.name: n for n in gm.graph.nodes}
    wanted: dict[str, list] = {}  # node name -> [(probe, "value" | "grad", run dtype, scale)]
    for p in probes:
        node = nodes[p.node]
        quantize = node.target in (torch.ops.amp_graph.fp8_quantize.default, recomputed_quantize)
        if p.role in ("output", "grad_output"):
            source = node
        elif quantize:
            source = node.args[0]
        else:
            source = _operand(node, p.role)
            if not p.backward and is_dtype_cast(source):
                source = source.args[0]
        scale = None
        if quantize and p.role != "output":
            scale = node.args[1]
        if node.target is torch.ops.amp_graph.fp8_linear.default and p.role in ("input", "weight"):
            scale = node.args[3] if p.role == "input" else node.args[5]
        wanted.setdefault(source.name, []).append((p, p.backward, p.run_dtype, scale))
    results: dict[tuple[str, str], dict] = {}
    kept: dict[str, torch.Tensor] = {}
    scales = {scale.name for entries in wanted.values() for *_, scale in entries if scale}

    class Keep(fx.Interpreter):
        def run_node(self, n):
            value = super().run_node(n)
            if n.name in wanted or n.name in scales:
                kept[n.name] = value
            for probe, backward, _, _ in wanted.get(n.name, ()):
                if backward:
                    key = (probe.node, probe.role)
                    value.register_hook(
                        lambda g, key=key: results.__setitem__(key, by_hand(g, g.dtype))
                    )
            return value

    loss_fn(Keep(gm).run(*inputs)).backward()
    for name, entries in wanted.items():
        for probe, backward, run_dtype, scale in entries:
            if not backward:
                s = None if scale is None else kept[scale.name]
                results[(probe.node, probe.role)] = by_hand(kept[name], run_dtype, s)
    return results


def _check_history(monitor, reference, step=0) -> int:
    rows = monitor.history.where(step=step).rows
    assert {(r["node"], r["role"]) for r in rows} == set(reference)
    for row in rows:
        want = reference[(row["node"], row["role"])]
        got = {k: row[k] for k in want}
        assert got == pytest.approx(want, rel=1e-12, abs=0), (row["node"], row["role"])
    return len(rows)


def test_gpt_forward_dgrad_wgrad_equal_hand_computed_statistics() -> None:
    torch.manual_seed(0)
    model = GPT()
    compiled = amp_graph.compile(model, policy="O1", dtype=BF16)
    idx = torch.randint(0, 64, (2, 32))
    compiled(idx)  # capture
    monitor = amp_graph.monitor(compiled, every=1)
    compiled(idx).float().square().mean().backward()
    reference = _reference(compiled, monitor.probes, (idx,), lambda y: y.float().square().mean())
    rows = _check_history(monitor, reference)
    roles = {r["role"] for r in monitor.history}
    assert roles == {"input", "weight", "output", "grad_output", "grad_weight"}
    # 2 blocks x 6 linears + the head, each: input, weight, output, grad_output, grad_weight
    assert rows == 13 * 5
    head = monitor.history.where(node="linear_12", role="weight").rows
    assert head and head[0]["dtype"] == "fp32" and head[0]["run_dtype"] == "bf16"


def test_gradients_are_measured_at_the_loss_scale() -> None:
    """A graph's backward runs on the scaled loss: its gradient statistics are those."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    compiled = amp_graph.compile(model, policy="O1", dtype=FP16)
    x = torch.randn(8, 16)
    monitor = amp_graph.monitor(compiled, every=1)
    scale = 2.0**10
    (compiled(x).float().sum() * scale).backward()
    grads = monitor.history.where(role="grad_output").rows
    # the output layer's gradient comes first (backward runs in reverse): d(scale * sum)/d(out)
    assert grads[0]["amax"] == scale
    reference = _reference(compiled, monitor.probes, (x,), lambda y: y.float().sum() * scale)
    _check_history(monitor, reference)


def test_rows_record_the_loss_scale_of_their_step() -> None:
    """torch's GradScaler over a compiled module (given as scaler=), growing every step: each
    logging step's rows carry the scale its backward ran at, read in the monitor's one read."""
    torch.manual_seed(0)
    compiled = amp_graph.compile(nn.Sequential(nn.Linear(8, 8)), policy="O1", dtype=FP16)
    opt = torch.optim.SGD(compiled.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1)
    monitor = amp_graph.monitor(compiled, every=2, scaler=scaler)
    x = torch.randn(4, 8)
    for _ in range(3):
        opt.zero_grad()
        scaler.scale(compiled(x).float().sum()).backward()
        scaler.step(opt)
        scaler.update()
    history = monitor.history
    assert {r["step"]: r["loss_scale"] for r in history} == {0: 2.0**4, 2: 2.0**6}
    # d(scale * sum)/d(out) = scale: the gradients were measured at it
    assert [r["amax"] for r in history.where(role="grad_output")] == [2.0**4, 2.0**6]
    unscaled = amp_graph.compile(nn.Linear(8, 8), policy="O1", dtype=BF16)
    plain = amp_graph.monitor(unscaled, every=1)
    unscaled(x).sum().backward()
    assert {r["loss_scale"] for r in plain.history} == {None}
    with pytest.raises(TypeError, match="GradScaler"):
        amp_graph.monitor(unscaled, scaler=2.0**16)


def test_fp8_operands_measured_in_e4m3_at_their_scale() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    compiled = amp_graph.compile(model, policy="fp8", dtype=BF16)
    x = torch.randn(16, 32)
    x[0, :4] = torch.tensor([1e-9, 1e-7, 3e-5, 1e3])  # some underflow at x's scale
    compiled(x)
    monitor = amp_graph.monitor(compiled, every=1)
    compiled(x).float().sum().backward()
    fp8 = [p for p in monitor.probes if p.op == "fp8 linear" and not p.backward]
    assert {p.run_dtype for p in fp8 if p.role in ("input", "weight")} == {torch.float8_e4m3fn}
    reference = _reference(compiled, monitor.probes, (x,), lambda y: y.float().sum())
    _check_history(monitor, reference)
    first_input = next(r for r in monitor.history if r["op"] == "fp8 linear")
    assert first_input["role"] == "input"
    assert first_input["underflow"] > 0  # 1e-9 at the scale of 1e3 is lost in e4m3
    quantized = {(r["node"], r["role"]) for r in monitor.history if r["op"] == "fp8 quantize"}
    # every fp8 quantization is measured too: x's and each weight's, as it and as float8
    assert quantized == {
        ("input_1_e4m3", "input"),
        ("input_1_e4m3", "output"),
        ("model_0_weight_e4m3", "weight"),
        ("model_0_weight_e4m3", "output"),
        ("relu_e4m3", "input"),
        ("relu_e4m3", "output"),
        ("model_2_weight_e4m3", "weight"),
        ("model_2_weight_e4m3", "output"),
    }


# ---- what a step runs ----------------------------------------------------------------------


def _train(compiled, data, monitor_every=None):
    if monitor_every is not None:
        amp_graph.monitor(compiled, every=monitor_every)
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(compiled(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in compiled.parameters()]


def test_training_is_bit_identical_with_the_monitor() -> None:
    data = [(torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))) for _ in range(5)]
    runs = []
    for every in (None, 2, 1):
        torch.manual_seed(0)
        compiled = amp_graph.compile(ConvNet(channels=8), policy="O1", dtype=BF16)
        runs.append(_train(compiled, data, every))
    for losses, params in runs[1:]:
        assert torch.equal(losses, runs[0][0])
        assert all(torch.equal(a, b) for a, b in zip(params, runs[0][1], strict=True))


def test_history_the_same_without_the_kernel(monkeypatch) -> None:
    """A machine that cannot build the CPU kernel gets the same history from torch ops."""
    histories = []
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr(amp_graph.ops.tensor_stats, "_kernel_applies", lambda x, s: False)
        torch.manual_seed(0)
        compiled = amp_graph.compile(GPT(), policy="O1", dtype=BF16)
        monitor = amp_graph.monitor(compiled, every=1)
        compiled(torch.randint(0, 64, (2, 32))).float().square().mean().backward()
        histories.append(monitor.history.rows)
    assert histories[0] == histories[1]


def test_a_non_logging_step_runs_the_graph_as_it_is() -> None:
    compiled = amp_graph.compile(ConvNet(channels=8), policy="O1", dtype=BF16)
    x = torch.randn(2, 1, 8, 8)
    compiled(x)
    gm = compiled.graph_module
    monitor = amp_graph.monitor(compiled, every=3)
    ran = [monitor.graph_for_step(gm) for _ in range(7)]
    assert [g is gm for g in ran] == [False, True, True, False, True, True, False]
    assert ran[0] is ran[3] is ran[6]  # instrumented once
    stats_nodes = [n for n in ran[0].graph.nodes if n.name.startswith("stats_")]
    assert stats_nodes and not [n for n in gm.graph.nodes if n.name.startswith("stats_")]


def test_no_host_read_until_the_user_reads() -> None:
    torch.manual_seed(0)
    compiled = amp_graph.compile(ConvNet(channels=8), policy="O1", dtype=BF16)
    monitor = amp_graph.monitor(compiled, every=2)
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    compiled(x)  # capture (and step 0)
    with SyncCounter() as counter:
        for _ in range(5):  # logging and non-logging steps
            nn.functional.cross_entropy(compiled(x).float(), y).backward()
    assert counter.calls == []
    with SyncCounter() as counter:
        history = monitor.history
    assert counter.calls == ["tolist"]  # one transfer for the three pending logging steps
    assert history.steps == [0, 2, 4]


def test_sync_counter_sees_the_read() -> None:
    """The counter is not blind to the monitor's read."""
    with SyncCounter() as counter:
        measure(torch.randn(4), BF16).tolist()
    assert counter.calls == ["tolist"]


# ---- models as people write them ------------------------------------------------------------


class CheckpointedGPT(GPT):
    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(self.ln_f(x))


def test_checkpointed_blocks_are_measured_once() -> None:
    """A checkpoint region runs its forward again in backward: counted once, as without."""
    idx = torch.randint(0, 64, (2, 32))
    results = []
    for cls in (GPT, CheckpointedGPT):
        torch.manual_seed(0)
        compiled = amp_graph.compile(cls(), policy="O1", dtype=BF16)
        monitor = amp_graph.monitor(compiled, every=1)
        compiled(idx).float().square().mean().backward()
        rows = monitor.history.rows
        results.append(sorted((r["role"], r["numel"], r["amax"]) for r in rows))
    assert any(n.startswith("checkpoint_") for n, _ in compiled.graph_module.named_children())
    assert results[0] == results[1]


def test_hf_gpt2_mlp_selected_by_module_glob() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32, attn_implementation="eager"
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    compiled = amp_graph.compile(model, policy="O1", dtype=BF16)
    monitor = amp_graph.monitor(compiled, every=1, nodes={"modules": ["transformer.h.*.mlp.c_*"]})
    ids = torch.randint(0, 64, (2, 16))
    compiled(ids, labels=ids, use_cache=False).loss.backward()
    modules = {r["module"] for r in monitor.history}
    assert modules == {f"transformer.h.{i}.mlp.{m}" for i in (0, 1) for m in ("c_fc", "c_proj")}
    # HF's Conv1D is addmm: its bias operand (self) is not measured
    assert {r["role"] for r in monitor.history if not r["backward"]} == {
        "input",
        "mat1",
        "mat2",
        "output",
    }


def test_selection_by_op_type_and_node_name() -> None:
    model = GPT()
    idx = torch.randint(0, 64, (2, 32))
    cases = {
        "ops": ({"ops": ["scaled_dot_product_attention"]}, {"blocks.0.attn", "blocks.1.attn"}),
        "module_types": (
            {"module_types": [nn.LayerNorm]},
            {"blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "ln_f"},
        ),
        "nodes": ({"nodes": ["linear_12"]}, {"head"}),
    }
    for nodes, modules in cases.values():
        compiled = amp_graph.compile(model, policy="O1", dtype=BF16)
        monitor = amp_graph.monitor(compiled, every=1, nodes=nodes)
        compiled(idx).float().mean().backward()
        assert {r["module"] for r in monitor.history} == modules, nodes


def test_stats_choose_columns() -> None:
    compiled = amp_graph.compile(ConvNet(channels=8), policy="O1", dtype=BF16)
    monitor = amp_graph.monitor(compiled, every=1, stats=["amax", "nonfinite"])
    compiled(torch.randn(2, 1, 8, 8)).sum().backward()
    history = monitor.history
    assert history.stats == ("amax", "nonfinite")
    assert set(history[0]) == {*history.columns}
    assert "underflow" not in history.columns


# ---- Graph -----------------------------------------------------------------------------------


class TrainStep(amp_graph.Graph):
    def __init__(
        self, model, opt, *, policy="O1", dtype=FP16, accumulation=1, scaler=False, compile=False
    ):
        super().__init__()
        self.model = model
        self.add_optimizer(opt)
        self.config.enable_amp(True, policy=policy, dtype=dtype)
        if scaler:
            self.set_grad_scaler(amp_graph.GradScaler(init_scale=2.0**10))
        if accumulation > 1:
            self.config.set_gradient_accumulation_steps(accumulation)
        if compile:
            self.config.enable_compile(backend="aot_eager")

    def build(self, x, y):
        loss = nn.functional.cross_entropy(self.model(x).float(), y)
        loss.backward()
        return loss


GRAPH_CASES = {
    "O1 fp16 scaled": {"policy": "O1", "dtype": FP16, "scaler": True},
    "O2 bf16": {"policy": "O2", "dtype": BF16},
    "fp8": {"policy": "fp8", "dtype": BF16},
    "accumulation 4": {"policy": "O1", "dtype": BF16, "accumulation": 4},
    "compiled": {"policy": "O1", "dtype": BF16, "compile": True},
}


@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_graph_monitor_measures_and_trains_the_same(case) -> None:
    options = GRAPH_CASES[case]
    data = [(torch.randn(8, 32), torch.randint(0, 10, (8,))) for _ in range(3)]
    runs = []
    for monitored in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
        graph = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), **options)
        monitor = graph.config.enable_monitor(every=2) if monitored else None
        losses = torch.stack([graph(x, y) for x, y in data])
        runs.append((losses, [p.detach().clone() for p in model.parameters()], monitor))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))
    history = runs[1][2].history
    assert history.steps == [0, 2]
    if options.get("scaler"):  # the Graph's own scaler: init_scale, no overflow yet
        assert {r["loss_scale"] for r in history} == {2.0**10}
    else:
        assert {r["loss_scale"] for r in history} == {None}
    roles = {r["role"] for r in history}
    assert {"input", "weight", "output", "grad_output", "grad_weight"} <= roles
    first = next(
        r for r in history.where(step=0, role="output") if r["op"] in ("aten.linear", "fp8 linear")
    )
    assert first["numel"] == 8 * 64  # the whole batch, over its micro-batches
    step0 = history.where(step=0).rows
    assert len({(r["node"], r["role"]) for r in step0}) == len(step0)  # one row per step


def test_graph_monitor_is_the_same_through_amp_graph_monitor() -> None:
    model = nn.Sequential(nn.Linear(8, 8))
    graph = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=BF16)
    monitor = amp_graph.monitor(graph, every=1, nodes={"ops": ["linear"]})
    assert graph.config.monitor is monitor
    graph(torch.randn(4, 8), torch.randint(0, 8, (4,)))
    assert {r["role"] for r in monitor.history} >= {"input", "grad_weight"}
    monitor.detach()
    assert graph.config.monitor is None


# ---- files ------------------------------------------------------------------------------------


def test_log_dir_jsonl_csv_and_tensorboard(tmp_path) -> None:
    compiled = amp_graph.compile(ConvNet(channels=8), policy="O1", dtype=BF16)
    monitor = amp_graph.monitor(compiled, every=2, log_dir=tmp_path)
    x = torch.randn(2, 1, 8, 8)
    for _ in range(4):
        compiled(x).sum().backward()
    # steps 0 and 2 were read at the start of steps 1 and 3, without the user asking
    lines = (tmp_path / "monitor.jsonl").read_text().splitlines()
    assert {json.loads(line)["step"] for line in lines} == {0, 2}
    monitor.close()
    assert [json.loads(line) for line in lines] == monitor.history.rows
    csv_lines = (tmp_path / "monitor.csv").read_text().splitlines()
    assert csv_lines[0].split(",") == list(monitor.history.columns)
    assert len(csv_lines) == len(lines) + 1
    events = list(tmp_path.glob("events.out.tfevents.*"))
    assert events, "tensorboard is in the dev extra: the scalars are written"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(str(tmp_path)).Reload().Tags()["scalars"]
    assert "conv2d.output/underflow" in scalars


def test_import_amp_graph_imports_no_tensorboard() -> None:
    code = "import sys, amp_graph; assert 'tensorboard' not in sys.modules, 'imported tensorboard'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- bad input ---------------------------------------------------------------------------------


def test_bad_arguments_get_specific_errors() -> None:
    compiled = amp_graph.compile(ConvNet(channels=8), policy="O1", dtype=BF16)
    with pytest.raises(ValueError, match="every= is an int >= 1"):
        amp_graph.monitor(compiled, every=0)
    with pytest.raises(ValueError, match=r"no selector 'module'.*'modules'"):
        amp_graph.monitor(compiled, nodes={"module": ["stem"]})
    with pytest.raises(TypeError, match="list of selectors"):
        amp_graph.monitor(compiled, nodes={"modules": "stem"})
    with pytest.raises(ValueError, match=r"no statistic 'underflows'.*'underflow'"):
        amp_graph.monitor(compiled, stats=["underflows"])
    with pytest.raises(ValueError, match=r"unknown op name 'linaer'.*'linear'"):
        amp_graph.monitor(compiled, nodes={"ops": ["linaer"]})
    with pytest.raises(TypeError, match=r"amp_graph\.compile"):
        amp_graph.monitor(ConvNet())
    monitor = amp_graph.monitor(compiled, nodes={"modules": ["block9"]})
    with pytest.raises(ValueError, match="'block9' matches no module"):
        compiled(torch.randn(2, 1, 8, 8))
    monitor.detach()
    amp_graph.monitor(compiled)
    with pytest.raises(ValueError, match="already has a monitor"):
        amp_graph.monitor(compiled)


class WideLinear(nn.Linear):
    """A subclass: a module type selector matches exact types, as a policy's does."""


SELECTS_NOTHING = {
    "a module type": (
        {"module_types": [nn.Conv2d]},
        r"nodes=\{'module_types': \[nn\.Conv2d\]\} selects no op of this graph\. "
        r"Its modules' types .*nn\.LayerNorm, nn\.Linear",
    ),
    "a subclass": (
        {"module_types": [nn.LayerNorm, WideLinear]},
        r"WideLinear\]\} selects no op of this graph\. Did you mean 'nn\.Linear'\?",
    ),
    "an op": ({"ops": ["softmax"]}, r"\['softmax'\]\} selects no op.*Its ops: .*aten\.linear"),
}


@pytest.mark.parametrize(("nodes", "message"), SELECTS_NOTHING.values(), ids=SELECTS_NOTHING.keys())
def test_a_selector_that_selects_nothing_is_an_error_at_the_first_call(nodes, message) -> None:
    compiled = amp_graph.compile(GPT(), policy="O1", dtype=BF16)
    amp_graph.monitor(compiled, every=1, nodes=nodes)
    with pytest.raises(ValueError, match=message):
        compiled(torch.randint(0, 64, (2, 8)))


def test_docstring_example_runs() -> None:
    import doctest

    import amp_graph.monitoring
    import amp_graph.ops.cpu_extension

    for module in (amp_graph.monitoring, amp_graph.ops.cpu_extension):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, (module.__name__, result)


# ---- the heatmap ------------------------------------------------------------------------------


def test_heatmap_names_rows_with_dtypes_and_has_a_legend() -> None:
    from amp_graph.monitoring.plot import matrix

    torch.manual_seed(0)
    model = GPT()
    with torch.no_grad():
        model.blocks[1].fc.weight.mul_(1e-5)  # a weight that float16 flushes to zero
    compiled = amp_graph.compile(model, policy="O1", dtype=FP16)
    monitor = amp_graph.monitor(compiled, every=2)
    for _ in range(4):
        compiled(torch.randint(0, 64, (2, 32))).float().square().mean().backward()
    labels, steps, values = matrix(monitor.history, "fp16_underflow", "module")
    assert steps == [0, 2]
    worst = max(range(len(labels)), key=lambda i: values[i][0])
    assert labels[worst] == "blocks.1.fc · weight (fp32 in fp16)"
    drawing = monitor.plot("fp16_underflow", by="module")
    assert drawing.rows == labels and drawing.steps == steps
    svg = drawing.text
    for text in ("logging step", "legend (log scale)", "module · role (dtype)", "blocks.1.fc"):
        assert text in svg, text
    assert svg.count("<rect") == len(labels) * len(steps) + 20 + 2  # cells, ramp, 0 and blank
    by_node = monitor.plot("amax")
    assert len(by_node.rows) == len(monitor.probes)
    with pytest.raises(ValueError, match="no statistic"):
        monitor.plot("underflows")
    with pytest.raises(ValueError, match="by="):
        monitor.plot(by="layer")
