"""amp_graph.Graph's float16 training step on a GPU: host synchronizations per step, and the whole
step captured in a CUDA graph (bit-equal to the uncaptured step? how fast?).

    python benchmarks/graph_step_cuda.py                # needs a CUDA GPU
    python benchmarks/graph_step_cuda.py --json out.json

Setup: ``amp_graph.demo.models.MLP(1024, 4096, 10)`` with cross-entropy, batch 256, ``Graph`` with
policy O1 in float16 and ``amp_graph.GradScaler(init_scale=2**12, growth_interval=4)``,
``AdamW(lr=1e-3, fused=True, capturable=True)``, no LR scheduler (a scheduler sets the learning
rate from Python, which a replayed graph never sees). One batch of every 7 is multiplied by 1e6
so that its float16 forward overflows: the step must be skipped, captured or not. The MLP has
no embedding or attention, whose backward kernels may use atomics (not bit-reproducible).

* syncs/step: steady-state steps under ``torch.cuda.set_sync_debug_mode("warn")``, counting its
  warnings (every synchronizing CUDA call the step makes);
* captured: run A takes every step eagerly; run B takes ``warmup`` eager steps on a side stream,
  captures one step with ``torch.cuda.graph`` and replays it for the rest, each batch copied into
  static inputs first. Parameters, optimizer state and scaler state must be bit-equal at the end.
  Step times are medians over the timed steps (CUDA events), eager and replayed interleaved
  by round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from amp_graph.demo import models
from amp_graph.scaler import GradScaler
from amp_graph.training.nn_graph import Graph

BATCH, IN, HIDDEN, CLASSES = 256, 1024, 4096, 10
OVERFLOW_EVERY = 7


class MLPStep(Graph):
    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt)
        self.config.enable_amp(True, policy="O1", dtype=torch.float16)
        self.set_grad_scaler(GradScaler(init_scale=2.0**12, growth_interval=4))

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def make_step() -> tuple[MLPStep, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = models.MLP(IN, HIDDEN, CLASSES).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    return MLPStep(model, opt), model, opt


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x = torch.randn(BATCH, IN, generator=gen)
        if i % OVERFLOW_EVERY == OVERFLOW_EVERY - 1:
            x = x * 1e6  # float16 overflow in the forward: this step must be skipped
        out.append((x.cuda(), torch.randint(0, CLASSES, (BATCH,), generator=gen).cuda()))
    return out


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, step: MLPStep) -> list:
    """Everything a step changes: parameters, optimizer state, scale and its trackers."""
    tensors = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        tensors += [v.clone() for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    scaler = step.grad_scaler
    assert scaler is not None
    return [*tensors, torch.tensor(scaler.get_scale()), torch.tensor(scaler.skipped_steps)]


def syncs_per_step(steps: int = 10, warmup: int = 3) -> float:
    step, _, _ = make_step()
    data = batches(warmup + steps)
    for x, y in data[:warmup]:
        step(x, y)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for x, y in data[warmup:]:
                step(x, y)
            torch.ones((), device="cuda").item()  # one known synchronization, counted apart
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # each synchronizing call warns this; set_sync_debug_mode itself warns once that the mode
    # is a prototype ("Synchronization debug mode ..."), which is no synchronization
    syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    if not syncs:
        raise RuntimeError("the sync debug mode did not report a known .item(): nothing counted")
    return (len(syncs) - 1) / steps


def captured_vs_eager(steps: int = 28, warmup: int = 3) -> dict[str, Any]:
    """Runs A (eager) and B (warm-up, capture, replay) side by side, one step of each per round
    after B's capture, and compares their final states bit for bit."""
    data = batches(steps)
    eager, eager_model, eager_opt = make_step()
    replayed, model, opt = make_step()
    static_x, static_y = (t.clone() for t in data[0])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in data[:warmup]:
            static_x.copy_(x)
            static_y.copy_(y)
            replayed(static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    for x, y in data[:warmup]:
        eager(x, y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed(static_x, static_y)

    def replay(x: torch.Tensor, y: torch.Tensor) -> None:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()

    times: dict[str, list[float]] = {"eager": [], "captured": []}
    for x, y in data[warmup:]:
        for name, fn in (("eager", eager), ("captured", replay)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(x, y)
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    a, b = state_of(eager_model, eager_opt, eager), state_of(model, opt, replayed)
    bit_equal = len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    eager_ms = statistics.median(times["eager"])
    captured_ms = statistics.median(times["captured"])
    return {
        "bit_equal": bit_equal,
        "eager_ms": eager_ms,
        "captured_ms": captured_ms,
        "speedup": eager_ms / captured_ms,
        "skipped_steps": int(b[-1]),
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_step_cuda.py needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    result = {"syncs_per_step": syncs_per_step(), **captured_vs_eager()}
    print(f"host syncs per Graph step: {result['syncs_per_step']:g}")
    print(
        f"captured step: bit-equal to eager: {result['bit_equal']}; median "
        f"{result['captured_ms']:.3f} ms vs {result['eager_ms']:.3f} ms eager "
        f"({result['speedup']:.2f}x); skipped steps: {result['skipped_steps']}"
    )
    if args.json:
        args.json.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
