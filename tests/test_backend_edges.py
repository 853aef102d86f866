"""The torch.compile backend at the edges of what dynamo hands it: activation checkpoints
(kept, recomputed, numerics of torch.autocast), and the places where dynamo runs code without
the backend, in float32, which the backend announces where it can see them coming: the
compile that reaches ``recompile_limit``, its own failure under ``suppress_errors``, and
torch's fused inference fast path. Inner backends are "eager"/"aot_eager" (fast)."""

from __future__ import annotations

import copy
import functools
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as ckpt
from amp_graph.passes.checkpoints import CHECKPOINT_PREFIX

import amp_graph

BF16 = torch.bfloat16

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Checkpointed(nn.Module):
    """A block run through ``torch.utils.checkpoint`` between two linears; its softmax is
    float32 under autocast, so the region holds casts too."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.fc2(h), -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = ckpt.checkpoint(self.block, self.fc1(x), use_reentrant=self.reentrant)
        return self.fc3(h)


def _saved(run: Callable[[], torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The tensors autograd saves while ``run`` computes, sorted (shapes and dtypes)."""
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sorted(saved, key=str)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_a_checkpoint_is_kept_and_computes_as_torch_autocast(inner: str, reentrant: bool) -> None:
    """Outputs and gradients equal eager torch.autocast's, bit for bit; the graph calls the
    block as a checkpoint; and the tensors saved for backward are those torch.compile saves
    with the same inner backend under torch.autocast (the block is recomputed)."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randn(64, 16)
    with torch.autocast("cpu", BF16):
        expected = model(x)
    expected.float().sum().backward()

    b = amp_graph.backend("autocast", BF16, inner=inner)
    compiled = torch.compile(ours, backend=b)
    got = compiled(x)
    got.float().sum().backward()
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    for (name, p), q in zip(ours.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    [gm] = amp_graph.captured_graphs(compiled)
    assert any(name.startswith(CHECKPOINT_PREFIX) for name, _ in gm.named_children())

    reference = torch.compile(theirs, backend=inner)
    with torch.autocast("cpu", BF16):
        reference(x)  # compile outside the count
        want = _saved(lambda: reference(x))
    assert _saved(lambda: compiled(x)) == want


def test_a_checkpoint_with_context_fn_is_refused_with_the_way_out() -> None:
    class Selective(Checkpointed):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            context = functools.partial(
                ckpt.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default]
            )
            h = ckpt.checkpoint(self.block, self.fc1(x), use_reentrant=False, context_fn=context)
            return self.fc3(h)

    compiled = torch.compile(Selective(False), backend=amp_graph.backend(inner="eager"))
    with pytest.raises(Exception, match=r"context_fn=.*amp_graph\.compile"):
        compiled(torch.randn(4, 16))


@contextmanager
def _recorded() -> Iterator[list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        messages: list[str] = []
        yield messages
        messages.extend(str(w.message) for w in caught if "amp_graph" in str(w.message))


def test_the_compile_that_reaches_the_recompile_limit_says_float32_follows() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Softmax(-1))
    compiled = torch.compile(model, backend=amp_graph.backend(inner="eager"), dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2):
        with _recorded() as first:
            compiled(torch.randn(1, 16))
        assert not first
        with _recorded() as second:
            compiled(torch.randn(2, 16))
        assert len(second) == 1
        assert "recompile_limit" in second[0] and "float32" in second[0]
        assert re.search(r"compiled '\w+' \(\S+:\d+\)", second[0])  # as dynamo names it
        assert "dynamic=True" in second[0] and "fail_on_recompile_limit_hit" in second[0]
        with _recorded() as third:
            out = compiled(torch.randn(3, 16))
        assert out.dtype == torch.float32 and not third  # what was announced
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            torch._dynamo.reset()
            with _recorded() as hard:
                compiled(torch.randn(1, 16))
                compiled(torch.randn(2, 16))
            assert not hard  # the next one raises: nothing to warn about


def _failing_inner(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
    raise RuntimeError("inner backend failed")


def test_a_failure_under_suppress_errors_says_the_frame_runs_in_float32() -> None:
    model = nn.Linear(16, 16)
    compiled = torch.compile(model, backend=amp_graph.backend(inner=_failing_inner))
    with torch._dynamo.config.patch(suppress_errors=True), _recorded() as messages:
        out = compiled(torch.randn(2, 16))
    assert out.dtype == torch.float32
    assert len(messages) == 1 and "suppress_errors" in messages[0] and "float32" in messages[0]
    with _recorded() as quiet, pytest.raises(Exception, match="inner backend failed"):
        torch._dynamo.reset()
        compiled(torch.randn(2, 16))
    assert not quiet  # without suppress_errors the error itself reaches the user


def _encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


def test_the_fused_transformer_fast_path_is_named_and_the_way_out_works() -> None:
    """In eval under no_grad dynamo traces torch's fused encoder kernel, which computes in
    float32: said, naming the layers; with the fast path off, the output is autocast's."""
    model, x = _encoder(), torch.randn(2, 8, 32)
    with torch.no_grad(), _recorded() as messages:
        torch.compile(model, backend=amp_graph.backend(inner="eager"))(x)
    assert len(messages) == 1
    assert "'layers.0', 'layers.1'" in messages[0]
    assert "set_fastpath_enabled(False)" in messages[0]

    torch._dynamo.reset()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad(), _recorded() as quiet:
            got = torch.compile(model, backend=amp_graph.backend("autocast", BF16, "eager"))(x)
            with torch.autocast("cpu", BF16):
                expected = model(x)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert not quiet
    assert got.dtype == expected.dtype and torch.equal(got, expected)
