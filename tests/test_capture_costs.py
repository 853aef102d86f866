"""What the capture does to cost less leaves nothing behind: Python's garbage collector is
paused only while graphs are traced and built (and restored as it was, also on errors),
the unlifted GraphModule reads the model's own modules and tensors, and a GraphModule that
generates its code on the first call computes what an eager one does."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
from torch.fx._lazy_graph_module import _LazyGraphModule

from amp_graph.capture import capture_module, gc_paused
from amp_graph.demo import models


@pytest.mark.parametrize("enabled", [True, False])
def test_gc_paused_restores_the_collector_as_it_was(enabled):
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with gc_paused():
            assert not gc.isenabled()
            with gc_paused():  # nested: still off, and the outer pause is kept
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(RuntimeError), gc_paused():
            raise RuntimeError("the model failed")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def _gpt() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model = models.GPT(vocab=64, block=16, dim=32, heads=2, layers=2).eval()
    return model, (torch.randint(0, 64, (2, 16)),)


def _capture(model: nn.Module, args: tuple, **kwargs):
    return capture_module(
        model, args, {}, device_type="cpu", autocast_dtype=None, **kwargs
    ).graph_module


def test_a_capture_leaves_the_collector_on():
    model, args = _gpt()
    assert gc.isenabled()
    _capture(model, args)
    assert gc.isenabled()


def test_code_on_call_computes_what_the_eager_graph_module_computes():
    model, args = _gpt()
    eager = _capture(model, args)
    lazy = _capture(model, args, code_on_call=True)
    assert isinstance(lazy, _LazyGraphModule) and not isinstance(eager, _LazyGraphModule)
    with torch.no_grad():
        assert torch.equal(lazy(*args), eager(*args))
        assert torch.equal(lazy(*args), model(*args))
    assert "def forward" in lazy.code


@pytest.mark.parametrize("policy", [None, "O1"])
def test_the_capture_generates_python_code_once_at_most(policy):
    """torch.export builds a GraphModule after each of its own passes and, by default,
    generates and compiles Python code for each (6 times for this GPT on torch 2.13); the
    capture only reads the graph, so only the ExportedProgram's own module (its constructor
    generates it) may do so, and the lazily built GraphModule does on its first call."""
    from unittest import mock

    import torch.fx as fx

    from amp_graph.policy import Policy

    model, args = _gpt()
    extra = {"policy": Policy.preset(policy), "low_dtype": torch.bfloat16} if policy else {}
    with mock.patch.object(
        fx.Graph, "python_code", autospec=True, side_effect=fx.Graph.python_code
    ) as generate:
        gm = _capture(model, args, code_on_call=True, **extra)
        assert generate.call_count <= 1
        with torch.no_grad():
            gm(*args)
        assert generate.call_count <= 2  # the first call generates the module's code


@pytest.mark.parametrize("model_attr", ["model", None])
def test_the_graph_module_reads_the_models_own_modules_and_tensors(model_attr):
    """Through ``gm.model`` or, without a model attribute (a Graph's root), through the
    model's children set on the GraphModule: the same objects, so a weight update shows."""
    model, args = _gpt()
    gm = _capture(model, args, model_attr=model_attr)
    if model_attr:
        assert getattr(gm, model_attr) is model
    else:
        children = dict(model.named_children())
        used = {n.target.split(".")[0] for n in gm.graph.nodes if n.op == "get_attr"}
        assert used and used <= set(children)
        assert all(getattr(gm, name) is children[name] for name in used)
    params = {id(p) for p in model.parameters()}
    assert {id(p) for p in gm.parameters()} <= params
    with torch.no_grad():
        before = gm(*args)
        model.head.weight.mul_(2.0)
        assert not torch.equal(gm(*args), before)
        assert torch.equal(gm(*args), model(*args))


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_a_programs_cast_values_are_the_cast_kernels(policy):
    """The lift makes the example value of each cast the passes added directly (a fake tensor
    of the source's layout in the new dtype), not by running the fake kernel: it must be what
    the kernel gives, dtype, sizes, strides and device, on every cast of a GPT's program."""
    from torch._subclasses.fake_tensor import FakeTensor

    import amp_graph

    torch.manual_seed(0)
    model = models.GPT(vocab=64, block=16, dim=32, heads=2, layers=2).eval()
    program = amp_graph.export(model, (torch.randint(0, 64, (2, 16)),), policy=policy)
    casts = [n for n in program.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert casts
    for node in casts:
        got, source = node.meta["val"], node.args[0].meta["val"]
        assert isinstance(got, FakeTensor) and got.fake_mode is source.fake_mode
        with source.fake_mode:
            want = torch.ops.aten._to_copy.default(source, **node.kwargs)
        assert (got.dtype, got.shape, got.stride(), got.device) == (
            want.dtype,
            want.shape,
            want.stride(),
            want.device,
        )
