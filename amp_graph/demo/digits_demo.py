"""``make demo`` / ``amp-graph demo``: amp_graph's training Graph on a real dataset.

Trains a small ResNet-style ConvNet (with BatchNorm) on scikit-learn's handwritten digits
(shipped inside the scikit-learn wheel) from one initialization on the same batches, with
fused AdamW, four ways:

* float32, a plain eager loop;
* a hand-written ``torch.autocast`` (+ ``torch.amp.GradScaler`` for float16) loop;
* ``amp_graph.Graph`` with policy O1 (the whole step as one graph);
* ``amp_graph.Graph`` with policy O2 (low-precision weights, float32 master weights);

and with ``--compile`` two more: ``torch.compile`` + ``torch.autocast`` by hand, and the O2
Graph with ``config.enable_compile()`` (inductor). The runs take their steps in turn (step
1 of every run in a shuffled order, then step 2, ...), so that their times are measured side
by side. Then it prints test accuracy, median step time and its ratio to fp32 and to
torch.autocast, the bytes of parameters, gradients and master weights, the skipped steps,
and the cast report of O1.

By default the demo is quick on any CPU (about half a minute of training): after a few
warm-up steps (which capture the Graphs) it takes as many steps as fit its time budget,
measured as they run, and from the median step times says whether bfloat16 is slow here
(emulated, or without a fast kernel for these layers) and what that means for the ratios.
``--full`` is the long run (300 steps of 128, width 32); ``--steps N`` fixes the number of
steps.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_graph
from amp_graph.demo import models
from amp_graph.demo.digits import Split, batches, load_digits

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
LEARNING_RATE = 1e-2  # reaches ~95% test accuracy in the quick demo's ~40-200 steps
WARMUP_STEPS = 3  # timed before choosing the number of steps; the first one also captures
SLOW_LOW_PRECISION = 3.0  # autocast step / fp32 step above which low precision is "slow here"
QUICK = {"budget": 25.0, "width": 16, "batch": 64, "min_steps": 10, "max_steps": 300}
FULL = {"steps": 300, "width": 32, "batch": 128}


def progress(items: Iterator, total: int, label: str, stream: TextIO | None = None) -> Iterator:
    """A dependency-free progress bar on stderr (redrawn in a terminal, one line in a log)."""
    # sys.stderr as it is now, not as it was at import (a notebook or a test may swap it)
    stream = sys.stderr if stream is None else stream
    width = 30
    live = stream.isatty()
    for i, item in enumerate(items, 1):
        if (live and (i == 1 or i % max(1, total // 50) == 0)) or i == total:
            done = int(width * i / total)
            stream.write(f"\r  {label:<24} [{'#' * done}{'.' * (width - done)}] {i}/{total}")
            stream.flush()
        yield item
    stream.write("\n")


def cpu_low_precision_units() -> list[str]:
    """The CPU's native bfloat16/float16 instruction sets, from /proc/cpuinfo (Linux; empty
    elsewhere or when it has none)."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line.split(":", 1)[1].split() for line in info if "flags" in line), [])
    except OSError:
        return []
    wanted = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")
    return [flag for flag in wanted if flag in flags]


def low_precision_verdict(ratio: float, dtype: torch.dtype, units: list[str]) -> str:
    """What the measured low-precision/fp32 step ratio means for the demo's numbers."""
    name = "bfloat16" if dtype == torch.bfloat16 else "float16"
    have = f"this CPU has {', '.join(units)}" if units else f"this CPU has no native {name} units"
    if ratio <= SLOW_LOW_PRECISION:
        return (
            f"{name} is usable here: a torch.autocast step takes {ratio:.1f}x the float32 step "
            f"({have}). The 'vs fp32' column is a speed comparison."
        )
    why = (
        "it is emulated"
        if not units
        else "oneDNN has no fast low-precision kernel for layers this small"
    )
    return (
        f"{name} is slow here: a torch.autocast step takes {ratio:.1f}x the float32 step "
        f"({have}; {why}). The 'vs fp32' column then measures this CPU's {name} kernels, not "
        "amp_graph: read 'vs autocast', where both sides run the same low-precision kernels. "
        "On a GPU (or a CPU with AMX) low precision is the fast side."
    )


def timed_steps(
    take: Callable[[torch.Tensor, torch.Tensor], None],
    stream: Iterator[tuple[torch.Tensor, torch.Tensor]],
    budget: float,
    low: int,
    high: int,
    stream_out: TextIO | None = None,
) -> int:
    """Take steps until ``budget`` seconds have passed (at least ``low``, at most ``high``),
    with a progress bar over the budget (on stderr); returns how many were taken."""
    stream_out = sys.stderr if stream_out is None else stream_out
    width, live = 30, stream_out.isatty()
    start, taken = time.perf_counter(), 0
    while taken < high and (taken < low or time.perf_counter() - start < budget):
        take(*next(stream))
        taken += 1
        elapsed = time.perf_counter() - start
        if live:
            done = min(width, int(width * elapsed / budget))
            stream_out.write(
                f"\r  {'all runs, in turn':<24} [{'#' * done}{'.' * (width - done)}] "
                f"{elapsed:4.0f}/{budget:g} s, {taken} steps"
            )
            stream_out.flush()
    elapsed = time.perf_counter() - start
    stream_out.write(
        f"\r  {'all runs, in turn':<24} [{'#' * width}] {elapsed:4.0f}/{budget:g} s, "
        f"{taken} steps\n"
    )
    return taken


