"""What the numerics monitor costs a training step, side by side in one run (issue 25).

For the GPT benchmark (``compile_bench.py``'s GPT-style decoder) and the demo's ConvNet, each
an ``amp_graph.compile(O1, bf16)`` model with fused Adam, on this CPU:

* ``no monitor``: the compiled model as it is;
* ``monitor, non-logging step``: ``amp_graph.monitor(compiled, every=10**9)`` after its
  logging step 0, so every timed step is a non-logging one (target <= 1.02x);
* ``monitor, logging step``: ``every=1``, every default node (each matrix product and
  convolution: operands, output, output gradient, weight gradient) measured every step
  (target <= 1.5x); the buffers are read once, after the timing.

It prints the median step time of each and the ratios to ``no monitor`` (the steps run
interleaved, ABC ABC ..., so that drift hits all alike), and the host reads each kind of step
made (counted by a TorchFunctionMode: ``item``, ``tolist``, ``cpu`` and friends).

    python benchmarks/monitor_bench.py            # the run recorded in BENCHMARKS.md
    python benchmarks/monitor_bench.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from measure import interleaved_seconds
from torch.overrides import TorchFunctionMode

import amp_graph
from amp_graph.demo import models

DTYPE = torch.bfloat16
READS = frozenset({"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"})


class HostReads(TorchFunctionMode):
    """Counts tensor calls that read a value on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if getattr(func, "__name__", "") in READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def workloads(quick: bool) -> dict[str, tuple[torch.nn.Module, torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    batch, seq = (4, 64) if quick else (16, 128)
    gpt = models.GPT(vocab=512, block=seq, dim=256, heads=8, layers=4)
    idx, targets = torch.randint(0, 512, (batch, seq)), torch.randint(0, 512, (batch, seq))
    conv_batch = 32 if quick else 128
    convnet = models.ConvNet(channels=32)
    x, y = torch.randn(conv_batch, 1, 8, 8), torch.randint(0, 10, (conv_batch,))
    return {
        f"GPT (dim 256, 4 layers, batch {batch}x{seq}), adam": (gpt, idx, targets),
        f"ConvNet (demo's, width 32, batch {conv_batch}), adam": (convnet, x, y),
    }


def make_step(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, every: int | None
) -> tuple[Callable[[], None], amp_graph.Monitor | None]:
    model = copy.deepcopy(model)
    compiled = amp_graph.compile(model, "O1", DTYPE, example_inputs=(x,))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)  # no host reads

    def step() -> None:
        out = compiled(x).float()
        loss = F.cross_entropy(out.flatten(0, -2), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    monitor = None
    if every is not None:
        monitor = amp_graph.monitor(compiled, every=every)
        step()  # step 0 logs (and instruments the graph): the timed steps are the later ones
    return step, monitor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 15)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, amp_graph O1 bf16; "
        f"median of {repeats} interleaved steps"
    )
    for name, (model, x, y) in workloads(args.quick).items():
        steps, monitors = {}, {}
        for variant, every in (
            ("no monitor", None),
            ("monitor, non-logging step", 10**9),
            ("monitor, logging step", 1),
        ):
            steps[variant], monitors[variant] = make_step(model, x, y, every)
        reads = {}
        for variant, step in steps.items():
            with HostReads() as counter:
                step()
            reads[variant] = counter.count
        times = interleaved_seconds(steps, repeats, warmup=1)
        logging_monitor = monitors["monitor, logging step"]
        assert logging_monitor is not None
        probes = len(logging_monitor.probes)
        rows = len(logging_monitor.history)  # the one read, after the timing
        base = statistics.median(times["no monitor"])
        print(f"\n{name}: {probes} probes, {rows} rows read after the run")
        for variant, samples in times.items():
            median = statistics.median(samples)
            print(
                f"  {variant:<28} {median * 1e3:8.2f} ms  {median / base:5.3f}x  "
                f"host reads in the step: {reads[variant]}"
            )


if __name__ == "__main__":
    main()
