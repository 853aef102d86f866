"""FSDP2 (``fully_shard``) with amp_graph.GradScaler: 2 CPU processes with gloo, float16 compute.

FSDP2 hands out DTensor gradient shards (Shard(0) over a 1-D mesh). Rank 1's shard alone gets an
inf at step 3; the scaler must check every shard and reduce found_inf over the mesh by itself
(no process_group given), so both ranks skip, keep identical full parameters, and end exactly
where a run that skipped step 3 by hand ends. A scaler that decided per rank would let rank 0
step with its shard and the full parameters would differ from that run.

The same processes check ``unscale_and_clip_grad_norm_`` on sharded gradients against
``unscale_`` followed by torch's DTensor-aware ``clip_grad_norm_`` (a global norm).
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from dist_helpers import end_rank, free_port, spawn_ranks

WORLD = 2
STEPS = 6
POISONED_STEP = 3
INIT_SCALE = 2.0**10


def _sharded_model() -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)  # the same full parameters on every rank before sharding
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU()
    )
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for layer in (model[0], model[2]):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return [
        (torch.randn(4, 8, generator=gen), torch.randn(4, 16, generator=gen)) for _ in range(STEPS)
    ]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _train(rank: int, poison: bool) -> dict:
    """``poison``: rank 1's shard gets an inf at POISONED_STEP and the scaler decides. Else
    POISONED_STEP is skipped by hand, with the scale backed off as an overflow would."""
    from amp_graph.scaler import GradScaler

    model = _sharded_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = GradScaler(init_scale=INIT_SCALE, growth_interval=1000)
    taken = []
    for step, (x, y) in enumerate(_batches(rank)):
        opt.zero_grad()
        if step == POISONED_STEP and not poison:
            scaler.update(scaler.get_scale() * 0.5)
            continue
        scaler.scale(_loss(model, x, y)).backward()
        if step == POISONED_STEP and rank == 1:
            model[2].weight.grad.to_local()[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        taken.append(bool(scaler.last_step_taken))
    full = [p.full_tensor().detach().clone() for p in model.parameters()]
    return {
        "params": full,
        "taken": taken,
        "scale": scaler.get_scale(),
        "skipped": scaler.skipped_steps,
        "sharded": all(type(p.grad).__name__ == "DTensor" for p in model.parameters()),
    }


def _clip_check(rank: int) -> dict:
    """Our fused unscale+norm+clip vs unscale_ then torch's clip_grad_norm_, same gradients."""
    from amp_graph.scaler import GradScaler

    model = _sharded_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ours, theirs = GradScaler(init_scale=INIT_SCALE), GradScaler(init_scale=INIT_SCALE)
    x, y = _batches(rank)[0]
    ours.scale(_loss(model, x, y)).backward()
    theirs.scale(torch.ones(()))  # the same scale, created without a second backward
    scaled = [p.grad.to_local().clone() for p in model.parameters()]
    our_norm = ours.unscale_and_clip_grad_norm_(opt, max_norm=0.01)
    our_grads = [p.grad.to_local().clone() for p in model.parameters()]
    for p, g in zip(model.parameters(), scaled, strict=True):
        p.grad.to_local().copy_(g)
    theirs.unscale_(opt)
    their_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.01)
    their_grads = [p.grad.to_local().clone() for p in model.parameters()]
    return {
        "norms": (our_norm.item(), their_norm.full_tensor().item()),
        "grads": (our_grads, their_grads),
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
        result = {
            "poisoned": _train(rank, poison=True),
            "skipped_by_hand": _train(rank, poison=False),
            "clip": _clip_check(rank),
        }
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    end_rank()


def test_fsdp2_ranks_skip_a_step_poisoned_on_one_shard(tmp_path: Path) -> None:
    spawn_ranks(_worker, (free_port(), str(tmp_path)), WORLD, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    for result in ranks:
        run = result["poisoned"]
        assert run["sharded"], "FSDP2 should hand out DTensor gradients"
        assert run["taken"] == [step != POISONED_STEP for step in range(STEPS)]
        assert run["skipped"] == 1
        assert run["scale"] == INIT_SCALE / 2 == result["skipped_by_hand"]["scale"]
        # Exactly where a run that skipped the step ends.
        for a, b in zip(run["params"], result["skipped_by_hand"]["params"], strict=True):
            assert torch.equal(a, b)
    for a, b in zip(ranks[0]["poisoned"]["params"], ranks[1]["poisoned"]["params"], strict=True):
        assert torch.equal(a, b)

    for result in ranks:
        ours, theirs = result["clip"]["norms"]
        assert ours > 0.01  # the clip was active
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)
        for a, b in zip(*result["clip"]["grads"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)
