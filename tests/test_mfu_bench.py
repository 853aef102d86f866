"""benchmarks/mfu.py, GPT-2 small's step as a share of the bf16 peak, checked on the CPU: its
FLOP count against torch's own counter, the peaks it divides by, and the batch it reports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import mfu  # noqa: E402


@pytest.mark.parametrize(
    "config",
    [mfu.TINY, {"vocab": 1000, "block": 128, "dim": 96, "heads": 4, "layers": 3}],
    ids=["tiny", "wider"],
)
def test_the_flop_count_is_what_torchs_counter_counts(config: dict[str, int]) -> None:
    """nanoGPT's ``6 N + 12 L d T`` per token against FlopCounterMode on one real step: equal
    but for the biases and norms that 6 N counts as matmul weights (under 2%)."""
    setup = mfu.gpt_setup(config, batch=3, device="cpu")
    formula, counted = mfu.step_flops(setup.model, 3), mfu.counted_flops(setup)
    assert counted > 0
    assert 1.0 <= formula / counted < 1.02


def test_the_count_of_gpt2_small_is_its_known_size() -> None:
    """GPT-2 small's 124M parameters (less the 0.79M position embedding), 1024 tokens: about
    0.88 GFLOP per token, a figure one can check by hand (6 x 123.6M + 12 x 12 x 768 x 1024)."""
    model = mfu.models.GPTWithLoss(**mfu.GPT2_SMALL)
    params = sum(p.numel() for p in model.parameters())
    assert 124.0e6 < params < 124.5e6
    per_token = mfu.step_flops(model, 1) / 1024
    assert per_token == 6 * (params - 1024 * 768) + 12 * 12 * 768 * 1024


def test_the_peak_comes_from_the_devices_name() -> None:
    assert mfu.spec_peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert mfu.spec_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert mfu.spec_peak_tflops("NVIDIA H200") == 989.4
    assert mfu.spec_peak_tflops("NVIDIA GeForce RTX 4090") is None


def test_the_smallest_batch_at_the_target_is_ours_not_the_references() -> None:
    rows = [
        {"batch": 8, "variant": mfu.AMP_GRAPH, "mfu_spec": 0.30},
        {"batch": 8, "variant": mfu.REFERENCE, "mfu_spec": 0.45},
        {"batch": 32, "variant": mfu.AMP_GRAPH, "mfu_spec": 0.44},
        {"batch": 16, "variant": mfu.AMP_GRAPH, "mfu_spec": 0.41},
        {"batch": 4, "variant": mfu.AMP_GRAPH, "error": "OutOfMemoryError"},
    ]
    assert mfu.smallest_at_target(rows, 0.40, "mfu_spec")["batch"] == 16
    assert mfu.smallest_at_target(rows, 0.50, "mfu_spec") is None


def test_a_cpu_run_reports_each_batch_with_its_flops(tmp_path: Path) -> None:
    out = tmp_path / "mfu.json"
    argv = ["--device", "cpu", "--tiny", "--batches", "2", "1", "--repeats", "2", "--all"]
    code = mfu.main([*argv, "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert [row["batch"] for row in report["rows"]] == [1, 2]  # ascending
    assert report["peak_tflops"]["spec"] is None  # no datasheet for a CPU
    for row in report["rows"]:
        assert row["variant"] == "Graph O1"
        tflops = row["step_tflop"] / (row["ms"] / 1e3)
        assert row["tflops"] == pytest.approx(tflops)
        assert row["mfu_matmul"] == pytest.approx(tflops / report["peak_tflops"]["matmul"])
    assert report["rows"][1]["step_tflop"] == pytest.approx(2 * report["rows"][0]["step_tflop"])


def test_without_a_gpu_the_cuda_run_refuses(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mfu.torch.cuda, "is_available", lambda: False)
    assert mfu.main(["--device", "cuda"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_a_padded_head_is_trained_on_the_real_vocabulary() -> None:
    """llm.c's padding: the head has more rows than there are tokens, and the batch's ids and
    targets stay below the vocabulary's size; the padding's FLOPs are counted as built."""
    padded = dict(mfu.TINY, vocab=mfu.TINY["vocab"] + 64)
    setup = mfu.gpt_setup(padded, batch=64, device="cpu", tokens=mfu.TINY["vocab"])
    assert setup.model.gpt.tok.weight.shape[0] == padded["vocab"]
    assert all(int(t.max()) < mfu.TINY["vocab"] for t in setup.inputs)
    unpadded = mfu.gpt_setup(mfu.TINY, batch=64, device="cpu")
    extra = 6 * 64 * mfu.TINY["dim"] * 64 * mfu.TINY["block"]  # 64 more rows, 6 FLOPs a weight
    assert mfu.step_flops(setup.model, 64) - mfu.step_flops(unpadded.model, 64) == extra
    assert mfu.PADDED_VOCAB % 64 == 0 and mfu.GPT2_SMALL["vocab"] <= mfu.PADDED_VOCAB


def test_a_head_smaller_than_the_vocabulary_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        mfu.main(["--device", "cpu", "--vocab", "50000"])
    assert "GPT-2's 50257 tokens need a row each" in capsys.readouterr().err
