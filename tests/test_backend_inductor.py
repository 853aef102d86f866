"""The backend with inductor: the name "amp_graph" resolves with no import, and training
through inductor matches torch.compile(model) run under torch.autocast. Slow (inductor
compiles C++ on CPU), so the structural tests use other inner backends."""

from __future__ import annotations

import copy
import dataclasses
import re
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from amp_graph.demo import models
from amp_graph.frontends.dynamo_backend import backend, captured_graphs
from amp_graph.policy import Policy

BF16 = torch.bfloat16


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


FRESH_INTERPRETER = textwrap.dedent("""
    import sys
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(8, 16)
    compiled = torch.compile(model, backend="amp_graph")
    out = compiled(x)
    out.float().square().mean().backward()
    assert "amp_graph" in sys.modules, "dynamo loaded the entry point"

    from amp_graph.frontends.dynamo_backend import captured_graphs
    [gm] = captured_graphs(compiled)
    record = gm.meta["amp_graph"]
    assert (record.policy.name, record.dtype, record.device_type) == ("O1", torch.bfloat16, "cpu")
    assert out.dtype == torch.bfloat16
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    with torch.autocast("cpu", torch.bfloat16):
        expected = model(x)
    torch.testing.assert_close(out, expected)
    print("ok")
""")


def test_backend_name_works_in_a_fresh_interpreter_without_import():
    """torch.compile(backend="amp_graph") right after pip install: dynamo finds the
    torch_dynamo_backends entry point; the default is O1, bf16 on CPU, inductor."""
    done = subprocess.run(
        [sys.executable, "-c", FRESH_INTERPRETER],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_inductor_training_matches_torch_compile_under_autocast():
    """Two AdamW steps of a GPT with its loss, compiled by inductor both ways: the same
    dtypes give the same losses, gradients and parameters."""
    torch.manual_seed(0)
    model = models.GPTWithLoss(layers=1)
    reference = copy.deepcopy(model)
    ours = torch.compile(model, backend=backend(policy="autocast"))
    theirs = torch.compile(reference)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference))
    for step in range(2):
        idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
        targets = torch.roll(idx, -1, dims=1)
        loss = ours(idx, targets)
        with torch.autocast("cpu", BF16):
            ref_loss = theirs(idx, targets)
        loss.backward()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-3)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert p.grad.dtype == torch.float32
            torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=1e-3)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    [gm] = captured_graphs(ours)
    assert gm.meta["amp_graph"].exact
    assert any(n.meta["amp"].compute_dtype == BF16 for n in gm.graph.nodes)


def _kernels(step) -> tuple[list[str], Counter]:
    """The fused kernels inductor generates for ``step``'s graphs (named by what they fuse,
    the numbering dropped) and its calls of extern kernels, compiled afresh."""
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    with config.patch(fx_graph_cache=False):
        _, codes = run_and_get_code(step)
    code = "\n".join(codes)
    fused = sorted(
        re.sub(r"_\d+$", "", name) for name in re.findall(r"^(cpp_fused_\w+) = ", code, re.M)
    )
    return fused, Counter(re.findall(r"extern_kernels\.(\w+)\(", code))


def _gpt_under_torch_compile() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, Callable]:
    """A one-layer GPT, a batch, and the reference step: torch.compile(model) under
    torch.autocast, forward and backward."""
    model = models.GPTWithLoss(layers=1)
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(idx, -1, dims=1)

    def theirs() -> None:
        with torch.autocast("cpu", BF16):
            loss = torch.compile(model)(idx, targets)
        loss.backward()

    return model, idx, targets, theirs


def test_the_backend_generates_torch_compiles_kernels_one_for_one():
    """Under torch.autocast's own op lists, the backend hands inductor a graph from which it
    generates the kernels torch.compile generates for the model under torch.autocast, in
    the forward and in the backward: the recompute's default leaves what backward keeps to
    the partitioner. Tagging every cast for recompute (True) changes them (standalone casts in
    the backward, other fusions in the forward)."""
    model, idx, targets, theirs = _gpt_under_torch_compile()

    def ours(recompute: bool | str) -> None:
        policy = dataclasses.replace(Policy.preset("autocast"), recompute_casts=recompute)
        torch.compile(model, backend=backend(policy=policy))(idx, targets).backward()

    reference = _kernels(theirs)
    torch._dynamo.reset()
    assert _kernels(lambda: ours("auto")) == reference
    torch._dynamo.reset()
    tagged, extern = _kernels(lambda: ours(True))
    assert extern == reference[1] and tagged != reference[0]  # the casts fuse elsewhere


def test_a_compiled_graph_step_generates_torch_compiles_kernels_one_for_one():
    """``Graph`` with ``config.enable_compile()`` hands inductor the same forward and backward
    as the backend does: its kernels are torch.compile's under torch.autocast, one for one
    (what the GPU's MFU target then rests on: the step's compiled part is torch's own)."""
    from amp_graph import Graph

    model, idx, targets, theirs = _gpt_under_torch_compile()

    class Step(Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
            self.config.enable_amp(True, policy="autocast", dtype=BF16)
            self.config.enable_compile()

        def build(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = self.model(idx, targets)
            loss.backward()
            return loss

    reference = _kernels(theirs)
    torch._dynamo.reset()
    step = Step()
    fused, extern = _kernels(lambda: step(idx, targets))
    assert fused and (fused, extern) == reference
