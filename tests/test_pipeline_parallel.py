"""amp_graph under ``torch.distributed.pipelining``, gloo ranks on the CPU: one module compiled
with ``amp_graph.compile`` per stage, trained by torch's ``ScheduleGPipe`` and
``Schedule1F1B``; 2 ranks for 2 stages, 4 for 2 stages of 2 tensor-parallel ranks (TP x PP).

The oracle is the same pipeline whose stages run eagerly under ``torch.autocast``, from the
same initialization and data, with the same schedule.

What must hold, and why it can fail:

* bfloat16: each stage's graph computes what autocast computes (the first loss bit for bit,
  the parameters after three SGD steps within bf16 rounding). The schedule runs the stage's
  forward on microbatches, sends its low-precision output, and calls backward itself: a
  capture that dropped a gradient, or a boundary dtype that differed, shows in the last
  stage's loss and in the first stage's parameters.
* float16 with amp_graph's scaler (``amp_graph.scaler.pipeline_loss``): the schedule calls
  backward on the scaled loss, so every earlier stage receives gradients scaled by the last
  stage's scale, and unscales them with its own scaler. A gradient that overflows on the
  first stage only (which never scales a loss) makes every stage skip that step: parameters
  unchanged on every rank, the scale halved on every rank. A stage that skipped alone would
  leave the stages training different models; a stage that could not unscale would raise.
* Misuse is refused before training: a scaler whose group misses a stage, or no group.
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
from parallel_lm import LM, full, lm_batches, parallel_lm

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without distributed")

N_MICROBATCHES = 2
STAGES = 2
LR = 0.5  # SGD: a parameter moves by LR x its gradient, so a wrong gradient shows
POISONED_STEP = 1
INIT_SCALE = 2.0**10


class FirstStage(nn.Module):
    def __init__(self, lm: LM) -> None:
        super().__init__()
        self.tok_embeddings = lm.tok_embeddings
        self.layer = lm.layers[0]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.layer(self.tok_embeddings(idx))


class LastStage(nn.Module):
    def __init__(self, lm: LM) -> None:
        super().__init__()
        self.layer = lm.layers[1]
        self.norm = lm.norm
        self.output = lm.output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(self.layer(x)))


class UnderAutocast(nn.Module):
    """The oracle's stage: the module run eagerly under torch.autocast."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", self.dtype):
            return self.module(x)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def stage_module(stage_index: int, tp_mesh: Any = None) -> nn.Module:
    """This stage's part of the LM (tensor-parallel over ``tp_mesh`` when given), from the
    same initialization on every rank."""
    if tp_mesh is None:
        torch.manual_seed(0)
        lm = LM()
    else:
        lm = parallel_lm(tp_mesh)
    return FirstStage(lm) if stage_index == 0 else LastStage(lm)


def train(
    stage_index: int,
    group: Any,
    schedule: str,
    dtype: torch.dtype,
    runner: str,
    tp_mesh: Any = None,
    poison: bool = False,
) -> dict[str, Any]:
    """Train this rank's stage for the data's steps; ``runner`` is "amp_graph" (the stage
    compiled, O1) or "autocast" (eager). float16 scales the loss with pipeline_loss;
    ``poison`` puts an inf in one gradient of this rank at POISONED_STEP."""
    from torch.distributed import pipelining

    import amp_graph
    from amp_graph.scaler import GradScaler, pipeline_loss

    module = stage_module(stage_index, tp_mesh)
    if runner == "amp_graph":
        run = amp_graph.compile(module, "O1", dtype)
    else:
        run = UnderAutocast(module, dtype)
    stage = pipelining.PipelineStage(run, stage_index, STAGES, torch.device("cpu"), group=group)
    scaler = None
    stage_loss: Any = loss_fn
    if dtype == torch.float16:
        scaler = GradScaler(init_scale=INIT_SCALE, process_group=dist.group.WORLD)
        stage_loss = pipeline_loss(scaler, loss_fn, stage)
    scheduler = getattr(pipelining, schedule)(
        stage, n_microbatches=N_MICROBATCHES, loss_fn=stage_loss
    )
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    result: dict[str, Any] = {"losses": [], "taken": []}
    for step, (idx, target) in enumerate(lm_batches(0)):
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if stage_index == 0:
            scheduler.step(idx)
        else:
            scheduler.step(target=target, losses=losses)
        if step == POISONED_STEP:
            result["before_poisoned_step"] = full(module)
            if poison:
                grad = module.layer.attention.wq.weight.grad
                (grad.to_local() if hasattr(grad, "to_local") else grad)[0, 0] = float("inf")
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
            result["taken"].append(bool(scaler.last_step_taken))
            losses = stage_loss.unscale(losses)
        if step == POISONED_STEP:
            result["after_poisoned_step"] = full(module)
        result["losses"].append([loss.item() for loss in losses])
    result["params"] = full(module)
    result["scale"] = scaler.get_scale() if scaler is not None else None
    return result


def _layout(tensor_parallel: bool) -> tuple[int, Any, Any]:
    """(this rank's stage, the pipeline group, the tensor-parallel mesh or None)."""
    if not tensor_parallel:
        return dist.get_rank(), None, None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (STAGES, 2), mesh_dim_names=("pp", "tp"))
    return mesh["pp"].get_local_rank(), mesh["pp"].get_group(), mesh["tp"]


def pipelined(
    rank: int, schedule: str, dtype: torch.dtype, tensor_parallel: bool = False
) -> dict[str, Any]:
    stage_index, group, tp_mesh = _layout(tensor_parallel)
    # float16: the first stage's last rank overflows (the first stage never scales a loss)
    poison = dtype == torch.float16 and rank == dist.get_world_size() // STAGES - 1
    return {
        runner: train(stage_index, group, schedule, dtype, runner, tp_mesh, poison)
        for runner in ("amp_graph", "autocast")
    } | {"stage": stage_index}


