"""O2 in a Graph keeps in float32 the parameters the plan reads only in float32 (CLIP's
``logit_scale.exp()``, Mamba's ``A_log.float()``): stored low, each would be rounded before
every read and save no cast. Graph O2 then computes what ``compile`` O2 computes, bit for bit;
the optimizer steps those parameters themselves, with their state."""

from __future__ import annotations

import torch
import torch.nn as nn

import amp_graph
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
