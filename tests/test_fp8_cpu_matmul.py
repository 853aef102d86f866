"""The CPU's float8 matmul where torch's is slow (issue 39, part 4): the emulation amp_graph
uses instead computes torch's CPU result bit for bit, the choice is made once per process and
said once, and fp8 linears give the same bits either way.

Where torch's CPU ``_scaled_mm`` is oneDNN's (AMX Xeons), its reference kernel accumulates
in its own order: there the emulation is compared within one bfloat16 rounding, and the test
says so; everywhere else it is compared bit for bit.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from dispatch_helpers import CountOps

from amp_graph.ops import fp8_cpu_matmul as cpu_matmul
from amp_graph.ops.fp8_ops import linear

E4M3 = torch.float8_e4m3fn


def _onednn_fp8() -> bool:
    """torch sends CPU float8 matmuls to oneDNN on CPUs with AMX."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_int8" in flags or "amx_bf16" in flags


def _same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    if _onednn_fp8():  # oneDNN's reference kernel: its own accumulation order
        torch.testing.assert_close(ours, theirs, rtol=2**-7, atol=1e-6)
    else:
        assert torch.equal(ours, theirs), (ours.float() - theirs.float()).abs().max()


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no bias", "bias"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_the_emulation_is_torchs_cpu_scaled_mm(rowwise, with_bias, out_dtype):
    gen = torch.Generator().manual_seed(0)
    m, k, n = 48, 64, 80
    a = (torch.randn(m, k, generator=gen) * 30).to(E4M3)
    b = (torch.randn(n, k, generator=gen) * 0.01).to(E4M3).t()
    if rowwise:
        scale_a = torch.rand(m, 1, generator=gen) + 0.1
        scale_b = torch.rand(1, n, generator=gen) * 7 + 0.1
    else:
        scale_a, scale_b = torch.tensor(0.0371), torch.tensor(113.7)
    bias = torch.randn(n, generator=gen).to(out_dtype) if with_bias and not rowwise else None
    theirs = torch._scaled_mm(
        a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype
    )
    ours = cpu_matmul.emulated_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)
    assert ours.dtype == theirs.dtype == out_dtype
    _same(ours, theirs)


@pytest.fixture
def fresh_probe():
    cpu_matmul.cpu_scaled_mm_is_slow.cache_clear()
    yield
    cpu_matmul.cpu_scaled_mm_is_slow.cache_clear()


def test_the_probe_decides_once_and_warns_once_when_slow(fresh_probe, monkeypatch):
    monkeypatch.setattr(cpu_matmul, "SLOWER", 0.0)  # any kernel counts as slow
    with pytest.warns(UserWarning, match=r"torch\._scaled_mm on this CPU took .* ms"):
        assert cpu_matmul.cpu_scaled_mm_is_slow()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_matmul.cpu_scaled_mm_is_slow()  # cached: no second probe, no warning
    cpu_matmul.cpu_scaled_mm_is_slow.cache_clear()
    monkeypatch.setattr(cpu_matmul, "SLOWER", float("inf"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cpu_matmul.cpu_scaled_mm_is_slow()


def test_the_probe_makes_no_tensor_in_the_callers_mode(fresh_probe, monkeypatch):
    """The first fp8 linear may run the probe while a trace is on (inductor compiling its
    backward, under a fake-tensor mode): every tensor the probe times must be real, made with
    the caller's modes off. On torch 2.11 a random generator made there failed the compile."""
    monkeypatch.setattr(cpu_matmul, "SLOWER", 0.0)  # any kernel that ran counts as slow
    with CountOps() as seen, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cpu_matmul.cpu_scaled_mm_is_slow()
    assert not seen.ops, seen.ops


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_an_fp8_linear_gives_the_same_result_on_either_path(fresh_probe, monkeypatch, recipe):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, 32, generator=gen, requires_grad=True)
    weight = torch.randn(48, 32, generator=gen, requires_grad=True)
    bias = torch.randn(48, generator=gen, requires_grad=True)
    results = []
    for slow in (False, True):
        monkeypatch.setattr(cpu_matmul, "SLOWER", float("inf") if not slow else 0.0)
        cpu_matmul.cpu_scaled_mm_is_slow.cache_clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert cpu_matmul.cpu_scaled_mm_is_slow() is slow
        out = linear(x, weight, bias, recipe)
        out.float().square().sum().backward()
        results.append([out.detach(), x.grad.clone(), weight.grad.clone(), bias.grad.clone()])
        x.grad = weight.grad = bias.grad = None
    for torch_kernel, emulated in zip(*results, strict=True):
        _same(emulated, torch_kernel)
