"""O2 in a Graph keeps in float32 the parameters the plan reads only in float32 (CLIP's
``logit_scale.exp()``, Mamba's ``A_log.float()``): stored low, each would be rounded before
every read and save no cast. The plan decides it (passes.widen_parameters), in one capture.
Graph O2 then computes what ``compile`` O2 computes, bit for bit;
the optimizer steps those parameters themselves, with their state."""

from __future__ import annotations

import torch
import torch.nn as nn
from amp_graph.passes.meta import AMP, STORED_DTYPE, WIDENED_PARAMETERS, Role

import amp_graph
from amp_graph.frontends.front_door import admit, capture_and_rewrite
from amp_graph.training import step_builder
from amp_graph.training.master_weights import MasterWeights

BF16 = torch.bfloat16


class ReadsInFloat32(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.logit_scale = nn.Parameter(torch.tensor(2.6592))  # CLIP's log(1 / 0.07)
        self.A_log = nn.Parameter(torch.log(torch.arange(1.0, 9.0)))  # Mamba's
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x) * self.logit_scale.exp()
        decay = -torch.exp(self.A_log.float())
        return self.head((h * decay).to(h.dtype))  # back to h's dtype: the island ends


class Train(amp_graph.Graph):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(optimizer)
        self.config.enable_amp(True, policy="O2", dtype=BF16)

    def build(self, x: torch.Tensor):
        out = self.model(x)
        loss = out.float().square().sum()
        loss.backward()
        return loss, out.detach()


def _model() -> ReadsInFloat32:
    torch.manual_seed(0)
    return ReadsInFloat32()


def test_parameters_read_only_in_float32_stay_float32_and_graph_matches_compile():
    x = torch.randn(4, 8)
    reference = amp_graph.compile(_model(), "O2", BF16)(x)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    graph = Train(model, optimizer)
    _, out = graph(x)
    assert torch.equal(out, reference)
    assert model.logit_scale.dtype == torch.float32 and model.A_log.dtype == torch.float32
    assert model.proj.weight.dtype == BF16 and model.head.weight.dtype == BF16
    low = {name for name, _, _ in graph._builder.master.pairs}
    assert low == {"model.proj.weight", "model.proj.bias", "model.head.weight", "model.head.bias"}
    # the optimizer steps them themselves, with state of their own
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(model.logit_scale) in stepped and id(model.A_log) in stepped
    before = model.logit_scale.detach().clone()
    graph(x)
    assert not torch.equal(model.logit_scale, before)
    assert "momentum_buffer" in optimizer.state[model.logit_scale]
    state = graph.state_dict()["modules"]["model"]
    assert state["logit_scale"].dtype == torch.float32
    assert torch.equal(state["logit_scale"], model.logit_scale)


def test_release_gives_back_storage_and_optimizer_state():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()  # momentum buffers exist before the masters are made
    buffer = optimizer.state[model.A_log]["momentum_buffer"].clone()
    value = model.A_log.detach().clone()
    masters = MasterWeights.create({"model": model}, [optimizer], BF16)
    assert model.A_log.dtype == BF16
    assert masters.release([model.A_log], [optimizer]) == ["model.A_log"]
    assert model.A_log.dtype == torch.float32 and torch.equal(model.A_log, value)
    assert torch.equal(optimizer.state[model.A_log]["momentum_buffer"], buffer)
    assert any(p is model.A_log for p in optimizer.param_groups[0]["params"])
    assert "model.A_log" not in {name for name, _, _ in masters.pairs}
    assert model.proj.weight.dtype == BF16  # the others keep their masters


def test_hf_clip_under_graph_o2_computes_what_compile_computes():
    from model_zoo import build

    model, kwargs = build("clip")
    model.eval()
    reference = amp_graph.compile(model, "O2", BF16)(**kwargs).logits_per_image

    class Forward(amp_graph.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
            self.config.enable_amp(True, policy="O2", dtype=BF16)

        def build(self, input_ids, pixel_values):
            out = self.model(input_ids=input_ids, pixel_values=pixel_values).logits_per_image
            out.float().sum().backward()
            return out.detach()

    assert torch.equal(Forward()(kwargs["input_ids"], kwargs["pixel_values"]), reference)
    assert model.logit_scale.dtype == torch.float32  # read by exp, on the float32 list


def test_one_capture_plans_the_float32_storage(monkeypatch):
    """The plan decides the storage (passes.widen_parameters) in the one capture: the build
    is not captured again once the two parameters get their float32 storage back, and the
    graph reads them with no cast."""
    calls = []
    real = step_builder.capture_and_rewrite

    def counted(*args, **kwargs):
        calls.append(kwargs.get("low_copies"))
        return real(*args, **kwargs)

    monkeypatch.setattr(step_builder, "capture_and_rewrite", counted)
    model = _model()
    graph = Train(model, torch.optim.SGD(model.parameters(), lr=0.01))
    graph(torch.randn(4, 8))
    assert len(calls) == 1 and len(calls[0]) == 6  # the six low copies, offered once
    build = graph.build_graph
    assert build.meta["amp_graph"].stats["parameters_widened"] == 2
    assert sorted(build.meta[WIDENED_PARAMETERS]) == ["model.A_log", "model.logit_scale"]
    for node in build.graph.nodes:
        if node.op == "get_attr" and node.target in build.meta[WIDENED_PARAMETERS]:
            roles = {user.meta[AMP].role for user in node.users}
            assert Role.CAST not in roles, (node.target, roles)  # read as stored, uncast


class ReadBothWays(nn.Module):
    """``scale`` is read by exp (float32) and by a low-precision product: it stays low."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return (h * self.scale.exp()).to(h.dtype) + h * self.scale


def test_a_parameter_read_low_anywhere_keeps_its_low_copy():
    torch.manual_seed(0)
    model = ReadBothWays()
    graph = Train(model, torch.optim.SGD(model.parameters(), lr=0.01))
    graph(torch.randn(4, 8))
    assert model.scale.dtype == BF16
    assert graph.build_graph.meta["amp_graph"].stats["parameters_widened"] == 0
    assert "model.scale" in {name for name, _, _ in graph._builder.master.pairs}


def test_widened_plan_verifies_against_the_storage_it_plans():
    """Rewritten with every pass checked, the plan's float32 reads of the widened parameters
    (still stored low while the passes run) propagate as planned; once stored in float32 the
    graph computes what compile computes under O2."""
    x = torch.randn(4, 8)
    reference = amp_graph.compile(_model(), "O2", BF16)(x)
    model = _model()
    masters = MasterWeights.create({"model": model}, [], BF16)
    request = admit("O2", BF16, model, (x,))
    captured = capture_and_rewrite(
        model, (x,), {}, request, check_each_pass=True, low_copies=masters.low_parameters()
    )
    gm = captured.graph_module
    assert sorted(gm.meta[WIDENED_PARAMETERS]) == ["model.A_log", "model.logit_scale"]
    reads = [n for n in gm.graph.nodes if n.meta.get(STORED_DTYPE) is torch.float32]
    assert sorted(n.target for n in reads) == ["model.A_log", "model.logit_scale"]
    masters.release([gm.get_parameter(t) for t in gm.meta[WIDENED_PARAMETERS]], [])
    assert torch.equal(gm(x), reference)
