"""amp_graph.compile's contract: what it returns, what it shares, what it refuses."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from conftest import compile_checked

import amp_graph
from amp_graph.demo import models


def test_returns_a_module_whose_graph_is_an_ordinary_graph_module_that_prints():
    compiled = compile_checked(models.MLP(), "O1", example_inputs=(torch.randn(2, 64),))
    assert isinstance(compiled, amp_graph.CompiledModule) and isinstance(compiled, nn.Module)
    gm = compiled.graph_module
    assert isinstance(gm, fx.GraphModule)
    assert "torch.bfloat16" in compiled.code == gm.code
    assert "to(torch.bfloat16)" in str(compiled) and "aten.linear" in str(compiled)
    assert compiled.graph is gm.graph and compiled.meta is gm.meta


def test_captures_at_the_first_call_and_default_dtype_follows_torch_autocast():
    compiled = amp_graph.compile(models.MLP())
    assert compiled.graph_modules == [] and "not captured yet" in repr(compiled)
    with pytest.raises(RuntimeError, match="Call the compiled module once"):
        compiled.code  # noqa: B018
    assert compiled(torch.randn(2, 64)).dtype == torch.bfloat16
    assert compiled.meta["amp_graph"].dtype == torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert compiled.meta["amp_graph"].exact


def test_shares_parameters_and_does_not_modify_the_model():
    model = models.GPT()
    before_state = copy.deepcopy(model.state_dict())
    before_modules = [(n, type(m)) for n, m in model.named_modules()]
    compiled = compile_checked(model, "O1", example_inputs=(torch.randint(0, 64, (2, 8)),))
    assert {id(p) for p in compiled.parameters()} == {id(p) for p in model.parameters()}
    graph_params = dict(compiled.graph_module.named_parameters())
    assert all(graph_params[f"model.{n}"] is p for n, p in model.named_parameters())
    assert [(n, type(m)) for n, m in model.named_modules()] == before_modules
    assert all(torch.equal(before_state[k], v) for k, v in model.state_dict().items())


def test_optimizer_over_model_parameters_trains_the_compiled_module():
    model = models.MLP()
    compiled = compile_checked(model, "O1")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    w0 = model.fc1.weight.detach().clone()
    loss = F.cross_entropy(compiled(x).float(), y)
    loss.backward()
    assert model.fc1.weight.grad is not None and model.fc1.weight.grad.dtype == torch.float32
    assert model.fc1.weight.dtype == torch.float32
    opt.step()
    assert not torch.equal(model.fc1.weight, w0)


def test_graph_module_input_is_used_as_is_and_not_mutated():
    gm = fx.symbolic_trace(models.MLP())
    code_before = gm.code
    nodes_before = [n.name for n in gm.graph.nodes]
    compiled = compile_checked(gm, "O1")
    out = compiled(torch.randn(2, 64))
    assert out.dtype == torch.bfloat16
    assert gm.code == code_before and [n.name for n in gm.graph.nodes] == nodes_before
    assert compiled.graph_module is not gm
    assert "to(torch.bfloat16)" in compiled.code
    assert "fc1" in [n.target for n in compiled.graph.nodes if n.op == "call_module"] or any(
        "fc1" in str(n.target) for n in compiled.graph.nodes
    )
    assert all("amp" not in n.meta for n in gm.graph.nodes)


def test_logs_one_summary_line(caplog):
    with caplog.at_level(logging.INFO, logger="amp_graph"):
        amp_graph.compile(models.MLP(), example_inputs=(torch.randn(2, 64),))
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("amp_graph")]
    assert len(lines) == 1
    assert "casts inserted" in lines[0] and "removed" in lines[0] and "bf16" in lines[0]


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return self.fc(x)
        return x


def test_untraceable_model_raises_capture_error_naming_the_construct():
    compiled = amp_graph.compile(Untraceable())
    with pytest.raises(amp_graph.CaptureError) as info:
        compiled(torch.randn(2, 4))
    message = str(info.value)
    assert "if x.sum() > 0:" in message
    assert "test_compile_api.py" in message
    assert "backend='amp_graph'" in message and "torch.cond" in message
    with pytest.raises(amp_graph.CaptureError):  # with example inputs: at once
        amp_graph.compile(Untraceable(), example_inputs=(torch.randn(2, 4),))


@pytest.mark.parametrize("name", ["O4", "o1", "amp"])
def test_unknown_policy_names_the_nearest(name):
    with pytest.raises(ValueError, match="unknown policy preset") as info:
        amp_graph.compile(models.MLP(), policy=name)
    if name != "amp":
        assert "Did you mean" in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float32, "bf16"])
def test_wrong_dtype(dtype):
    with pytest.raises(ValueError, match=r"torch\.float16 or torch\.bfloat16"):
        amp_graph.compile(models.MLP(), dtype=dtype)


def test_bad_example_inputs():
    with pytest.raises(ValueError, match="none of example_inputs is a tensor"):
        amp_graph.compile(models.MLP(), example_inputs=(3,))
    with pytest.raises(TypeError, match=r"do not fit MLP.forward\(x.*too many positional"):
        amp_graph.compile(models.MLP(), example_inputs=(torch.randn(1, 64), torch.randn(1)))
    with pytest.raises(TypeError, match="tuple of the forward's arguments"):
        amp_graph.compile(models.MLP(), example_inputs=torch.randn(1, 64))
    with pytest.raises(TypeError, match=r"nn\.Module"):
        amp_graph.compile(lambda x: x)


def test_a_model_without_inputs_is_captured_too():
    class Constant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2, 2))

        def forward(self):
            return self.w @ self.w

    assert amp_graph.compile(Constant(), "O1")().dtype == torch.bfloat16


def test_every_dtype_is_exact_and_reports_give_bytes():
    compiled = compile_checked(models.GPT(), "O1")
    compiled(torch.randint(0, 64, (2, 8)))
    rep = amp_graph.report(compiled)
    assert rep.exact and rep.cast_bytes is not None and rep.cast_bytes > 0
    assert all(r.out != "?" for r in rep.rows)


def test_compiled_module_pickles_and_reruns():
    import pickle

    model = models.MLP()
    compiled = compile_checked(model, "O1")
    x = torch.randn(3, 64)
    expected = compiled(x)
    clone = pickle.loads(pickle.dumps(compiled))
    assert torch.equal(clone(x), expected)
    assert len(clone.graph_modules) == 1  # captured again, at its first call


def test_called_inside_torch_autocast_warns_once_and_keeps_its_plan():
    compiled = amp_graph.compile(models.MLP(), "O1")
    x = torch.randn(2, 64)
    expected = compiled(x)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.warns(UserWarning, match="inside"):
        assert torch.equal(compiled(x), expected)


def test_shows_the_model_signature_and_its_attributes_as_torch_compile_does():
    import inspect

    model = models.MLP()
    model.note = "the model's own attribute"
    compiled = amp_graph.compile(model, "O1")
    assert inspect.signature(compiled.forward) == inspect.signature(model.forward)
    assert list(inspect.signature(compiled.forward).parameters) == ["x"]
    assert compiled.note == "the model's own attribute" and compiled.fc1 is model.fc1
    assert compiled.policy.name == "O1"  # the wrapper's own attributes come first
    with pytest.raises(AttributeError, match="no_such_thing"):
        _ = compiled.no_such_thing
    x = torch.randn(2, 64)
    clone = copy.deepcopy(compiled)  # its forward runs the copy, not the original
    assert clone.forward.run.__self__ is clone and torch.equal(clone(x), compiled(x))
