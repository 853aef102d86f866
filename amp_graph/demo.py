"""``make demo`` / ``amp-graph demo``: amp_graph on a real model and a real dataset.

Compiles a small ResNet-style ConvNet with policy O1, prints the cast report, then trains
it on scikit-learn's digits in float32 (eager), under torch.autocast (eager), and through
amp_graph, from the same initialization on the same batches, and prints test accuracy and
median step times side by side.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_graph
from amp_graph import models
from amp_graph.data import Split, batches, load_digits


def progress(items: Iterator, total: int, label: str, stream: TextIO = sys.stderr) -> Iterator:
    """A dependency-free progress bar on stderr (redrawn in a terminal, one line in a log)."""
    width = 30
    live = stream.isatty()
    for i, item in enumerate(items, 1):
        if (live and (i == 1 or i % max(1, total // 50) == 0)) or i == total:
            done = int(width * i / total)
            stream.write(f"\r  {label:<22} [{'#' * done}{'.' * (width - done)}] {i}/{total}")
            stream.flush()
        yield item
    stream.write("\n")


def train(
    model: nn.Module,
    forward: Callable[[torch.Tensor], torch.Tensor],
    train_split: Split,
    steps: int,
    batch: int,
    label: str,
) -> list[float]:
    """Adam steps; returns the time of each step in seconds."""
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    times = []
    for x, y in progress(batches(train_split, batch, steps), steps, label):
        start = time.perf_counter()
        loss = F.cross_entropy(forward(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def accuracy(forward: Callable[[torch.Tensor], torch.Tensor], split: Split) -> float:
    with torch.no_grad():
        return (forward(split.x).float().argmax(1) == split.y).float().mean().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="amp-graph demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--channels", type=int, default=32, help="ConvNet width")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    train_split, test_split = load_digits()
    dtype = torch.bfloat16
    print(
        f"amp_graph demo: ConvNet on scikit-learn digits ({len(train_split.y)} train / "
        f"{len(test_split.y)} test images), low precision {dtype}, torch {torch.__version__}\n"
    )

    base = models.ConvNet(channels=args.channels)
    fp32_model, autocast_model, amp_model = (copy.deepcopy(base) for _ in range(3))
    compiled = amp_graph.compile(
        amp_model, policy="O1", dtype=dtype, example_inputs=(train_split.x[: args.batch],)
    )
    print("Cast report (policy O1):")
    print(amp_graph.report(compiled))
    print()

    def under_autocast(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype):
            return autocast_model(x)

    runs = {
        "fp32 eager": (fp32_model, fp32_model),
        "torch.autocast eager": (autocast_model, under_autocast),
        "amp_graph O1": (amp_model, compiled),
    }
    results = {}
    for label, (params, forward) in runs.items():
        times = train(params, forward, train_split, args.steps, args.batch, label)
        results[label] = (accuracy(forward, test_split), statistics.median(times[5:] or times))

    fp32_time = results["fp32 eager"][1]
    autocast_time = results["torch.autocast eager"][1]
    print(f"\n{'run':<22} {'test acc':>9} {'median step':>12} {'vs fp32':>8} {'vs autocast':>12}")
    for label, (acc, step) in results.items():
        print(
            f"{label:<22} {acc:>9.3f} {step * 1e3:>9.2f} ms {step / fp32_time:>7.2f}x "
            f"{step / autocast_time:>11.2f}x"
        )
    fp32_acc, amp_acc = results["fp32 eager"][0], results["amp_graph O1"][0]
    print(f"\naccuracy amp_graph O1 - fp32: {amp_acc - fp32_acc:+.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
