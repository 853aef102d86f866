"""amp_graph.monitor under DDP and FSDP2: 2 CPU processes, gloo (issue 25).

Each rank trains on its own data, so its statistics are its own: without ``group=`` a rank's
rows are its own measurements and no collective is issued; with a group, each read reduces
the pending steps over it, and every rank then holds the same rows, equal to the per-rank
rows combined (``amax`` the largest, counts summed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from test_fsdp2_amp import TinyLM, batches, loss_fn, run_ranks, sharded_model

STATS_KEYS = ("amax", "zeros", "underflow", "nonfinite", "bf16_underflow", "e4m3_overflow")


def _monitored_losses(forward: Any, model: torch.nn.Module, rank: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in batches(rank):
        opt.zero_grad(set_to_none=True)
        loss_fn(forward(x), y).backward()
        opt.step()


def _ddp(rank: int, group: Any) -> list[dict]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import amp_graph

    torch.manual_seed(0)
    model = TinyLM()
    compiled = amp_graph.compile(model, policy="O1", dtype=torch.bfloat16)
    monitor = amp_graph.monitor(compiled, every=2, group=group)
    _monitored_losses(DDP(compiled), model, rank)
    return monitor.history.rows


def _fsdp2_graph(rank: int, group: Any) -> list[dict]:
    import amp_graph

    model = sharded_model()

    class Step(amp_graph.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
            self.config.enable_amp(True, policy="O1", dtype=torch.bfloat16)

        def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = loss_fn(self.model(x), y)
            loss.backward()
            return loss

    graph = Step()
    monitor = graph.config.enable_monitor(every=2, group=group)
    for x, y in batches(rank):
        graph(x, y)
    return monitor.history.rows


def monitor_ddp(rank: int) -> dict[str, Any]:
    return {"own": _ddp(rank, None), "reduced": _ddp(rank, dist.group.WORLD)}


def monitor_fsdp2(rank: int) -> dict[str, Any]:
    return {"own": _fsdp2_graph(rank, None), "reduced": _fsdp2_graph(rank, dist.group.WORLD)}


SCENARIOS = {"monitor_ddp": monitor_ddp, "monitor_fsdp2": monitor_fsdp2}


def _combined(rows_per_rank: list[list[dict]]) -> list[dict]:
    """The per-rank rows reduced by hand: amax the largest, fractions weighted by numel."""
    out = []
    for rows in zip(*rows_per_rank, strict=True):
        assert len({(r["step"], r["node"], r["role"]) for r in rows}) == 1
        numel = sum(r["numel"] for r in rows)
        row = {"numel": numel, "amax": max(r["amax"] for r in rows)}
        row["nonfinite"] = sum(r["nonfinite"] for r in rows)
        for key in STATS_KEYS[1:]:
            if key != "nonfinite":
                row[key] = sum(r[key] * r["numel"] for r in rows) / numel
        out.append(row)
    return out


def _check(results: list[dict[str, Any]]) -> None:
    own = [r["own"] for r in results]
    assert [{row["rank"] for row in rows} for rows in own] == [{0}, {1}]
    assert {row["step"] for row in own[0]} == {0, 2}
    # each rank trained on its own data: its own activations were measured
    differs = [a["amax"] != b["amax"] for a, b in zip(own[0], own[1], strict=True)]
    assert any(differs)
    reduced = [r["reduced"] for r in results]
    assert reduced[0] == reduced[1]
    assert {row["rank"] for row in reduced[0]} == {None}
    for got, want in zip(reduced[0], _combined(own), strict=True):
        assert got["numel"] == want["numel"]
        for key in STATS_KEYS:
            assert abs(got[key] - want[key]) <= 1e-12 * max(1.0, abs(want[key])), key


def test_ddp_statistics_per_rank_and_reduced_over_a_given_group(tmp_path: Path) -> None:
    _check(run_ranks("monitor_ddp", tmp_path, module=__name__))


def test_fsdp2_graph_statistics_per_rank_and_reduced(tmp_path: Path) -> None:
    _check(run_ranks("monitor_fsdp2", tmp_path, module=__name__))
