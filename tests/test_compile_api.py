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
from amp_graph import models


def test_returns_an_ordinary_graph_module_that_prints():
    compiled = compile_checked(models.MLP(), "O1")
    assert type(compiled).__mro__[1] is fx.GraphModule or isinstance(compiled, fx.GraphModule)
    assert "torch.bfloat16" in compiled.code
    assert "to(torch.bfloat16)" in str(compiled)
    assert any(n.op == "call_function" for n in compiled.graph.nodes)


def test_default_dtype_follows_torch_autocast_on_cpu():
    compiled = amp_graph.compile(models.MLP())
    assert compiled.meta["amp_graph"].dtype == torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert compiled(torch.randn(2, 64)).dtype == torch.bfloat16


def test_shares_parameters_and_does_not_modify_the_model():
    model = models.GPT()
    before_state = copy.deepcopy(model.state_dict())
    before_modules = [(n, type(m)) for n, m in model.named_modules()]
    compiled = compile_checked(model, "O1")
    compiled_params = dict(compiled.named_parameters())
    assert all(compiled_params[n] is p for n, p in model.named_parameters() if n in compiled_params)
    assert {id(p) for p in compiled.parameters()} <= {id(p) for p in model.parameters()}
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
    assert gm.code == code_before and [n.name for n in gm.graph.nodes] == nodes_before
    assert compiled is not gm
    assert "to(torch.bfloat16)" in compiled.code
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
    with pytest.raises(amp_graph.CaptureError) as info:
        amp_graph.compile(Untraceable())
    message = str(info.value)
    assert "if x.sum() > 0:" in message
    assert "test_compile_api.py" in message
    assert "backend='amp_graph'" in message and "GraphModule" in message


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


def test_graph_without_inputs_and_example_inputs_without_tensors():
    class Constant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2, 2))

        def forward(self):
            return self.w @ self.w

    with pytest.raises(ValueError, match="no inputs"):
        amp_graph.compile(Constant())
    with pytest.raises(ValueError, match="none of example_inputs is a tensor"):
        amp_graph.compile(models.MLP(), example_inputs=(3,))
    with pytest.raises(ValueError, match="2 example inputs for a graph with 1 inputs"):
        amp_graph.compile(models.MLP(), example_inputs=(torch.randn(1, 64), torch.randn(1)))
    with pytest.raises(TypeError, match=r"nn\.Module"):
        amp_graph.compile(lambda x: x)


def test_example_inputs_make_every_dtype_exact_and_give_bytes():
    with_examples = compile_checked(
        models.GPT(), "O1", example_inputs=(torch.randint(0, 64, (2, 8)),)
    )
    without = compile_checked(models.GPT(), "O1")
    rep = amp_graph.report(with_examples)
    assert rep.exact and rep.cast_bytes is not None and rep.cast_bytes > 0
    assert all(r.out != "?" for r in rep.rows)
    assert amp_graph.report(without).cast_bytes is None


def test_compiled_module_pickles_and_reruns():
    import pickle

    model = models.MLP()
    compiled = compile_checked(model, "O1")
    clone = pickle.loads(pickle.dumps(compiled))
    x = torch.randn(3, 64)
    assert torch.equal(clone(x), compiled(x))
