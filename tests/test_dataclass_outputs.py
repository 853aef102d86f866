"""A model returning a plain ``@dataclass``: every entry point (compile, compile_, the
torch.compile backend, Graph) returns the model's own type, with torch.autocast's numbers.
Dataclasses that ``cls(**fields)`` cannot rebuild, and classes that are no dataclass, get
a CaptureError that names them and says what to do."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import amp_graph
from amp_graph.capture import CaptureError
from amp_graph.frontends.compiler import as_graph_module
from amp_graph.training.nn_graph import Graph

BF16 = torch.bfloat16


@dataclass
class Out:
    logits: torch.Tensor  # bfloat16 under autocast (a linear)
    probs: torch.Tensor  # float32 (the model's own .float() of a bfloat16 softmax)
    aux: torch.Tensor | None = None
    n: int = 0


@dataclass
class Inner:
    hidden: torch.Tensor


@dataclass
class Outer:
    inner: Inner
    logits: torch.Tensor


@dataclass
class LossOut:
    loss: torch.Tensor
    logits: torch.Tensor


@dataclass
class WithInitFalse:
    logits: torch.Tensor
    probs: torch.Tensor = field(init=False)  # set after construction: cls(**fields) loses it


@dataclass
class WithOwnInit:
    logits: torch.Tensor

    def __init__(self, x: torch.Tensor) -> None:  # takes other arguments than its fields
        self.logits = x


class NotADataclass:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


OURS = (Out, Inner, Outer, LossOut, WithInitFalse, WithOwnInit, NotADataclass)


@pytest.fixture(autouse=True)
def _unregistered():
    """Registration is global: each test starts, and leaves, with none of these types
    registered, so that each one needs the registration it tests."""
    for cls in OURS:
        assert cls not in pytree.SUPPORTED_NODES
    yield
    for cls in OURS:
        if cls in pytree.SUPPORTED_NODES:
            pytree._deregister_pytree_node(cls)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> Out:
        logits = self.logits(x)
        return Out(logits, F.softmax(logits, dim=-1).float(), None, x.shape[0])


class NestedNet(Net):
    def forward(self, x: torch.Tensor) -> dict:  # type: ignore[override]
        hidden = F.relu(self.fc1(x))
        logits = self.fc2(hidden)
        return {"pair": (Inner(hidden), Outer(Inner(hidden * 2), logits))}


class Returns(Net):
    """Returns ``cls(logits)`` (and sets ``probs`` where ``cls`` has it but does not take it)."""

    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls

    def forward(self, x: torch.Tensor):  # type: ignore[override]
        logits = self.logits(x)
        out = self.cls(logits)
        if self.cls is WithInitFalse:
            out.probs = F.softmax(logits, dim=-1).float()
        return out


def autocast_reference(model: nn.Module, x: torch.Tensor):
    with torch.autocast("cpu", dtype=BF16):
        return model(x)


def assert_same_out(got: Out, want: Out) -> None:
    assert type(got) is Out
    for name in ("logits", "probs"):
        assert getattr(got, name).dtype == getattr(want, name).dtype
        torch.testing.assert_close(getattr(got, name), getattr(want, name))
    assert got.logits.dtype == BF16 and got.probs.dtype == torch.float32
    assert got.aux is None
    assert got.n == want.n == 4 and type(got.n) is int


def test_compile_returns_the_models_dataclass_with_autocast_numbers_and_gradients():
    model, x = Net(), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    out = amp_graph.compile(model, "autocast", BF16, check_each_pass=True)(x)
    want = autocast_reference(reference, x)
    assert_same_out(out, want)
    assert not model._forward_hooks  # the capture's hook is gone
    out.probs[:, 0].sum().backward()  # backward through a dataclass field
    want.probs[:, 0].sum().backward()
    assert model.fc1.weight.grad is not None
    for got_p, want_p in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got_p.grad, want_p.grad)


def test_compile_in_place_returns_the_models_dataclass():
    model, x = Net(), torch.randn(4, 16)
    want = autocast_reference(copy.deepcopy(model), x)
    assert amp_graph.compile_(model, "autocast", BF16) is model
    assert_same_out(model(x), want)
    assert type(model) is Net and isinstance(as_graph_module(model), fx.GraphModule)


def test_dataclasses_nested_in_dicts_tuples_and_dataclass_fields():
    model, x = NestedNet(), torch.randn(4, 16)
    want = autocast_reference(copy.deepcopy(model), x)["pair"]
    out = amp_graph.compile(model, "autocast", BF16, check_each_pass=True)(x)
    first, second = out["pair"]
    assert type(first) is Inner and type(second) is Outer and type(second.inner) is Inner
    torch.testing.assert_close(first.hidden, want[0].hidden)
    torch.testing.assert_close(second.inner.hidden, want[1].inner.hidden)
    torch.testing.assert_close(second.logits, want[1].logits)
    assert second.logits.dtype == BF16


@pytest.mark.usefixtures("fresh_dynamo")
def test_torch_compile_backend_returns_the_models_dataclass():
    model, x = Net(), torch.randn(4, 16)
    want = autocast_reference(copy.deepcopy(model), x)
    backend = amp_graph.backend("autocast", BF16, inner="eager", check_each_pass=True)
    assert_same_out(torch.compile(model, backend=backend)(x), want)
    assert len(backend.graphs) == 1  # one graph, no break at the dataclass


class EvalGraph(Graph):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config.enable_amp(True, policy="autocast", dtype=BF16)

    def build(self, x):
        return self.model(x)


def test_evaluation_graph_returns_the_builds_dataclass():
    model, x = Net(), torch.randn(4, 16)
    want = autocast_reference(copy.deepcopy(model), x)
    assert_same_out(EvalGraph(model)(x), want)


class TrainGraph(Graph):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(optimizer)
        self.config.enable_amp(True, policy="autocast", dtype=BF16)

    def build(self, x, y):
        logits = self.model.logits(x)
        loss = F.cross_entropy(logits.float(), y)
        loss.backward()
        return LossOut(loss, logits)


def test_training_graph_returns_a_dataclass_holding_the_loss_and_steps():
    model, x, y = Net(), torch.randn(4, 16), torch.randint(0, 8, (4,))
    reference = copy.deepcopy(model)
    graph = TrainGraph(model, torch.optim.SGD(model.parameters(), lr=0.5))
    out = graph(x, y)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    with torch.autocast("cpu", dtype=BF16):
        logits = reference.logits(x)
        loss = F.cross_entropy(logits.float(), y)
    loss.backward()
    ref_opt.step()
    assert type(out) is LossOut and out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, loss)
    torch.testing.assert_close(out.logits, logits)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want)  # the step ran, with autocast's gradients


@pytest.mark.parametrize(
    ("cls", "why"), [(WithInitFalse, r"\['probs'\].*init=False"), (WithOwnInit, "TypeError")]
)
def test_a_dataclass_its_fields_cannot_rebuild_is_refused_and_left_unregistered(cls, why):
    model = Returns(cls)
    with pytest.raises(CaptureError, match=rf"{cls.__qualname__}.*{why}") as error:
        amp_graph.compile(model, "autocast", BF16)(torch.randn(4, 16))
    assert "register_pytree_node" in str(error.value) and "tuple or dict" in str(error.value)
    assert cls not in pytree.SUPPORTED_NODES
    assert not model._forward_hooks  # removed also when the capture fails


def test_a_class_that_is_no_dataclass_keeps_the_register_a_pytree_hint():
    with pytest.raises(CaptureError, match=r"NotADataclass.*not a known type") as error:
        amp_graph.compile(Returns(NotADataclass), "autocast", BF16)(torch.randn(4, 16))
    assert "register the type with torch.utils._pytree.register_pytree_node" in str(error.value)
    assert NotADataclass not in pytree.SUPPORTED_NODES