class DigitsStep(amp_graph.Graph):
    """The training step, OneFlow style: AMP, scaler and optimizer are part of the graph."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        policy: str,
        dtype: torch.dtype,
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(optimizer)
        self.config.enable_amp(True, policy=policy, dtype=dtype)
        if dtype == torch.float16:
            self.set_grad_scaler(amp_graph.GradScaler(init_scale=2.0**16, growth_interval=50))
        if compile:
            self.config.enable_compile()

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(self.model(x).float(), y)
        loss.backward()
        return loss


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """Fused AdamW: it skips a step on the device when a gradient is inf/nan (no host read)."""
    return torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=True)


def eager_step(model: nn.Module, dtype: torch.dtype | None, compile: bool = False) -> Callable:
    """fp32 (dtype None) or a hand-written torch.autocast + torch.amp.GradScaler step."""
    opt = optimizer(model)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16, growth_interval=100)
    forward = torch.compile(model) if compile else model

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype or torch.bfloat16, enabled=dtype is not None):
            loss = F.cross_entropy(forward(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    return step


def scale_trajectory(scales: list[float]) -> str:
    """``65536 -> 32768 @12 -> 65536 @112``: the scale and the steps where it changed."""
    if not scales:
        return "-"
    parts = [f"{scales[0]:g}"]
    for i in range(1, len(scales)):
        if scales[i] != scales[i - 1]:
            parts.append(f"{scales[i]:g} @{i}")
    return " -> ".join(parts)


def accuracy(model: nn.Module, split: Split, dtype: torch.dtype | None) -> float:
    with torch.no_grad(), torch.autocast("cpu", dtype or torch.bfloat16, enabled=dtype is not None):
        return (model(split.x).float().argmax(1) == split.y).float().mean().item()


def loss_scaling_run(train_split: Split, steps: int, batch: int) -> None:
    """float16 with dynamic loss scaling, on an MLP: one corrupted batch shows a skipped step."""
    torch.manual_seed(0)
    model = models.MLP()
    graph = DigitsStep(model, optimizer(model), "O1", torch.float16)
    scales, bad_step = [], steps // 2
    for i, (x, y) in enumerate(
        progress(batches(train_split, batch, steps), steps, "fp16 Graph O1")
    ):
        if i == bad_step:
            x = x.clone()
            x[0, 0, 0, 0] = float("inf")  # a corrupted pixel: inf/nan gradients
        graph(x, y)
        scales.append(graph.grad_scaler.get_scale())
    print(f"  loss scale: {scale_trajectory(scales)}")
    print(
        f"  skipped steps: {graph.skipped_steps} (a corrupted batch at step {bad_step}; "
        "its non-finite gradients never reached the weights)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="amp-graph demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps per run (default: what fits the time budget; 300 with --full)",
    )
    parser.add_argument("--batch", type=int, default=None, help="default 64 (128 with --full)")
    parser.add_argument(
        "--channels", type=int, default=None, help="ConvNet width (default 16; 32 with --full)"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=QUICK["budget"],
        help="seconds of training the quick demo aims for (default %(default)s)",
    )
    parser.add_argument(
        "--full", action="store_true", help="the long run: 300 steps of 128, width 32"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bf16",
        help="low-precision dtype of the comparison (bf16: torch.autocast's CPU default)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also torch.compile + autocast by hand and a compiled O2 Graph (needs a C++ compiler)",
    )
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype]
    size = FULL if args.full else QUICK
    channels = args.channels or size["width"]
    batch = args.batch or size["batch"]
    fixed_steps = args.steps or (FULL["steps"] if args.full else None)

    torch.manual_seed(0)
    train_split, test_split = load_digits()
    steps_text = f"{fixed_steps}" if fixed_steps else f"about {args.budget:g} s of"
    print(
        f"amp_graph demo: ConvNet (width {channels}, BatchNorm) on scikit-learn digits "
        f"({len(train_split.y)} train / {len(test_split.y)} test images), {steps_text} fused "
        f"AdamW steps of {batch}, low precision {dtype}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads{'' if args.full else ' (quick; --full: long run)'}\n"
    )
    base = models.ConvNet(channels=channels)

    runs: dict[str, tuple[nn.Module, Callable, amp_graph.Graph | None]] = {}
    model = copy.deepcopy(base)
    runs["fp32 eager"] = (model, eager_step(model, None), None)
    model = copy.deepcopy(base)
    runs["torch.autocast eager"] = (model, eager_step(model, dtype), None)
    for policy in ("O1", "O2"):
        model = copy.deepcopy(base)
        graph = DigitsStep(model, optimizer(model), policy, dtype)
        runs[f"amp_graph.Graph {policy}"] = (model, graph, graph)
    if args.compile:
        model = copy.deepcopy(base)
        runs["torch.compile + autocast"] = (model, eager_step(model, dtype, compile=True), None)
        model = copy.deepcopy(base)
        graph = DigitsStep(model, optimizer(model), "O2", dtype, compile=True)
        runs["amp_graph.Graph O2 compiled"] = (model, graph, graph)

    # every run takes the same batches, in turn: step i of each run before step i + 1, in an
    # order shuffled per step (a run that always follows the same other run inherits its caches)
    times: dict[str, list[float]] = {label: [] for label in runs}
    scales: dict[str, list[float]] = {label: [] for label in runs}
    order, shuffler = list(runs), random.Random(0)

    def take(x: torch.Tensor, y: torch.Tensor) -> None:
        shuffler.shuffle(order)
        for label in order:
            _, step, graph = runs[label]
            start = time.perf_counter()
            step(x, y)
            times[label].append(time.perf_counter() - start)
            if graph is not None and graph.grad_scaler is not None:
                scales[label].append(graph.grad_scaler.get_scale())

    stream = batches(train_split, batch, 10**9)
    for x, y in progress(
        (next(stream) for _ in range(WARMUP_STEPS)), WARMUP_STEPS, "warm-up (and capture)"
    ):
        take(x, y)
    if fixed_steps:
        rest = fixed_steps - WARMUP_STEPS
        for x, y in progress((next(stream) for _ in range(rest)), rest, "all runs, in turn"):
            take(x, y)
    else:  # as many steps as fit the budget, measured as they run (machines are noisy)
        timed_steps(take, stream, args.budget, QUICK["min_steps"], QUICK["max_steps"])
    steps = len(times["fp32 eager"])
    print(f"  {steps} steps per run")

    results = {}
    for label, (model, _, graph) in runs.items():
        eval_dtype = None if label == "fp32 eager" else dtype  # O2 weights are low precision
        acc = accuracy(model, test_split, eval_dtype)
        skipped = graph.skipped_steps if graph is not None else None
        step_time = statistics.median(times[label][WARMUP_STEPS:] or times[label])
        results[label] = (acc, step_time, scales[label], skipped, parameter_bytes(model, graph))

    print("\nCast report of the Graph's build (policy O1):")
    o1 = runs["amp_graph.Graph O1"][2]
    assert o1 is not None and o1.build_graph is not None
    print(amp_graph.report(o1.build_graph))
    print("\nThe O1 training step, as one graph:")
    print(o1.step_graph.code.strip())

    fp32_time = results["fp32 eager"][1]
    autocast_time = results["torch.autocast eager"][1]
    # from the medians of the whole run: a few warm-up steps are too noisy to judge by
    verdict = low_precision_verdict(autocast_time / fp32_time, dtype, cpu_low_precision_units())
    print(f"\n{verdict}")
    print(
        f"\n{'run':<28} {'test acc':>9} {'median step':>12} {'vs fp32':>8} {'vs autocast':>12} "
        f"{'params+grads(+masters)':>23}"
    )
    for label, (acc, step_time, _, _, nbytes) in results.items():
        print(
            f"{label:<28} {acc:>9.3f} {step_time * 1e3:>9.2f} ms {step_time / fp32_time:>7.2f}x "
            f"{step_time / autocast_time:>11.2f}x {nbytes / 2**10:>19.1f} KiB"
        )
    for label, (_, _, run_scales, skipped, _) in results.items():
        if skipped is None:
            continue
        if run_scales:
            print(f"{label}: loss scale {scale_trajectory(run_scales)}; skipped steps: {skipped}")
        else:
            print(f"{label}: no loss scaling ({dtype} needs none); skipped steps: {skipped}")
    fp32_acc = results["fp32 eager"][0]
    print(
        "accuracy vs fp32: "
        + ", ".join(
            f"{label} {acc - fp32_acc:+.3f}"
            for label, (acc, *_) in results.items()
            if label != "fp32 eager"
        )
    )
    if dtype != torch.float16:
        print("\nLoss scaling at work: float16, MLP, Graph O1 with amp_graph.GradScaler")
        loss_scaling_run(train_split, steps=200 if args.full else 40, batch=64)
    return 0


def parameter_bytes(model: nn.Module, graph: amp_graph.Graph | None) -> int:
    """Bytes of the parameters and gradients after a step, plus O2's float32 masters and theirs."""
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    if graph is not None and graph._builder.master is not None:
        tensors += [
            t for _, _, m in graph._builder.master.pairs for t in (m, m.grad) if t is not None
        ]
    return sum(t.numel() * t.element_size() for t in tensors)


if __name__ == "__main__":
    raise SystemExit(main())
