"""One gradient checker across ranks: ``NonFiniteGuard`` (the check of every step that scales no
loss: bfloat16 and float32 Graphs) agrees with other ranks exactly as the GradScaler does.

2 CPU processes with gloo:

* Ranks stepping *different numbers* of bfloat16 Graph steps never block: the guard runs no
  collective unasked (a world-group all-reduce per step would leave rank 0's second step waiting
  for a partner that has finished, and the 20 s gloo timeout would fail the test).
* ``config.set_process_group(WORLD)``: an inf on rank 1 alone skips the step on both ranks, and
  rank 0 ends exactly where a run without that step ends. Without a group only rank 1 skips.
* FSDP2 (DTensor gradient shards): an inf in rank 1's shard skips the step on both ranks with no
  group given, as the mesh says they hold one tensor.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from dist_helpers import end_rank, free_port, spawn_ranks

WORLD = 2
BF16 = torch.bfloat16
POISONED_STEP = 1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _graph(model: torch.nn.Module, group: dist.ProcessGroup | None):
    import amp_graph

    class Train(amp_graph.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
            self.config.enable_amp(True, dtype=BF16)
            self.config.set_process_group(group)

        def build(self, x, y):
            loss = torch.nn.functional.mse_loss(self.model(x).float(), y)
            loss.backward()
            return loss

    return Train()


def _batches(rank: int, steps: int, poison_rank: int | None) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(10 + rank)
    out = []
    for step in range(steps):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        if step == POISONED_STEP and rank == poison_rank:
            x[0, 0] = float("inf")
        out.append((x, y))
    return out


def _run(graph, batches) -> dict:
    for x, y in batches:
        graph(x, y)
    return {
        "skipped": graph.skipped_steps,
        "params": [p.detach().clone() for p in graph.model.parameters()],
    }


def _fsdp_guard(rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from amp_graph.scaler import NonFiniteGuard

    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NonFiniteGuard()
    taken = []
    for step, (x, y) in enumerate(_batches(rank, 3, poison_rank=None)):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == POISONED_STEP and rank == 1:
            model[2].weight.grad.to_local()[0, 0] = float("inf")
        guard.check(opt)
        guard.step(opt)
        taken.append(bool(guard.last_step_taken))
        guard.end_step()
    return {
        "taken": taken,
        "params": [p.full_tensor().detach().clone() for p in model.parameters()],
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=20),
    )
    torch.set_num_threads(1)
    try:
        uneven = _run(_graph(_model(), None), _batches(rank, 3 if rank == 0 else 1, None))
        agreed = _run(_graph(_model(), dist.group.WORLD), _batches(rank, 3, poison_rank=1))
        alone = _run(_graph(_model(), None), _batches(rank, 3, poison_rank=1))
        # rank 0's reference for `agreed`: its own batches without the poisoned step
        kept = [b for i, b in enumerate(_batches(rank, 3, None)) if i != POISONED_STEP]
        reference = _run(_graph(_model(), None), kept)
        result = {
            "uneven": uneven,
            "agreed": agreed,
            "alone": alone,
            "reference": reference,
            "fsdp": _fsdp_guard(rank),
        }
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    end_rank()


def test_guard_agrees_only_where_asked_and_never_blocks(tmp_path: Path) -> None:
    spawn_ranks(_worker, (free_port(), str(tmp_path)), WORLD, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    for result in ranks:  # 3 steps on rank 0, 1 on rank 1: both finished, nothing skipped
        assert result["uneven"]["skipped"] == 0
    assert [r["agreed"]["skipped"] for r in ranks] == [1, 1]
    for a, b in zip(ranks[0]["agreed"]["params"], ranks[0]["reference"]["params"], strict=True):
        assert torch.equal(a, b)
    assert [r["alone"]["skipped"] for r in ranks] == [0, 1]
    assert not all(
        torch.equal(a, b)
        for a, b in zip(ranks[0]["alone"]["params"], ranks[0]["agreed"]["params"], strict=True)
    )

    for result in ranks:
        assert result["fsdp"]["taken"] == [step != POISONED_STEP for step in range(3)]
    for a, b in zip(ranks[0]["fsdp"]["params"], ranks[1]["fsdp"]["params"], strict=True):
        assert torch.equal(a, b)
