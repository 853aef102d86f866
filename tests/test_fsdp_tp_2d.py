"""torchtitan's 2-D recipe (FSDP2 over ``dp``, tensor parallelism over ``tp``) through
``amp_graph.Graph``, 4 gloo ranks on the CPU: a DCP checkpoint resumed, and ``plan_fsdp``'s
per-unit policies on the FSDP dimension.

What must hold, and why it can fail:

* A ``torch.distributed.checkpoint`` save of a Graph, loaded by a fresh Graph on the same
  mesh, continues the run bit for bit: losses, parameters, the AdamW moments, the LR
  schedule, the loss scale (float16, a scale that grows during the run). DCP loads in place
  into the state dict a Graph gives it; a fresh optimizer has no state to fill, so without
  amp_graph allocating it the moments would be dropped without a word and the resumed run
  would diverge from its second step on.
* ``plan_fsdp`` plans the tensor-parallel model before FSDP2 shards it over ``dp``: the units
  whose parameters the graph reads only in bf16 all-gather in bf16 (the bytes the plan says,
  about half), and training is bit for bit that of the same model sharded with float32
  all-gathers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from dist_helpers import spawn_scenario
from parallel_lm import full, lm_batches, parallel_lm

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without distributed")

SAVED_AFTER = 2  # steps before the checkpoint
STEPS_AFTER = 2  # steps after it


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def train_step(model: nn.Module, dtype: torch.dtype, optimizer: str = "sgd") -> Any:
    import amp_graph

    if optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    else:
        opt, schedule = torch.optim.SGD(model.parameters(), lr=0.5), None

    class TrainStep(amp_graph.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(opt, lr_sch=schedule)
            self.config.enable_amp(True, policy="O1", dtype=dtype)
            if dtype == torch.float16:  # grows every 2 steps: the resumed scale must too
                self.set_grad_scaler(amp_graph.GradScaler(init_scale=2.0**8, growth_interval=2))

        def build(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            loss = lm_loss(self.model(idx), target)
            loss.backward()
            return loss

    return TrainStep()


def dcp_resume(rank: int, dtype: torch.dtype) -> dict[str, Any]:
    import shutil
    import tempfile

    import torch.distributed.checkpoint as dcp

    mesh = _mesh()
    data = (lm_batches(mesh["dp"].get_local_rank()) * 2)[: SAVED_AFTER + STEPS_AFTER]

    def fresh() -> tuple[nn.Module, Any]:
        model = parallel_lm(mesh["tp"], dp_mesh=mesh["dp"])
        return model, train_step(model, dtype, "adamw")

    model, step = fresh()
    uninterrupted = [step(*batch).item() for batch in data]
    result: dict[str, Any] = {"uninterrupted": uninterrupted, "ref_params": full(model)}
    result["ref_state"] = _optimizer_state(step)
    result["ref_scale"] = _scale(step)

    model, step = fresh()
    before = [step(*batch).item() for batch in data[:SAVED_AFTER]]
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)  # one checkpoint directory, rank 0's
    dcp.save({"graph": step}, checkpoint_id=path[0])

    model, step = fresh()
    result["fresh_state_before_load"] = len(step.optimizers[0].state)
    dcp.load({"graph": step}, checkpoint_id=path[0])
    after = [step(*batch).item() for batch in data[SAVED_AFTER:]]
    result.update(
        resumed=before + after,
        params=full(model),
        state=_optimizer_state(step),
        scale=_scale(step),
        lr=step.optimizers[0].param_groups[0]["lr"],
        ref_lr=0.7 ** len(data) * 1e-2,
    )
    dist.barrier()  # every rank has read the checkpoint
    if rank == 0:
        shutil.rmtree(path[0])
    return result


def _optimizer_state(step: Any) -> dict[str, torch.Tensor]:
    """Every AdamW moment (the full tensors) and step count, by parameter index."""
    state = {}
    for index, values in step.optimizers[0].state_dict()["state"].items():
        for key, value in values.items():
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
            state[f"{index}.{key}"] = whole.detach().clone()
    return state


def _scale(step: Any) -> float | None:
    scaler = step.state_dict()["scaler"]
    return None if scaler is None else scaler["scale"]


def planned(rank: int) -> dict[str, Any]:
    import amp_graph
    from amp_graph.inspect.traffic import CollectiveBytes

    mesh = _mesh()
    data = lm_batches(mesh["dp"].get_local_rank())
    result: dict[str, Any] = {}
    for variant in ("plain", "planned"):
        if variant == "plain":
            model = parallel_lm(mesh["tp"], dp_mesh=mesh["dp"])
        else:
            model = parallel_lm(mesh["tp"])  # tensor parallel, not yet sharded over dp
            plan = amp_graph.plan_fsdp(
                model,
                [*model.layers, model],
                "O1",
                torch.bfloat16,
                example_inputs=(data[0][0],),
                split_mixed=True,
            )
            plan.fully_shard(mesh=mesh["dp"])
            result["plan"] = str(plan)
            result["planned_ratio"] = plan.all_gather_ratio
        step = train_step(model, torch.bfloat16)
        losses = [step(*batch).item() for batch in data[:-1]]
        with CollectiveBytes() as counted:  # FSDP2's all-gathers (TP's are functional)
            losses.append(step(*data[-1]).item())
        result[variant] = {"losses": losses, "params": full(model), "gathered": counted.all_gather}
    return result


SCENARIOS = {
    "dcp_resume_bf16": lambda rank: dcp_resume(rank, torch.bfloat16),
    "dcp_resume_fp16": lambda rank: dcp_resume(rank, torch.float16),
    "planned": planned,
}


def run(scenario: str, tmp_path: Path) -> list[Any]:
    return spawn_scenario(__name__, scenario, tmp_path, world=4)


# ---- the tests ----


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_dcp_checkpoint_of_a_2d_graph_resumes_bit_for_bit(tmp_path: Path, dtype: str) -> None:
    for result in run(f"dcp_resume_{dtype}", tmp_path):
        assert result["fresh_state_before_load"] == 0  # the fresh Graph's optimizer: no state
        assert result["resumed"] == result["uninterrupted"]
        for name, value in result["ref_params"].items():
            assert torch.equal(result["params"][name], value), name
        assert result["state"].keys() == result["ref_state"].keys()
        assert any(key.endswith("exp_avg_sq") for key in result["state"])
        for key, value in result["ref_state"].items():
            assert torch.equal(result["state"][key], value), key
        assert result["lr"] == pytest.approx(result["ref_lr"])
        assert result["scale"] == result["ref_scale"]
        if dtype == "fp16":
            assert result["scale"] == 2.0**10  # grown twice in 4 steps: not the initial scale


def test_plan_fsdp_on_a_2d_mesh_gathers_low_and_trains_the_same_bits(tmp_path: Path) -> None:
    for result in run("planned", tmp_path):
        plain, planned = result["plain"], result["planned"]
        assert planned["losses"] == plain["losses"]
        for name, value in plain["params"].items():
            assert torch.equal(planned["params"][name], value), name
        ratio = planned["gathered"] / plain["gathered"]
        assert ratio <= 0.6, ratio
        assert abs(ratio - result["planned_ratio"]) < 0.02, (ratio, result["planned_ratio"])
        plan = result["plan"]
        assert "layers.0.attention: 4 parameters, all-gather bf16" in plan, plan
        assert "layers.0.feed_forward: 4 parameters, all-gather bf16" in plan, plan
