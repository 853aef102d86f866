"""Fourier transforms stay float32 under O1, O2 and O3: no device has a bf16 kernel for them.

FNet mixes tokens with ``torch.fft.fftn(x).real``. torch raises "Unsupported dtype
BFloat16" for a bf16 FFT on the CPU and on CUDA, so a policy that runs one low fails at run
time (O2 and O3 by their low default; O1 and CUDA autocast by following a bf16 input).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import amp_graph
from tests.hf_configs import small_fnet_config
from tests.oracles import check_training_step

BF16 = torch.bfloat16
FOURIER = ("fft_",)


class FourierMixer(nn.Module):
    """FNet's block as its paper writes it: token mixing by a 2-D FFT's real part."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)  # low under every policy: the FFT reads a bf16 value
        x = self.norm1(x + torch.fft.fft2(x).real)
        x = self.norm2(x + self.ff(x))
        return self.head(x.mean(1))


def _hf_fnet():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.FNetModel(small_fnet_config()).eval()
    return model, (torch.randint(0, 100, (2, 16)),), lambda out: out.last_hidden_state


def _mixer():
    torch.manual_seed(0)
    return FourierMixer().eval(), (torch.randn(2, 10, 32),), lambda out: out


def _fourier_nodes(compiled) -> list:
    return [n for n in compiled.graph.nodes if str(n.target).startswith("aten.fft_")]


@pytest.mark.parametrize("policy", ["O1", "O2", "O3"])
@pytest.mark.parametrize("build", [_mixer, _hf_fnet], ids=["fourier_mixer", "hf_fnet"])
def test_the_transform_runs_in_float32_and_the_output_is_close(build, policy: str) -> None:
    model, inputs, output = build()
    with torch.no_grad():
        reference = output(model(*inputs)).float()
    compiled = amp_graph.compile(model, policy, BF16, check_each_pass=True)
    with torch.no_grad():
        out = output(compiled(*inputs)).float()
    nodes = _fourier_nodes(compiled)
    assert nodes
    for node in nodes:
        amp = node.meta["amp"]
        assert amp.compute_dtype == torch.float32, (node.name, amp.detail)
        assert "deny" in str(amp.rule)
    assert (out - reference).norm() / reference.norm() < 0.03
    lows = [n for n in compiled.graph.nodes if n.meta["amp"].compute_dtype == BF16]
    assert lows  # the rest of the model still runs low


def test_a_training_step_under_o2_has_float32_finite_gradients() -> None:
    model, inputs, _ = _mixer()
    check_training_step(model.train(), inputs, lambda out: out.float().square().mean(), "O2")


def test_autocast_policy_keeps_the_cpu_lists_as_they_are() -> None:
    """``"autocast"`` is the device's lists: on the CPU they keep the FFT float32 already."""
    model, inputs, _ = _mixer()
    compiled = amp_graph.compile(model, "autocast", BF16, example_inputs=inputs)
    with torch.autocast("cpu", BF16), torch.no_grad():
        expected = model(*inputs)
    with torch.no_grad():
        assert torch.equal(compiled(*inputs), expected)
    assert all(n.meta["amp"].compute_dtype == torch.float32 for n in _fourier_nodes(compiled))
