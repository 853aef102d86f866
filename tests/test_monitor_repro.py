"""The monitor's repro bundle of the first skipped step, and amp_graph.replay (issue 25).

A float16 Graph with a loss scaler, BatchNorm (buffers the forward writes), dropout (the RNG),
AdamW and an LR schedule trains on batches of which the third overflows float16. The bundle
must hold the state of before that step (checked against a snapshot taken then), and the
replay must rerun it bit for bit and name where it broke.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import amp_graph

HOT_STEP = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.norm(self.fc1(x)))))


class TrainStep(amp_graph.Graph):
    """Built with no arguments, as replay() builds the recorded class."""

    def __init__(self, accumulation: int = 1, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Net()
        with torch.no_grad():
            self.model.fc1.weight.mul_(4.0)
        opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.add_optimizer(opt, lr_sch=torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
        self.config.enable_amp(True, policy="O1", dtype=dtype)
        if dtype == torch.float16:
            self.set_grad_scaler(amp_graph.GradScaler(init_scale=2.0**8))
        if accumulation > 1:
            self.config.set_gradient_accumulation_steps(accumulation)

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self.model(x).float(), y)
        loss.backward()
        return loss


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for step in range(4):
        x = torch.randn(8, 16, generator=gen)
        if step == HOT_STEP:
            x = x * 1e4  # fits float16; fc1's float16 output does not
        out.append((x, torch.randint(0, 4, (8,), generator=gen)))
    return out


def _tensors_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_tensors_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def train(tmp_path: Path, graph: TrainStep) -> tuple[amp_graph.Monitor, dict]:
    monitor = graph.config.enable_monitor(every=2, repro_dir=tmp_path / "repro")
    before_hot = None
    for step, (x, y) in enumerate(batches()):
        if step == HOT_STEP:
            before_hot = copy.deepcopy(graph.state_dict())
        graph(x, y)
    monitor.close()
    assert before_hot is not None
    return monitor, before_hot


def test_the_bundle_holds_the_state_before_the_skipped_step(tmp_path) -> None:
    graph = TrainStep()
    monitor, before_hot = train(tmp_path, graph)
    assert graph.skipped_steps == 1
    # after the first step only the buffers the step writes are copied per step
    norm = {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}
    assert monitor.repro._written == {("model", key) for key in norm}
    path = monitor.repro_path
    assert path == tmp_path / "repro" / f"step_{HOT_STEP}"
    names = {"batch.pt", "rng.pt", "state.pt", "step_result.pt", "policy.txt", "graph.txt"}
    assert names | {"meta.json"} <= {p.name for p in path.iterdir()}
    state = torch.load(path / "state.pt", weights_only=False)
    # modules (BatchNorm's running statistics included), optimizers (AdamW's moments and the
    # scheduled LR), scheduler, scaler, step: as before the step, though the step changed
    # the buffers, the LR, the scale
    assert _tensors_equal(state, before_hot)
    assert not _tensors_equal(graph.state_dict()["modules"], before_hot["modules"])
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == HOT_STEP and meta["skipped_by"] == "scaler"
    assert meta["loss_scale"] == before_hot["scaler"]["scale"]
    batch = torch.load(path / "batch.pt", weights_only=False)
    assert torch.equal(batch[0], batches()[HOT_STEP][0])
    assert "fp16" in (path / "graph.txt").read_text()


def test_replay_reruns_the_step_bit_for_bit_and_names_where_it_broke(tmp_path) -> None:
    monitor, _ = train(tmp_path, TrainStep())
    result = amp_graph.replay(monitor.repro_path, TrainStep())
    assert result.skipped and result.reproduced, result.mismatches
    assert result.first_nonfinite is not None and "model.fc1" in result.first_nonfinite
    text = str(result)
    assert "bit for bit" in text and "first non-finite node" in text
    # without a graph, replay builds the recorded class (this module's TrainStep())
    assert amp_graph.replay(monitor.repro_path, numerics=False).reproduced


def test_replay_sees_a_different_step(tmp_path) -> None:
    """The bit-for-bit check can fail: a batch edited after the fact is not the step run."""
    monitor, _ = train(tmp_path, TrainStep())
    batch_file = monitor.repro_path / "batch.pt"
    x, y = torch.load(batch_file, weights_only=False)
    torch.save((x * 1.5, y), batch_file)
    result = amp_graph.replay(monitor.repro_path, TrainStep(), numerics=False)
    # the loss and every gradient are NaN either way: BatchNorm's statistics tell them apart
    assert result.skipped and not result.reproduced
    assert "buffer model.norm.running_mean" in result.mismatches


def test_replay_command(tmp_path) -> None:
    monitor, _ = train(tmp_path, TrainStep())
    factory = tmp_path / "make.py"
    factory.write_text(
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_monitor_repro import TrainStep\n"
        "def make():\n    return TrainStep()\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "amp_graph",
            "replay",
            str(monitor.repro_path),
            "--graph",
            f"{factory}:make",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "bit for bit" in done.stdout and "model.fc1" in done.stdout


def test_no_bundle_without_a_skip_and_errors(tmp_path) -> None:
    graph = TrainStep()
    monitor = graph.config.enable_monitor(repro_dir=tmp_path / "none")
    graph(*batches()[0])
    graph(*batches()[1])
    monitor.close()
    assert monitor.repro_path is None and not (tmp_path / "none").exists()
    compiled = amp_graph.compile(Net(), policy="O1")
    with pytest.raises(ValueError, match=r"repro_dir= on a compiled module needs scaler="):
        amp_graph.monitor(compiled, repro_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="not a repro bundle"):
        amp_graph.replay(tmp_path)


class GuardedStep(TrainStep):
    """bfloat16: no loss scale; the non-finite guard skips the step instead."""

    def __init__(self) -> None:
        super().__init__(dtype=torch.bfloat16)


def test_the_bf16_guards_skip_writes_a_bundle_too(tmp_path) -> None:
    graph = GuardedStep()
    monitor = graph.config.enable_monitor(every=5, repro_dir=tmp_path)
    for step, (x, y) in enumerate(batches()):
        if step == HOT_STEP:
            x = x.clone()
            x[0, 0] = 3.4e38  # finite in float32, rounds to inf in bfloat16
        graph(x, y)
    assert graph.skipped_steps == 1 and graph.grad_scaler is None
    meta = json.loads((monitor.repro_path / "meta.json").read_text())
    assert meta["skipped_by"] == "nonfinite guard" and meta["loss_scale"] is None
    result = amp_graph.replay(monitor.repro_path, GuardedStep())
    assert result.skipped and result.reproduced, result.mismatches
    assert result.first_nonfinite == "forward: 'x_bf16' (cast in module '<root>')"
