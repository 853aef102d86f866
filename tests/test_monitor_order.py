"""The monitor's rows in the order the step computed them: "first non-finite" names where a
step first broke.

The model's forward overflows float16 in a late block; the loss is then non-finite and the
backward is non-finite everywhere, early blocks included. Ordered by node (each backward
probe beside its forward node), the first non-finite row was an early block's gradient; in
computed order it is the late block's forward output.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from amp_graph.passes.instrument import Probe, computed_order

import amp_graph
from amp_graph.monitoring.plot import NONFINITE_COLOUR, nonfinite_cells

FP16 = torch.float16
HOT = 2  # the block whose output overflows


class Blocks(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def _blocks() -> Blocks:
    torch.manual_seed(0)
    model = Blocks()
    with torch.no_grad():
        model.blocks[HOT].weight.mul_(1e6)  # outputs ~1e6: float16 overflows (max 65504)
    return model


X = torch.randn(8, 16)


class Step(amp_graph.Graph):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
        self.config.enable_amp(True, policy="O1", dtype=FP16)

    def build(self, x):
        loss = self.model(x).float().sum()
        loss.backward()
        return loss


def _compiled_history(tmp_path=None):
    compiled = amp_graph.compile(_blocks(), "O1", FP16)
    monitor = amp_graph.monitor(compiled, every=1, log_dir=tmp_path)
    compiled(X).float().sum().backward()
    return monitor.history


def _graph_history():
    graph = Step(_blocks())
    monitor = graph.config.enable_monitor(every=1)
    graph(X)
    return monitor.history


HISTORIES = [_compiled_history, _graph_history]


def _linears(history) -> list[str]:
    """The linear nodes in the order their forward rows come."""
    seen: list[str] = []
    for row in history:
        if not row["backward"] and row["node"] not in seen:
            seen.append(row["node"])
    return seen


@pytest.mark.parametrize(
    "history_of", [_compiled_history, _graph_history], ids=["compile", "Graph"]
)
def test_first_nonfinite_is_the_late_blocks_forward_output(history_of):
    history = history_of()
    first = history.first_nonfinite()
    assert first is not None
    assert not first["backward"] and first["role"] == "output", first
    assert first["node"] == _linears(history)[HOT], first
    assert first["module"].endswith(f"blocks.{HOT}"), first
    # the backward broke too, in the early blocks as well: they come after, not before
    early_grads = [r for r in history if r["backward"] and r["module"].endswith("blocks.0")]
    assert early_grads and all(r["nonfinite"] for r in early_grads)


@pytest.mark.parametrize(
    "history_of", [_compiled_history, _graph_history], ids=["compile", "Graph"]
)
def test_rows_come_forward_in_graph_order_then_backward_in_reverse(history_of):
    rows = list(history_of())
    kinds = [r["backward"] for r in rows]
    assert kinds == sorted(kinds)  # every forward row before every backward row
    forward = _linears(rows)
    backward: list[str] = []
    for row in rows:
        if row["backward"] and row["node"] not in backward:
            backward.append(row["node"])
    assert backward == forward[::-1]
    for node in backward:  # each node's output gradient before the gradients it computes
        roles = [r["role"] for r in rows if r["backward"] and r["node"] == node]
        assert roles[0] == "grad_output" and len(roles) > 1, roles
    # where() keeps the order
    hot = forward[HOT]
    assert [r["role"] for r in amp_graph_where(rows, hot)] == ["input", "weight", "output"]


def amp_graph_where(rows, node):
    return [r for r in rows if r["node"] == node and not r["backward"]]


def test_the_files_hold_the_rows_in_the_same_order(tmp_path):
    history = _compiled_history(tmp_path)
    [jsonl] = tmp_path.glob("*.jsonl")
    written = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [(r["node"], r["role"]) for r in written] == [(r["node"], r["role"]) for r in history]
    [csv_file] = tmp_path.glob("*.csv")
    lines = csv_file.read_text().splitlines()[1:]
    assert [line.split(",")[1] for line in lines] == [r["node"] for r in history]
    hot = history.where(node=_linears(history)[HOT], role="output")
    assert len(hot) == 1 and hot.first_nonfinite() is hot[0]


def test_the_heatmap_marks_cells_of_inf_and_nan_apart_from_zeros():
    history = _compiled_history()
    marks = nonfinite_cells(history, "node")
    labels = {label for label, _ in marks}
    grads = [label for label in labels if "grad_" in label]
    assert grads and any(v == "all" for v in marks.values())
    svg = str(amp_graph.monitoring.plot.heatmap(history, "underflow"))
    assert f"fill='{NONFINITE_COLOUR}'" in svg and "every element inf/NaN" in svg
    assert "(every element inf/NaN)" in svg  # the cell's own title says it
    finite = _finite_history()
    assert nonfinite_cells(finite, "node") == {}
    assert "every element inf/NaN" not in str(amp_graph.monitoring.plot.heatmap(finite))


def _finite_history():
    torch.manual_seed(0)
    compiled = amp_graph.compile(Blocks(), "O1", FP16)
    monitor = amp_graph.monitor(compiled, every=1)
    compiled(X).float().sum().backward()
    return monitor.history


def test_computed_order_puts_region_nodes_at_the_regions_place():
    """A checkpoint region's nodes sit where the region is called, not after the graph."""

    def probe(node, position, role, backward=False):
        return Probe(node, "", "op", "", role, FP16, FP16, False, backward, position)

    probes = [
        probe("a", (1,), "input"),
        probe("a", (1,), "grad_input", True),
        probe("a", (1,), "grad_output", True),
        probe("a", (1,), "output"),
        probe("c", (5,), "output"),
        probe("c", (5,), "grad_output", True),
        probe("b", (3, 2), "output"),  # inside the region called at index 3
        probe("b", (3, 2), "grad_output", True),
    ]
    order = [(probes[i].node, probes[i].role) for i in computed_order(probes)]
    assert order == [
        ("a", "input"),
        ("a", "output"),
        ("b", "output"),
        ("c", "output"),
        ("c", "grad_output"),
        ("b", "grad_output"),
        ("a", "grad_output"),
        ("a", "grad_input"),
    ]