def refusals(rank: int) -> dict[str, str]:
    """pipeline_loss with a scaler that would let a stage skip alone."""
    from torch.distributed import pipelining

    from amp_graph.scaler import GradScaler, pipeline_loss

    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    stage = pipelining.PipelineStage(stage_module(rank), rank, STAGES, torch.device("cpu"))
    messages = {}
    for case, scaler, given in (
        ("no group", GradScaler(), stage),
        ("group misses a stage", GradScaler(process_group=alone), stage),
        ("not a stage", GradScaler(process_group=dist.group.WORLD), stage.submod),
    ):
        try:
            pipeline_loss(scaler, loss_fn, given)
            messages[case] = "accepted"
        except (ValueError, TypeError) as error:
            messages[case] = f"{type(error).__name__}: {error}"
    dist.barrier()  # rank 0 holds the rendezvous store: it must not leave first
    return messages


SCENARIOS = {
    f"{dtype}_{schedule}{'_tp' if tp else ''}": (
        lambda rank, s=schedule, d=dtype, t=tp: pipelined(rank, s, getattr(torch, d), t)
    )
    for schedule in ("ScheduleGPipe", "Schedule1F1B")
    for dtype in ("bfloat16", "float16")
    for tp in (False, True)
} | {"refusals": refusals}


def run(scenario: str, tmp_path: Path, world: int = 2) -> list[Any]:
    return spawn_scenario(__name__, scenario, tmp_path, world)


def _assert_as_autocast(result: dict[str, Any]) -> None:
    ours, ref = result["amp_graph"], result["autocast"]
    if result["stage"] == STAGES - 1:  # the last stage computes the losses
        assert ours["losses"][0] == ref["losses"][0]
        torch.testing.assert_close(
            torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=1e-3, atol=0
        )
    assert ours["params"].keys() == ref["params"].keys()
    for name, value in ours["params"].items():
        assert torch.isfinite(value).all(), name
        torch.testing.assert_close(value, ref["params"][name], rtol=0, atol=2e-3)


# ---- the tests ----


@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B"])
def test_bf16_stages_train_as_autocast(tmp_path: Path, schedule: str) -> None:
    ranks = run(f"bfloat16_{schedule}", tmp_path)
    for result in ranks:
        _assert_as_autocast(result)
        assert result["amp_graph"]["scale"] is None


@pytest.mark.parametrize(
    "scenario, world",
    [("float16_ScheduleGPipe", 2), ("float16_Schedule1F1B", 2), ("float16_Schedule1F1B_tp", 4)],
)
def test_fp16_overflow_on_the_first_stage_skips_the_step_on_every_stage(
    tmp_path: Path, scenario: str, world: int
) -> None:
    ranks = run(scenario, tmp_path, world)
    for result in ranks:
        _assert_as_autocast(result)
        for runner in ("amp_graph", "autocast"):
            trained = result[runner]
            assert trained["taken"] == [True, False, True], (runner, result["stage"])
            assert trained["scale"] == INIT_SCALE / 2  # halved once, by the one skip
            before, after = trained["before_poisoned_step"], trained["after_poisoned_step"]
            for name, value in before.items():
                assert torch.equal(value, after[name]), (runner, result["stage"], name)
    stages = {result["stage"] for result in ranks}
    assert stages == {0, 1}


def test_tensor_parallel_stages_train_as_autocast(tmp_path: Path) -> None:
    ranks = run("bfloat16_ScheduleGPipe_tp", tmp_path, world=4)
    for result in ranks:
        _assert_as_autocast(result)
    # the two tensor-parallel ranks of a stage hold one stage: equal full parameters
    for first, second in ((ranks[0], ranks[1]), (ranks[2], ranks[3])):
        assert first["stage"] == second["stage"]
        for name, value in first["amp_graph"]["params"].items():
            assert torch.equal(value, second["amp_graph"]["params"][name]), name


def test_pipeline_loss_refuses_a_scaler_that_lets_a_stage_skip_alone(tmp_path: Path) -> None:
    for rank, messages in enumerate(run("refusals", tmp_path)):
        no_group = messages["no group"]
        assert no_group.startswith("ScalerArgumentError") and "process_group" in no_group
        assert "dist.group.WORLD" in no_group
        missing = messages["group misses a stage"]
        assert f"ranks [{1 - rank}]" in missing and "dist.group.WORLD" in missing, missing
        assert messages["not a stage"].startswith("TypeError"), messages["not a stage"]
        assert "PipelineStage" in messages["not a stage"]


def test_unscaled_losses_are_the_losses_also_after_the_scale_changed() -> None:
    from amp_graph.scaler import GradScaler, PipelineLoss

    scaler = GradScaler(init_scale=INIT_SCALE)
    stage_loss = PipelineLoss(scaler, loss_fn)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 8, 64, generator=gen)
    target = torch.randint(0, 64, (2, 8), generator=gen)
    losses = [stage_loss(logits, target)]
    expected = loss_fn(logits, target)
    assert torch.equal(losses[0], expected * INIT_SCALE)
    scaler.update(INIT_SCALE / 8)  # as after a skip, before the losses are read
    assert torch.equal(stage_loss.unscale(losses)[0], expected)
    disabled = PipelineLoss(GradScaler(enabled=False), loss_fn)
    assert torch.equal(disabled.unscale([disabled(logits, target)])[0], expected)
