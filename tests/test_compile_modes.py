"""``amp_graph.compile(model, policy, mode=...)``: torch.compile's modes over the rewritten
graphs (:mod:`amp_graph.frontends.compile_modes`), the default by device, the refusals, and
``Graph.config.enable_compile`` checked by the same rules.

Inductor compiles on the CPU here (a C++ compiler), so the ``"default"`` mode is run for real:
its outputs and gradients against the eager graph's (the same dtypes, fused) and against
torch.autocast's. The CUDA-graph modes are refused off CUDA; they run in ``pytest -m cuda``
(test_graphed_calls.py) and in ``benchmarks/compile_modes.py --device cuda``.
"""

from __future__ import annotations

import dataclasses
import pickle
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from amp_graph.passes import AMP, Role

import amp_graph
from amp_graph.demo import models
from amp_graph.frontends import compile_modes
from amp_graph.frontends.compile_modes import resolve_mode
from amp_graph.frontends.compiler import compile_record, compiled_in_place
from amp_graph.ops import recompute_ops
from amp_graph.ops.fp8_ops import fp8_matmul_error

BF16 = torch.bfloat16


class TinyLM(nn.Module):
    """An embedding, one pre-norm attention-free block and a tied head, with the loss: the
    shapes of a language model, small enough for inductor to compile in seconds."""

    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        x = x + self.down(F.gelu(self.up(self.norm(x))))
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batch(rows: int = 4, seq: int = 8, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(rows))
    return idx, torch.roll(idx, -1, dims=1)


