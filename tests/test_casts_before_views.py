"""Pass casts_before_views: state read through views and then cast is cast first, so that
amp_graph.export stores it low; readers get the same values and strides, and state read any
other way, or whose readers would get other strides, is left alone."""

from __future__ import annotations

import torch
import torch.nn as nn

import amp_graph

BF16 = torch.bfloat16


class ViewedWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w_t = nn.Parameter(torch.randn(8, 8))  # x @ w.T (Falcon)
        self.w_crop = nn.Parameter(torch.randn(4, 16))  # cropped, reshaped (SD3's pos_embed)
        self.w_slice = nn.Parameter(torch.randn(8, 10))  # sliced, then straight to the cast
        self.w_mixed = nn.Parameter(torch.randn(8, 8))  # viewed once, read whole once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w_t.T
        h = h + self.w_crop[1:3, :4].reshape(8)  # reshaped: a contiguous copy
        h = h @ self.w_slice[:, 2:]
        h = h @ self.w_mixed.T + (x @ self.w_mixed)
        return h.float().sum(-1)


def _export(model: nn.Module, x: torch.Tensor):
    return amp_graph.export(model, (x,), policy="O2", dtype=BF16)


def test_weights_read_through_views_are_stored_low_with_the_same_outputs():
    torch.manual_seed(0)
    model, x = ViewedWeights().eval(), torch.randn(3, 8)
    program = _export(model, x)
    stored = {name: t.dtype for name, t in program.state_dict.items()}
    assert stored["w_t"] == BF16 and stored["w_crop"] == BF16
    # a cast slice is contiguous, a slice of a cast is not: left as it was
    assert stored["w_slice"] == torch.float32
    assert stored["w_mixed"] == BF16  # both of its reads are casts (one after a view)
    with torch.no_grad():
        expected = amp_graph.compile(model, "O2", BF16)(x)
    assert torch.equal(program.module()(x), expected)


def test_a_view_read_by_anything_but_a_cast_keeps_the_state_as_it_is():
    class ViewReadWide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.randn(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            view = self.scale.view(1, 8)
            return (x * view).float().sum() + view.exp().sum()  # exp: float32 list, no cast

    program = _export(ViewReadWide().eval(), torch.randn(3, 8))
    assert program.state_dict["scale"].dtype == torch.float32


class GatheredTable(nn.Module):
    """OPT's learned positions: rows gathered from a table, then the model's ``.to(device)``,
    which the plan makes the rows' cast to bf16 (O2's placement gathers in float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = nn.Embedding(32, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.positions(ids).to(ids.device)
        return self.proj(rows).float().sum(-1)


def test_a_gathered_table_is_stored_low_with_the_same_outputs():
    torch.manual_seed(0)
    model, ids = GatheredTable().eval(), torch.randint(0, 32, (2, 4))
    compiled = amp_graph.compile(model, "O2", BF16)
    with torch.no_grad():
        expected = compiled(ids)
    gather = next(n for n in compiled.graph_module.graph.nodes if n.name == "embedding")
    assert gather.meta["amp"].compute_dtype == torch.float32  # the rows are cast, not the table
    program = amp_graph.export(model, (ids,), policy="O2", dtype=BF16)
    assert program.state_dict["positions.weight"].dtype == BF16
    gathers = [n for n in program.graph.nodes if n.target is torch.ops.aten.embedding.default]
    assert [g.meta["val"].dtype for g in gathers] == [BF16]
    assert torch.equal(program.module()(ids), expected)


def test_only_a_conversion_that_changes_the_dtype_alone_is_moved():
    """The model's own ``x.to(...)`` counts as a cast to move before a gather only where it
    changes nothing but the dtype: not a copy it asks for, nor another device or format."""
    from amp_graph.passes.casts_before_views import _conversion_dtype

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(2, 3)
    cases = {
        graph.call_function(aten._to_copy.default, (x,), {"dtype": BF16}): BF16,
        graph.call_function(aten.to.dtype, (x, BF16)): BF16,
        graph.call_function(aten.to.dtype_layout, (x,), {"dtype": BF16, "device": "cpu"}): BF16,
        graph.call_function(aten.to.dtype, (x, BF16, False, True)): None,  # copy=True
        graph.call_function(aten.to.dtype, (x, BF16), {"copy": True}): None,
        graph.call_function(aten.to.dtype_layout, (x,), {"dtype": BF16, "device": "meta"}): None,
        graph.call_function(
            aten._to_copy.default, (x,), {"dtype": BF16, "memory_format": torch.channels_last}
        ): None,
        graph.call_function(aten.add.Tensor, (x, x)): None,
    }
    assert {node.name: _conversion_dtype(node) for node in cases} == {
        node.name: want for node, want in cases.items()
    }
