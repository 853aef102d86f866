"""DistributedDataParallel compiled with the backend, on 2 CPU processes (gloo).

Dynamo's DDPOptimizer splits the model's graph at DDP's bucket boundaries and hands each
piece to the backend, so this exercises several small graphs whose values cross from one
to the next. The compiled DDP model must train exactly like an uncompiled DDP model under
torch.autocast, and its parameters must stay identical across ranks."""

from __future__ import annotations

import itertools
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_helpers import end_rank, free_port, spawn_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

WORLD = 2
STEPS = 3


def _train(model, step_model, rank: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)  # each rank its own data
    losses = []
    for _ in range(STEPS):
        x = torch.randn(8, 512, generator=generator)
        y = torch.randint(0, 10, (8,), generator=generator)
        loss = F.cross_entropy(step_model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        from amp_graph.demo import models
        from amp_graph.frontends.dynamo_backend import backend, captured_graphs

        torch.manual_seed(0)
        model = models.MLP(in_features=512, hidden=512, classes=10)  # 2 MB: several buckets
        reference = models.MLP(in_features=512, hidden=512, classes=10)
        reference.load_state_dict(model.state_dict())

        amp_backend = backend("autocast", inner="aot_eager", check_each_pass=True)
        compiled = torch.compile(DDP(model, bucket_cap_mb=1), backend=amp_backend)
        losses = _train(model, compiled, rank)
        ref_ddp = DDP(reference, bucket_cap_mb=1)

        def autocast_step(x):
            with torch.autocast("cpu", torch.bfloat16):
                return ref_ddp(x)

        ref_losses = _train(reference, autocast_step, rank)

        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(WORLD)]
        dist.all_gather(gathered, flat)
        graphs = captured_graphs(compiled)
        boundary = []  # dtypes of values crossing from one bucket's graph to the next
        for before, after in itertools.pairwise(graphs):
            [outputs] = [n.meta["amp"].out_dtype for n in before.graph.nodes if n.op == "output"]
            inputs = [
                n.meta["val"].dtype
                for n in after.graph.nodes
                if n.op == "placeholder" and n.meta["amp"].role.value == "input"
            ]
            boundary.append([sorted(map(str, outputs)), sorted(map(str, inputs))])
        result = {
            "graphs": len(graphs),
            "exact": all(gm.meta["amp_graph"].exact for gm in graphs),
            "low_precision_ops": sum(
                n.meta["amp"].compute_dtype == torch.bfloat16
                for gm in graphs
                for n in gm.graph.nodes
            ),
            "same_on_all_ranks": all(torch.equal(gathered[0], t) for t in gathered),
            "max_diff_to_autocast": max(
                (p - q).abs().max().item()
                for p, q in zip(model.parameters(), reference.parameters(), strict=True)
            ),
            "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}),
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "losses": losses,
            "ref_losses": ref_losses,
            "boundary": boundary,
        }
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
            json.dump(result, file)
    finally:
        dist.destroy_process_group()
    end_rank()


def test_ddp_training_on_two_processes(tmp_path):
    spawn_ranks(_worker, (free_port(), str(tmp_path)), WORLD, tmp_path)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for result in results:
        assert result["graphs"] >= 2  # DDPOptimizer split the model at bucket boundaries
        assert result["exact"]
        assert result["low_precision_ops"] >= 3
        assert result["same_on_all_ranks"]
        assert result["grad_dtypes"] == result["param_dtypes"] == ["torch.float32"]
        assert result["max_diff_to_autocast"] <= 1e-5
        assert result["losses"] == result["ref_losses"]
        assert result["boundary"]
        for outputs, inputs in result["boundary"]:
            assert outputs == inputs  # what one graph returns, the next was compiled for
        assert ["torch.bfloat16"] in [inputs for _, inputs in result["boundary"]]
    assert results[0]["losses"] != results[1]["losses"]  # the ranks saw different data