def _loss_and_grads(forward, model: nn.Module, inputs: tuple) -> tuple[torch.Tensor, list]:
    model.zero_grad(set_to_none=True)
    loss = forward(*inputs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _casts(gm: torch.fx.GraphModule) -> int:
    return sum(n.meta[AMP].role is Role.CAST for n in gm.graph.nodes)


# ---- names, defaults and refusals (no compile) ------------------------------------------------


def test_the_default_mode_is_chosen_by_the_device() -> None:
    assert resolve_mode(None, None, "cpu").name == "eager"
    cuda = resolve_mode(None, None, "cuda")
    assert cuda.inductor and not cuda.cuda_graphs  # inductor, not a mode with output rules
    assert resolve_mode(None, None, "xpu").name == "eager"  # never measured: as before
    assert resolve_mode(None, None, "cuda", sharded=True).name == "eager"  # DTensor parameters
    with pytest.raises(ValueError, match="parameters are DTensors"):
        resolve_mode("default", None, "cpu", sharded=True)


def test_an_fsdp2_model_gets_the_eager_graph_and_no_inductor_mode() -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
        fully_shard(model)
        assert amp_graph.compile(model, "O1", BF16).mode.name == "eager"
        with pytest.raises(ValueError, match="mode='eager' \\(the default for such a model\\)"):
            amp_graph.compile(model, "O1", BF16, mode="default")
    finally:
        dist.destroy_process_group()


def test_a_cpu_compile_without_a_mode_runs_the_eager_graph() -> None:
    model = TinyLM()
    compiled = amp_graph.compile(model, "O1", BF16)
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled(*_batch()).backward()
    assert compiled.mode.name == "eager" and compiled._inductor is None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before  # dynamo never ran
    assert "mode='eager'" in repr(compiled)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mode": "defualt"}, ValueError, r"unknown compile mode 'defualt'.*mean 'default'"),
        ({"mode": 3}, TypeError, "mode is one of"),
        ({"mode": "reduce-overhead"}, amp_graph.CudaGraphError, "is for CUDA graphs.*on cpu"),
        ({"mode": "cudagraphs"}, amp_graph.CudaGraphError, "is for CUDA graphs.*on cpu"),
        ({"mode": "default", "cuda_graph": True}, ValueError, "asks for two modes"),
        ({"mode": "cudagraphs", "cuda_graph": False}, ValueError, "contradicts itself"),
    ],
)
def test_modes_are_refused_early_and_say_why(kwargs: dict, error: type, match: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(error, match=match):
            amp_graph.compile(TinyLM(), "O1", BF16, **kwargs)


def test_max_autotune_is_taken_on_the_cpu_where_it_only_autotunes() -> None:
    compiled = amp_graph.compile(TinyLM(), "O1", BF16, mode="max-autotune-no-cudagraphs")
    assert compiled.mode.inductor and not compiled.mode.cuda_graphs
    assert amp_graph.compile(TinyLM(), "O1", BF16, mode="max-autotune").mode.inductor


def test_graph_enable_compile_checks_its_mode_by_the_same_rules() -> None:
    config = amp_graph.Graph().config
    with pytest.raises(ValueError, match=r"enable_compile: unknown torch.compile mode 'eager'"):
        config.enable_compile(mode="eager")
    with pytest.raises(ValueError, match="Did you mean 'max-autotune'"):
        config.enable_compile(mode="max-autotun")
    config.enable_compile(mode="max-autotune-no-cudagraphs")
    assert config.compile_options == {"mode": "max-autotune-no-cudagraphs"}


def test_a_cpu_graph_under_reduce_overhead_is_refused_at_its_first_call() -> None:
    class Train(amp_graph.Graph):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
            self.config.enable_amp(True)
            self.config.enable_compile(mode="reduce-overhead")

        def build(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = self.model(idx, targets)
            loss.backward()
            return loss

    model = TinyLM()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(amp_graph.CudaGraphError, match="enable_compile: mode 'reduce-overhead'"):
        Train(model)(*_batch())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


# ---- inductor on the CPU ----------------------------------------------------------------------


def test_the_default_mode_compiles_each_graph_with_inductor_and_matches_the_eager_graph() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    eager = amp_graph.compile(model, "O1", BF16, mode="eager")
    inductor = amp_graph.compile(model, "O1", BF16, mode="default")
    inputs = _batch()
    eager_loss, eager_grads = _loss_and_grads(eager, model, inputs)
    loss, grads = _loss_and_grads(inductor, model, inputs)
    assert len(inductor._inductor) == 1  # compiled, and the eager graph kept to print
    assert loss.dtype == torch.float32 and loss.grad_fn is None  # detached in the helper
    # the same dtypes, fused: inductor keeps intermediates in float32 inside a kernel
    torch.testing.assert_close(loss, eager_loss, rtol=1e-2, atol=1e-2)
    for got, want in zip(grads, eager_grads, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-3)
    # and torch.autocast, the oracle, agrees to bf16's resolution
    with torch.autocast("cpu", dtype=BF16):
        reference, reference_grads = _loss_and_grads(model, model, inputs)
    torch.testing.assert_close(loss, reference, rtol=1e-2, atol=1e-2)
    for got, want in zip(grads, reference_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-3)
    # the graph users print is the rewritten one, with its casts, in every mode
    casts = [_casts(c.graph_module) for c in (eager, inductor)]
    assert casts[0] == casts[1] > 0

    # new sizes: a second capture (symbolic sizes), compiled too
    _loss_and_grads(inductor, model, _batch(rows=6, seq=5))
    assert len(inductor.graph_modules) == 2 and len(inductor._inductor) == 2


def test_a_graph_captured_for_every_size_is_compiled_for_every_size(fresh_dynamo) -> None:
    """The second size gets a capture with symbolic sizes; inductor compiles it once for all
    sizes (specialized to the size it first ran with, a third size compiled it again)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    compiled = amp_graph.compile(model, "O1", BF16, mode="default")
    eager = amp_graph.compile(model, "O1", BF16, mode="eager")
    counters.clear()
    for rows in (2, 3, 4, 5):
        x = torch.randn(rows, 8)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), eager(x), rtol=1e-2, atol=1e-2)
    assert len(compiled.graph_modules) == 2  # one static capture, one symbolic
    assert counters["stats"]["unique_graphs"] == 2  # each compiled once


def test_graph_enable_compile_compiles_a_step_captured_for_every_size_once(fresh_dynamo) -> None:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))

    class Step(amp_graph.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.config.enable_amp(True, dtype=BF16)
            self.config.enable_compile()
            self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))

        def build(self, x):
            loss = self.model(x).float().pow(2).mean()
            loss.backward()
            return loss

    step = Step()
    counters.clear()
    losses = [step(torch.randn(rows, 8)) for rows in (2, 3, 4, 5)]
    assert all(torch.isfinite(loss) for loss in losses)
    assert counters["stats"]["unique_graphs"] == 2  # the first size's step, then every size


def test_inductor_modes_leave_the_recompute_to_the_partitioner() -> None:
    """The eager graph recomputes casts through saved-tensor hooks; a graph inductor compiles
    must carry none (dynamo would trace Python hooks around the forward), and gets the
    recompute's decision as checkpoint tags instead, where one is asked for: under "auto"
    the partitioner decides, and no cast is tagged."""
    model = models.GPTWithLoss(vocab=64, block=8, dim=32, heads=2, layers=1)
    inputs = _batch()
    policy = dataclasses.replace(amp_graph.Policy.preset("O1"), recompute_casts=True)
    eager = amp_graph.compile(model, policy, BF16, mode="eager", example_inputs=inputs)
    inductor = amp_graph.compile(model, policy, BF16, mode="default", example_inputs=inputs)
    recomputed = compile_record(eager).stats.get("casts_recomputed", 0)
    assert recomputed > 0
    assert recompute_ops._HANDLES in eager.graph_module.__dict__
    assert recompute_ops._HANDLES not in inductor.graph_module.__dict__
    tagged = [n for n in inductor.graph.nodes if n.meta.get("recompute") is not None]
    assert len(tagged) >= recomputed
    inductor(*inputs).backward()  # and it trains
    assert all(p.grad is not None for p in model.parameters())
    auto = amp_graph.compile(model, "O1", BF16, mode="default", example_inputs=inputs)
    assert compile_record(auto).stats["casts_recomputed"] == 0
    assert not [n for n in auto.graph.nodes if n.meta.get("recompute") is not None]


def test_a_monitor_logging_step_runs_the_eager_graph_in_an_inductor_mode() -> None:
    model = TinyLM()
    compiled = amp_graph.compile(model, "O1", BF16, mode="default")
    monitor = amp_graph.monitor(compiled, every=2)
    for _ in range(3):  # logging, compiled, logging
        compiled(*_batch()).backward()
    assert len(compiled._inductor) == 1
    assert monitor.history.steps == [0, 2]


def test_the_mode_survives_pickling_and_compile_in_place_takes_it() -> None:
    compiled = amp_graph.compile(TinyLM(), "O1", BF16, mode="max-autotune-no-cudagraphs")
    loaded = pickle.loads(pickle.dumps(compiled))
    assert loaded.mode == compiled.mode and len(loaded._inductor) == 0
    model = amp_graph.compile_(TinyLM(), "O1", BF16, mode="default")
    assert compiled_in_place(model).mode.name == "default"
    amp_graph.uncompile(model)


def test_every_mode_is_documented() -> None:
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "compile.md").read_text()
    for mode in compile_modes.MODES:
        assert f'`"{mode}"`' in text, mode


@pytest.mark.skipif(fp8_matmul_error("cpu") is not None, reason="no fp8 matmul on this CPU")
def test_the_fp8_policy_runs_through_inductor() -> None:
    """The fp8 policy's graph under mode="default": inductor fuses the amax, scale and cast
    (decomposable ops) around the float8 linears (custom ops it calls). Its error against
    float32 is the eager fp8 graph's, within float8's resolution."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 64))
    x = torch.randn(32, 64)
    reference = model(x).detach()
    errors = {}
    for mode in ("eager", "default"):
        compiled = amp_graph.compile(model, "fp8", mode=mode)
        model.zero_grad(set_to_none=True)
        out = compiled(x)
        out.float().square().mean().backward()
        assert out.dtype == torch.bfloat16
        assert all(torch.isfinite(p.grad).all() and p.grad.dtype == torch.float32
                   for p in model.parameters())  # fmt: skip
        errors[mode] = ((out.float() - reference).norm() / reference.norm()).item()
        assert len(amp_graph.report(compiled).fp8_gemms) == 2
    assert compiled._inductor is not None and len(compiled._inductor) == 1
    assert errors["default"] < 0.1 and errors["eager"] < 0.1, errors
