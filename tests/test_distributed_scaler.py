"""found_inf is all-reduced (MAX) across ranks: 2 CPU processes with gloo, inf on rank 1 only.

Each rank trains the same model on its own data; gradients are averaged by hand (like DDP) and
*then* rank 1 alone gets an inf, so only a scaler that all-reduces found_inf keeps the ranks in
step. torch.amp.GradScaler, which does not, is run the same way to show the test can fail.
"""

from __future__ import annotations

import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

POISONED_ITER = 2
N_ITERS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(rank: int, scaler, make_optimizer) -> dict:
    from scaler_helpers import make_data, make_model

    model = make_model(seed=0)  # same initial parameters on every rank
    opt = make_optimizer(model.parameters())
    taken = []
    for i, (x, y) in enumerate(make_data(N_ITERS, seed=100 + rank)):  # per-rank data
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        for p in model.parameters():
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

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        runs = {
            "amp_graph_sgd": _train(
                rank, GradScaler("cpu", init_scale=2.0**10), lambda p: torch.optim.SGD(p, lr=0.1)
            ),
            "amp_graph_fused_adam": _train(
                rank,
                GradScaler("cpu", init_scale=2.0**10, process_group=dist.group.WORLD),
                lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
            ),
            "torch_sgd": _train(
                rank,
                torch.amp.GradScaler("cpu", init_scale=2.0**10),
                lambda p: torch.optim.SGD(p, lr=0.1),
            ),
        }
        torch.save(runs, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_all_ranks_skip_together(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
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
