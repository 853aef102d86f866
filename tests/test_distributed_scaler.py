"""found_inf across ranks, on request only: 2 CPU processes with gloo, inf on rank 1 only.

Each rank trains the same model on its own data; gradients are averaged by hand (like DDP) and
*then* rank 1 alone gets an inf, so only a scaler that all-reduces found_inf keeps the ranks in
step. With ``process_group=`` ours does; without it, ours makes no collective at all (rank 1
trains alone while rank 0 waits elsewhere: any hidden collective would time out) and diverges
like torch.amp.GradScaler, which is run the same way to show the test can fail.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from dist_helpers import end_rank, free_port, spawn_ranks

POISONED_ITER = 2
N_ITERS = 4


def _train(rank: int, scaler, make_optimizer, average: bool = True) -> dict:
    from scaler_helpers import make_data, make_model

    model = make_model(seed=0)  # same initial parameters on every rank
    opt = make_optimizer(model.parameters())
    taken = []
    for i, (x, y) in enumerate(make_data(N_ITERS, seed=100 + rank)):  # per-rank data
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        for p in model.parameters() if average else ():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        if i == POISONED_ITER and rank == 1:
            model[2].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        last = getattr(scaler, "last_step_taken", None)
        taken.append(None if last is None else bool(last))
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "taken": taken,
        "scale": scaler.get_scale(),
        "skipped": getattr(scaler, "skipped_steps", None),
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from amp_graph.scaler import GradScaler

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=10),
    )
    world = dist.group.WORLD
    try:
        runs = {
            "amp_graph_sgd": _train(
                rank,
                GradScaler("cpu", init_scale=2.0**10, process_group=world),
                lambda p: torch.optim.SGD(p, lr=0.1),
            ),
            "amp_graph_fused_adam": _train(
                rank,
                GradScaler("cpu", init_scale=2.0**10, process_group=world),
                lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
            ),
            "torch_sgd": _train(
                rank,
                torch.amp.GradScaler("cpu", init_scale=2.0**10),
                lambda p: torch.optim.SGD(p, lr=0.1),
            ),
        }
        # No process group: the scaler must not communicate. Rank 1 trains while rank 0 only
        # waits at the barrier below, so a collective inside the scaler would time out.
        if rank == 1:
            runs["amp_graph_no_group"] = _train(
                rank,
                GradScaler("cpu", init_scale=2.0**10),
                lambda p: torch.optim.SGD(p, lr=0.1),
                average=False,
            )
        dist.barrier()
        torch.save(runs, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    end_rank()


def _train_alone(scaler) -> dict:
    """Rank 1's run without averaging, in this process: what no communication must give."""
    from scaler_helpers import make_data, make_model

    model = make_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(make_data(N_ITERS, seed=101)):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if i == POISONED_ITER:
            model[2].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
    return {"params": [p.detach().clone() for p in model.parameters()]}


def test_all_ranks_skip_together_with_a_process_group(tmp_path: Path) -> None:
    spawn_ranks(_worker, (free_port(), str(tmp_path)), 2, tmp_path)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))

    expected_taken = [i != POISONED_ITER for i in range(N_ITERS)]
    for name in ("amp_graph_sgd", "amp_graph_fused_adam"):
        for run in (rank0[name], rank1[name]):
            assert run["taken"] == expected_taken, name
            assert run["skipped"] == 1
        assert rank0[name]["scale"] == rank1[name]["scale"]
        for a, b in zip(rank0[name]["params"], rank1[name]["params"], strict=True):
            assert torch.equal(a, b), name

    # Without the all-reduce, rank 0 steps on the poisoned iteration and the ranks diverge.
    diverged = any(
        not torch.equal(a, b)
        for a, b in zip(rank0["torch_sgd"]["params"], rank1["torch_sgd"]["params"], strict=True)
    )
    assert diverged and rank0["torch_sgd"]["scale"] != rank1["torch_sgd"]["scale"]

    # No process group: rank 1 alone completed its run (no collective), and skipped on its own.
    alone = rank1["amp_graph_no_group"]
    assert alone["taken"] == expected_taken
    assert "amp_graph_no_group" not in rank0
    expected = _train_alone(torch.amp.GradScaler("cpu", init_scale=2.0**10))
    for a, b in zip(alone["params"], expected["params"], strict=True):
        assert torch.equal(a, b)


def test_process_group_survives_pickling_or_says_so() -> None:
    """One process (world size 1): the world group comes back after pickling; another group
    must be set again, and using the scaler before that is an error, not a silent no-op. With a
    group, an optimizer without gradients takes the group's decision instead of raising."""
    import pickle

    import pytest
    from scaler_helpers import make_data, make_model

    from amp_graph.scaler import GradScaler

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = make_data(1)[0]
        world = pickle.loads(pickle.dumps(GradScaler("cpu", process_group=dist.group.WORLD)))
        assert world._check.process_group is dist.group.WORLD

        custom = pickle.loads(pickle.dumps(GradScaler("cpu", process_group=dist.new_group([0]))))
        custom.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        with pytest.raises(RuntimeError, match="set_process_group"):
            custom.step(opt)
        custom.set_process_group(dist.new_group([0]))
        custom.step(opt)
        custom.update()
        assert bool(custom.last_step_taken)

        opt.zero_grad(set_to_none=True)  # no gradients at all on this rank
        world.scale(torch.ones(()))
        assert world.step(opt) is None and bool(world.last_step_taken)
        world.update()
    finally:
        dist.destroy_process_group()
