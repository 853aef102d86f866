"""The repro bundle for users of ``amp_graph.compile`` in their own training loop (issue 39,
part 3), and ``amp_graph.replay(path, model=..., optimizer=...)``.

The loop is torch's AMP recipe: ``zero_grad``, the compiled module's forward, a loss,
``scaler.scale(loss).backward()``, ``scaler.step(opt)``, ``scaler.update()``, an LR
schedule; the model has BatchNorm (buffers the forward writes) and dropout (the RNG). The
third batch overflows float16, so the scaler skips that step. The bundle must hold the state
of before that step (checked against a snapshot taken then), and the replay must rerun the
forward and backward bit for bit and name where it broke.
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
from test_monitor_repro import HOT_STEP, Net, batches

import amp_graph

SCALERS = {
    "torch GradScaler": lambda: torch.amp.GradScaler("cpu", init_scale=2.0**8),
    "amp_graph GradScaler": lambda: amp_graph.GradScaler(init_scale=2.0**8),
}


def _model() -> Net:
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.fc1.weight.mul_(4.0)
    return model


def _optimizer(model: nn.Module):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)


def train(tmp_path, make_scaler, *, set_to_none: bool = True, steps=None):
    """Train as torch's recipe does; returns (monitor, the snapshot of before HOT_STEP)."""
    model = _model()
    opt, sched = _optimizer(model)
    scaler = make_scaler()
    compiled = amp_graph.compile(model, "O1", torch.float16)
    monitor = amp_graph.monitor(
        compiled, every=1, repro_dir=tmp_path, scaler=scaler, optimizer=opt, scheduler=sched
    )
    before = None
    for step, (x, y) in enumerate(batches()[:steps]):
        if step == HOT_STEP:
            before = copy.deepcopy(
                {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "sched": sched.state_dict(),
                }
            )
        opt.zero_grad(set_to_none=set_to_none)
        loss = nn.functional.cross_entropy(compiled(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    monitor.close()
    return monitor, before


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("make_scaler", SCALERS.values(), ids=SCALERS.keys())
def test_the_bundle_of_a_compiled_loop_holds_the_state_before_the_skipped_step(
    tmp_path, make_scaler
):
    monitor, before = train(tmp_path, make_scaler)
    path = monitor.repro_path
    assert path == tmp_path / f"step_{HOT_STEP}"
    names = {"batch.pt", "rng.pt", "state.pt", "step_result.pt", "policy.txt", "graph.txt"}
    assert names | {"meta.json"} <= {p.name for p in path.iterdir()}
    meta = json.loads((path / "meta.json").read_text())
    assert meta["kind"] == "compile" and meta["step"] == HOT_STEP and meta["grads_kept"]
    state = torch.load(path / "state.pt", weights_only=False)
    # parameters and BatchNorm's statistics, AdamW's moments, the scheduled LR: as before
    assert _equal(state["model"], before["model"])
    assert _equal(state["optimizer"], before["optimizer"])
    assert _equal(state["scheduler"], before["sched"])
    assert state["scaler"]["scale"] == 2.0**8  # no skip before: the initial scale
    args, kwargs = torch.load(path / "batch.pt", weights_only=False)
    assert torch.equal(args[0], batches()[HOT_STEP][0]) and kwargs == {}
    result = torch.load(path / "step_result.pt", weights_only=False)
    assert result["output_grads"][0] is not None  # the loss's gradient into the output
    assert any(not g.isfinite().all() for g in result["grads"].values())


@pytest.mark.parametrize("make_scaler", SCALERS.values(), ids=SCALERS.keys())
def test_replay_reruns_forward_and_backward_bit_for_bit_and_names_where_it_broke(
    tmp_path, make_scaler
):
    monitor, before = train(tmp_path, make_scaler)
    model = _model()
    opt, _ = _optimizer(model)
    result = amp_graph.replay(monitor.repro_path, model=model, optimizer=opt)
    assert result.skipped and result.reproduced, result.mismatches
    assert result.first_nonfinite is not None and "fc1" in result.first_nonfinite
    assert result.first_nonfinite.startswith("forward")
    assert "bit for bit" in str(result)
    assert _equal(model.state_dict(), before["model"])  # the state of before the step
    assert _equal(opt.state_dict(), before["optimizer"])
    assert all(p.grad is None for p in model.parameters())


def test_replay_sees_a_different_step(tmp_path):
    """The bit-for-bit check can fail: a batch edited after the fact is not the step run."""
    monitor, _ = train(tmp_path, SCALERS["torch GradScaler"])
    batch_file = monitor.repro_path / "batch.pt"
    (x,), kwargs = torch.load(batch_file, weights_only=False)
    torch.save(((x * 1.5,), kwargs), batch_file)
    result = amp_graph.replay(monitor.repro_path, model=_model(), numerics=False)
    # the output and every gradient are NaN either way: BatchNorm's statistics tell them apart
    assert result.skipped and not result.reproduced
    assert "buffer norm.running_mean" in result.mismatches


def test_gradients_zeroed_in_place_are_still_compared(tmp_path):
    """The bundle keeps copies: zero_grad(set_to_none=False) at the next call cannot reach
    them (tests/test_monitor_repro_scaled.py: finite gradients, unscaled in place)."""
    monitor, _ = train(tmp_path, SCALERS["torch GradScaler"], set_to_none=False)
    meta = json.loads((monitor.repro_path / "meta.json").read_text())
    assert meta["grads_kept"] and not meta["note"]
    result = amp_graph.replay(monitor.repro_path, model=_model(), numerics=False)
    assert result.reproduced and not result.note


def test_no_bundle_without_a_skip(tmp_path):
    monitor, _ = train(tmp_path / "none", SCALERS["torch GradScaler"], steps=HOT_STEP)
    assert monitor.repro_path is None and not (tmp_path / "none").exists()


def test_a_compiled_modules_repro_needs_its_scaler_and_optimizer(tmp_path):
    model = _model()
    opt, _ = _optimizer(model)
    scaler = torch.amp.GradScaler("cpu")
    compiled = amp_graph.compile(model, "O1", torch.float16)
    with pytest.raises(ValueError, match="needs scaler="):
        amp_graph.monitor(compiled, repro_dir=tmp_path, optimizer=opt)
    with pytest.raises(ValueError, match="needs optimizer="):
        amp_graph.monitor(compiled, repro_dir=tmp_path, scaler=scaler)
    with pytest.raises(ValueError, match="go with repro_dir="):
        amp_graph.monitor(compiled, optimizer=opt)
    with pytest.raises(TypeError, match="scheduler= is the optimizer's LR scheduler"):
        amp_graph.monitor(compiled, repro_dir=tmp_path, scaler=scaler, optimizer=opt, scheduler=1)
    monitor, _ = train(tmp_path / "run", SCALERS["torch GradScaler"])
    with pytest.raises(TypeError, match="pass model="):
        amp_graph.replay(monitor.repro_path, amp_graph.Graph())


def test_detach_takes_the_hooks_off(tmp_path):
    model = _model()
    opt, _ = _optimizer(model)
    compiled = amp_graph.compile(model, "O1", torch.float16)
    scaler = torch.amp.GradScaler("cpu")
    monitor = amp_graph.monitor(compiled, repro_dir=tmp_path, scaler=scaler, optimizer=opt)
    assert compiled._forward_pre_hooks and compiled._forward_hooks
    monitor.detach()
    assert not compiled._forward_pre_hooks and not compiled._forward_hooks
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_replay_command_takes_a_model_factory(tmp_path):
    monitor, _ = train(tmp_path, SCALERS["amp_graph GradScaler"])
    factory = tmp_path / "make.py"
    factory.write_text(
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_monitor_repro_compiled import _model\n"
        "def make():\n    return _model()\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "amp_graph", "replay", str(monitor.repro_path),
         "--model", f"{factory}:make"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "bit for bit" in done.stdout and "first non-finite node: forward" in done.stdout
