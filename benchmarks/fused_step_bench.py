"""The optimizer step of a Graph through FusedStep against torch.optim's ``step()``, in one run.

For each of ``graph_bench.py``'s small setups (bf16 on a CPU, fused SGD / AdamW):

1. **The call alone**: microseconds of ``optimizer.step()`` and of
   :class:`~amp_graph.training.fused_step.FusedStep` on a second copy of the model and
   optimizer, each right after its own forward and backward (the caches a step meets in
   training), alternating, medians. The two copies stay bit-identical (checked at the end).
2. **The Graph step**: a hand-written ``torch.autocast`` loop, and ``amp_graph.Graph`` O1
   with its step graph's FusedStep and with it removed (``optimizer.step()``, as before
   FusedStep), rounds interleaved in a shuffled order; medians of per-round ratios to the
   hand-written loop.

    python benchmarks/fused_step_bench.py --threads 1
    python benchmarks/fused_step_bench.py --threads 1 --rounds 301 --only ConvNet
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import graph_bench
import torch
from measure import cpu_name, interleaved_seconds

from amp_graph.training.fused_step import FusedStep

BF16 = torch.bfloat16


def call_alone(setup: graph_bench.Setup, repeats: int) -> tuple[float, float, bool]:
    """Median microseconds of optimizer.step() and of FusedStep(), each after a backward;
    whether the two copies ended bit-identical."""
    models = [copy.deepcopy(setup.model) for _ in range(2)]
    optimizers = [setup.optimizer(m.parameters()) for m in models]
    steps = [optimizers[0].step, FusedStep(optimizers[1])]
    x, y = setup.inputs
    times: list[list[float]] = [[], []]
    for i in range(repeats + 2):
        for k in (0, 1):
            optimizers[k].zero_grad(set_to_none=True)
            with torch.autocast(x.device.type, BF16):
                loss = setup.loss(models[k], x, y)
            loss.backward()
            start = time.perf_counter()
            steps[k]()
            if i >= 2:  # the first steps create the state (torch's step in both)
                times[k].append(time.perf_counter() - start)
    pairs = zip(models[0].parameters(), models[1].parameters(), strict=True)
    same = all(torch.equal(a, b) for a, b in pairs)
    torch_us, fused_us = (statistics.median(t) * 1e6 for t in times)
    return torch_us, fused_us, same


def without_fused_step(graph: graph_bench.StepGraph) -> graph_bench.StepGraph:
    """The Graph as it was before FusedStep: its step nodes call optimizer.step()."""
    build_step = graph._builder._step_graph

    def torch_steps(captured: object) -> torch.fx.GraphModule:
        step = build_step(captured)
        for name in list(vars(step)):
            if name.startswith("fused_step_"):
                setattr(step, name, None)
        return step

    graph._builder._step_graph = torch_steps
    return graph


def graph_step(setup: graph_bench.Setup, rounds: int) -> dict[str, float]:
    """Medians of per-round ratios to the hand-written loop."""
    variants = {
        "hand-written autocast": graph_bench.handwritten(setup, copy.deepcopy(setup.model), BF16),
        "Graph O1": graph_bench.StepGraph(setup, copy.deepcopy(setup.model), "O1", BF16),
        "Graph O1, torch.optim step": without_fused_step(
            graph_bench.StepGraph(setup, copy.deepcopy(setup.model), "O1", BF16)
        ),
    }
    x, y = setup.inputs
    calls = {name: (lambda f=f: f(x, y)) for name, f in variants.items()}
    times = interleaved_seconds(calls, rounds, warmup=3)
    ref = times["hand-written autocast"]
    return {
        name: statistics.median(a / b for a, b in zip(t, ref, strict=True))
        for name, t in times.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads")
    parser.add_argument("--rounds", type=int, default=201, help="interleaved Graph rounds")
    parser.add_argument("--calls", type=int, default=301, help="timed optimizer calls")
    parser.add_argument("--only", default=None, help="keep the setups whose name contains it")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {cpu_name()}, {torch.get_num_threads()} threads; "
        f"{args.calls} optimizer calls, {args.rounds} shuffled rounds of Graph steps\n"
    )
    setups = graph_bench.setups("cpu", False, False, None)
    if args.only:
        setups = [s for s in setups if args.only in s.name]
    print(f"{'setup':52} {'step() us':>10} {'FusedStep us':>13} {'saved us':>9} {'same':>5}")
    for setup in setups:
        torch_us, fused_us, same = call_alone(setup, args.calls)
        print(
            f"{setup.name:52} {torch_us:10.1f} {fused_us:13.1f} {torch_us - fused_us:9.1f} "
            f"{'yes' if same else 'NO':>5}"
        )
    print(f"\n{'setup':52} {'Graph O1':>9} {'torch.optim step':>17}   (/ hand-written loop)")
    for setup in setups:
        ratios = graph_step(setup, args.rounds)
        before = ratios["Graph O1, torch.optim step"]
        print(f"{setup.name:52} {ratios['Graph O1']:9.3f} {before:17.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
