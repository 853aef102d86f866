"""amp_graph.export's calibration samples whose shapes the program would refuse: an early
error naming the sample, the input, its shape and the example's, before calibration runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.export import Dim

import amp_graph
from amp_graph.deploy import program as program_module

BF16 = torch.bfloat16
ROOT = Path(__file__).resolve().parents[1]


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).softmax(-1)


@pytest.fixture
def no_calibration(monkeypatch):
    """Calibration must not run: the samples are refused before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("calibration ran on samples the program would refuse")

    monkeypatch.setattr(program_module, "autopolicy", refuse)


CASES = {
    "another batch, static": (
        None,
        [(torch.randn(4, 16),), (torch.randn(3, 16),)],
        r"sample 1: x has shape \[3, 16\], but the program is exported for x of shape "
        r"\[4, 16\] \(the example inputs'\).*dynamic_shapes=\{'x': \{0: Dim\('x_0'\)\}\}",
    ),
    "another rank": (None, [(torch.randn(4, 16, 1),)], r"sample 0: x has shape \[4, 16, 1\]"),
    "a static size, batch dynamic": (
        {"x": {0: Dim("batch")}},
        [(torch.randn(7, 16),), (torch.randn(4, 12),)],
        r"sample 1: x has shape \[4, 12\].*dynamic_shapes aside.*\{1: Dim\('x_1'\)\}",
    ),
    "past the Dim's max": (
        ({0: Dim("batch", max=6)},),
        [(torch.randn(9, 16),)],
        r"sample 0: x has shape \[9, 16\].*widen the Dim's min/max in dynamic_shapes "
        r"\(dim 0: 0\.\.6\)",
    ),
}


@pytest.mark.parametrize(("shapes", "samples", "message"), CASES.values(), ids=CASES.keys())
def test_a_sample_of_a_shape_the_program_refuses_is_named_before_calibration(
    no_calibration, shapes, samples, message
):
    with pytest.raises(ValueError, match=message):
        amp_graph.export(
            Tagger(), (torch.randn(4, 16),), dtype=BF16, dynamic_shapes=shapes,
            calibration=samples,
        )  # fmt: skip


def test_samples_within_the_dynamic_shapes_are_calibrated_on():
    torch.manual_seed(0)
    samples = [(torch.randn(b, 16),) for b in (2, 5, 9)]
    program = amp_graph.export(
        Tagger(), (torch.randn(4, 16),), dtype=BF16,
        dynamic_shapes={"x": {0: Dim("batch", max=9)}}, calibration=samples,
    )  # fmt: skip
    assert amp_graph.export_info(program).calibration_error is not None


def test_a_sample_the_programs_guard_refuses_is_named():
    """What calibration_samples cannot know (a size the model's code fixes) is named too,
    never torch's bare ``AssertionError: Guard failed``."""
    model, x = Tagger(), torch.randn(4, 16)
    plain = amp_graph.export(model, (x,), dtype=BF16)
    info = amp_graph.export_info(plain)
    with pytest.raises(ValueError, match=r"sample 0 \(Tensor\[3, 16\] fp32\) is refused by"):
        program_module._check_calibrated(
            plain, model, [((torch.randn(3, 16),), {})], BF16, None, info
        )


def test_cli_export_names_a_sample_of_another_shape_before_any_work(tmp_path):
    samples = tmp_path / "samples.pt"
    torch.save([torch.randn(2, 3, 16, 16), torch.randn(5, 3, 16, 16)], samples)
    sample_model = str(ROOT / "tests" / "sample_model.py")
    done = subprocess.run(
        [sys.executable, "-m", "amp_graph", "export", f"{sample_model}:SmallNet",
         "--input-shape", "2,3,16,16", "--calibrate", str(samples), "-o",
         str(tmp_path / "m.pt2")],
        capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stdout == ""
    assert f"--calibrate {samples}: calibration sample 1: x has shape [5, 3, 16, 16]" in (
        done.stderr
    )
    assert "here, --dynamic-batch lets dimension 0 vary" in done.stderr
    assert not (tmp_path / "m.pt2").exists()


def test_the_saved_info_keeps_the_whole_policy_overrides_included(tmp_path):
    from amp_graph import deploy
    from amp_graph.policy.policy_data import policy_from_data

    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    policy = amp_graph.Policy.preset("O1").override(
        ops={"layer_norm": "low"}, modules={"2": "fp32"}, module_types={nn.LayerNorm: "low"}
    )
    program = amp_graph.export(model, (torch.randn(2, 8),), policy=policy, dtype=torch.bfloat16)
    info = deploy.load_info(deploy.save(program, tmp_path / "model.pt2", "pt2"))
    assert info["policy"] == policy.name == "O1+overrides"
    again = policy_from_data(info["policy_data"])
    assert (again.ops, again.modules, again.module_types) == (
        policy.ops,
        policy.modules,
        policy.module_types,
    )
    assert again.allow == policy.allow and again.default == policy.default
