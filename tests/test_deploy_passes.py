"""The two passes behind amp_graph.export's program: aten_casts (amp_graph's casts as aten
``_to_copy`` calls) and state_casts (which weights every reader casts to one narrower
dtype, so that they can be stored cast)."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
from amp_graph.passes.aten_casts import TO_COPY, aten_casts, cast_dtype
from amp_graph.passes.state_casts import state_casts

from amp_graph.ops.recompute_ops import recomputed_cast

BF16, FP16 = torch.bfloat16, torch.float16


class Casts(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(BF16).float() + x.to(FP16).float()


def test_aten_casts_rewrites_method_and_recomputed_casts_bit_for_bit():
    gm = fx.symbolic_trace(Casts())
    # the second cast as recompute_casts writes it (fx's tracer would trace through it)
    second = [n for n in gm.graph.nodes if cast_dtype(n) is not None][1]
    second.op, second.target = "call_function", recomputed_cast
    second.args = (*second.args, "module")
    gm.recompile()
    x = torch.randn(8) * 1000
    want = gm(x)
    kinds = [(n.op, n.target) for n in gm.graph.nodes if cast_dtype(n) is not None]
    assert ("call_method", "to") in kinds and ("call_function", recomputed_cast) in kinds
    result = aten_casts(gm)
    gm.recompile()
    casts = [n for n in gm.graph.nodes if n.target is TO_COPY]
    assert [n.kwargs["dtype"] for n in casts] == [BF16, FP16]
    assert result.modified and result.stats["casts_as_aten"] == 2
    assert torch.equal(gm(x), want)
    # the model's own .float() (no dtype argument) is not amp_graph's cast: left alone
    assert [n.target for n in gm.graph.nodes if n.op == "call_method"] == ["float", "float"]
    assert not aten_casts(gm).modified


class Weights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.only_bf16 = nn.Parameter(torch.randn(4))  # two reads, both cast to bf16
        self.also_fp32 = nn.Parameter(torch.randn(4))  # cast and read as it is
        self.two_dtypes = nn.Parameter(torch.randn(4))  # cast to bf16 and to fp16
        self.widened = nn.Parameter(torch.randn(4))  # cast to float64: not narrower
        self.register_buffer("steps", torch.zeros(4, dtype=torch.int64))  # not floating
        self.tied = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.tied.weight  # one tensor, two names, both cast to fp16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = (x.to(BF16) * self.only_bf16.to(BF16)).float() + self.only_bf16.to(BF16).float()
        b = self.also_fp32.to(BF16).float() + self.also_fp32
        c = self.two_dtypes.to(BF16).float() + self.two_dtypes.to(FP16).float()
        d = self.widened.to(torch.float64).float() + self.steps.to(torch.float32)
        e = (self.tied.weight.to(FP16) @ self.head.weight.to(FP16)).float().sum(0)
        return a + b + c + d + e


def _traced() -> fx.GraphModule:
    # fx's tracer reads a tied weight through one path: the second name's read by hand
    model = Weights()
    gm = fx.symbolic_trace(model)
    gm.add_submodule("head", model.head)
    (read,) = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "tied.weight"]
    second_cast = list(read.users)[1]
    with gm.graph.inserting_before(second_cast):
        second_cast.replace_input_with(read, gm.graph.get_attr("head.weight"))
    gm.recompile()
    return gm


def test_state_casts_lists_only_what_every_reader_narrows_to_one_dtype():
    gm = _traced()
    found = state_casts(gm)
    assert found.dtypes == {"only_bf16": BF16, "tied.weight": FP16, "head.weight": FP16}
    assert len(found.casts) == 4 and all(cast_dtype(c) in (BF16, FP16) for c in found.casts)


def test_state_casts_sees_the_other_name_of_a_tied_weight():
    """A read of the tied tensor under its other name, as it is, keeps both names float32."""
    gm = _traced()
    head = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "head.weight")
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        total = gm.graph.call_function(torch.add, (output.args[0], head))
    output.args = (total,)
    found = state_casts(gm)
    assert "tied.weight" not in found.dtypes and "head.weight" not in found.dtypes
    assert found.dtypes == {"only_bf16": BF16}
