"""benchmarks/fp8_step.py, fp8 against bf16 and torchao on a Llama-style stack, checked on the
CPU: its variants share one model's weights, its FLOP count is torch's, and its loss check
tells a working fp8 from a broken one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fp8_step  # noqa: E402

from amp_graph.demo import models  # noqa: E402


def test_the_flop_count_is_what_torchs_counter_counts() -> None:
    config, (batch, seq) = fp8_step.TINY, fp8_step.TINY_TOKENS
    model = models.LlamaWithLoss(**config)
    idx = torch.randint(0, config["vocab"], (batch, seq))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(idx, idx).backward()
    assert fp8_step.step_flops(config, batch, seq) == counter.get_total_flops()


def test_every_variant_trains_the_same_parameters() -> None:
    """fp8 and compiled modules hold the model's own nn.Parameters: one optimizer steps all."""
    model = models.LlamaWithLoss(**fp8_step.TINY)
    ours = {id(p) for p in model.parameters()}
    assert {id(p) for p in fp8_step.shared_copy(model).parameters()} == ours
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    idx = torch.randint(0, fp8_step.TINY["vocab"], fp8_step.TINY_TOKENS)
    for variant in fp8_step.VARIANTS:
        forward = fp8_step.forward_of(model, variant, "cpu", eager=True)
        before = model.head.weight.detach().clone(), model.tok.weight.detach().clone()
        fp8_step.train_step(forward, variant, opt, "cpu")(idx, idx)
        after = model.head.weight, model.tok.weight
        assert all(not torch.equal(b, a) for b, a in zip(before, after, strict=True)), variant
    converted = fp8_step.forward_of(model, "fp8 torchao tensorwise", "cpu", eager=True)
    assert type(converted.layers.blocks[0].mlp.up).__name__ == "Float8Linear"
    assert type(converted.head) is torch.nn.Linear  # the head stays bf16 in both recipes
    assert converted.layers.blocks[0].mlp.up.weight is model.layers.blocks[0].mlp.up.weight


def test_the_loss_check_tells_a_broken_fp8_from_a_working_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An fp8 forward whose weights get no gradient (a detached fp8 path, the failure a lost
    backward gives) learns nothing and falls outside bf16's noise; the real one is inside."""
    real = fp8_step.forward_of

    def forward_of(model, variant, device, eager):
        if variant != "fp8 amp_graph rowwise":
            return real(model, variant, device, eager)
        compiled = real(model, "fp8 amp_graph tensorwise", device, eager)
        return lambda idx, targets: compiled(idx, targets).detach().requires_grad_()

    monkeypatch.setattr(fp8_step, "forward_of", forward_of)
    variants = [fp8_step.BASELINE, "fp8 amp_graph tensorwise", "fp8 amp_graph rowwise"]
    result = fp8_step.loss_check(fp8_step.TINY, fp8_step.TINY_TOKENS, 80, variants, "cpu")
    final = result["final"]
    assert final["bf16"] < result["first"]["bf16"] - 1.0  # bf16 learns the bigrams
    assert result["within"] == {"fp8 amp_graph tensorwise": True, "fp8 amp_graph rowwise": False}
    assert result["allowed"] == max(result["spread"], result["standard_error"]) > 0


def test_a_cpu_run_reports_steps_and_loss(tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    variants = ["bf16 amp_graph", "fp8 amp_graph tensorwise"]
    argv = ["--device", "cpu", "--tiny", "--eager", "--repeats", "2", "--loss-steps", "30"]
    assert fp8_step.main([*argv, "--variants", *variants, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    steps = report["steps"]
    assert list(steps) == [fp8_step.BASELINE, *variants]  # the baseline always runs, first
    assert steps[fp8_step.BASELINE]["speedup_vs_bf16"] == 1.0
    for row in steps.values():
        assert row["ms"] > 0 and row["tflops"] > 0
        assert row["speedup_vs_bf16"] == pytest.approx(steps[fp8_step.BASELINE]["ms"] / row["ms"])
    assert report["loss"]["steps"] == 30 and set(report["loss"]["within"]) == {variants[1]}


def test_without_torchao_its_row_says_so_and_the_others_are_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails, as on a bare GPU box
    variants = [fp8_step.BASELINE, "fp8 torchao tensorwise"]
    rows = fp8_step.time_steps(fp8_step.TINY, (2, 16), variants, "cpu", True, repeats=2)
    assert rows["fp8 torchao tensorwise"]["error"].startswith("RuntimeError: torchao is not")
    assert rows[fp8_step.BASELINE]["ms"] > 0


def test_each_variant_is_kept_as_it_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run killed during a later compile keeps the earlier variants' figures: each is timed
    alone after its compile and handed on at once; interleaved rounds that fail leave those
    solo figures and say why in every row."""
    variants = [fp8_step.BASELINE, "bf16 amp_graph"]
    seen: list[list[str]] = []
    real = fp8_step.interleaved_seconds

    def failing_rounds(steps: dict, repeats: int, **kw: object) -> dict:
        if len(steps) > 1:  # the interleaved rounds, not a variant's solo timing
            raise RuntimeError("CUDA error: an illegal memory access")
        return real(steps, repeats, **kw)

    monkeypatch.setattr(fp8_step, "interleaved_seconds", failing_rounds)
    rows = fp8_step.time_steps(
        fp8_step.TINY, (2, 16), variants, "cpu", True, repeats=2,
        on_row=lambda rows: seen.append([v for v, row in rows.items() if row["solo_ms"] > 0]),
    )  # fmt: skip
    assert seen == [variants[:1], variants]
    for row in rows.values():
        assert row["solo_ms"] > 0 and "ms" not in row
        assert row["error"].startswith("interleaved rounds: RuntimeError: CUDA error")


def test_without_a_gpu_the_cuda_run_refuses(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fp8_step.main(["--device", "cuda"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
