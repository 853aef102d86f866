"""Benchmark: ``torch.compile(backend="amp_graph")`` against ``torch.compile`` under autocast.

For each model (a GPT trained with cross-entropy, ``GPTWithLoss``; a small ResNet with its
cross-entropy, ``WithCrossEntropy(ConvNet)``: the loss inside the compiled graph, as in
``inductor_kernels.py``), on CPU with bfloat16, this measures one training step (forward,
backward, AdamW step) compiled these ways:

* ``amp_graph``: ``torch.compile(model, backend="amp_graph")`` (policy O1, inductor);
* ``amp_graph[recompute all]``: the same with ``Policy(recompute_casts=True)``: every cast
  tagged for recompute (what ``"auto"`` did under AOTAutograd before issue 58), where the
  default leaves them to the partitioner as for the reference (the tags are the one
  difference in the kernels: ``inductor_kernels.py``);
* ``amp_graph[autocast]``: ``backend=amp_graph.backend(policy="autocast")``, the same op
  lists as torch.autocast, so the graphs compute exactly what the reference computes;
* ``autocast``: ``torch.compile(model)`` called under ``torch.autocast("cpu", bfloat16)``,
  the reference;
* ``autocast[again]``: the reference compiled a second time, step times only: its ratio to
  the reference is the measurement's noise floor (an A/A test).

Reported per variant: the median step time (with quartiles) and its ratio to the reference
(the median of per-round ratios, each variant's step against the reference's step of the
same round), the compile time (first step minus a steady step), and for amp_graph variants
the seconds of amp_graph's own work inside the backend (attaching example values, the
passes, graph copies) and its share of the compile time. Targets: step-time ratio
amp_graph / autocast <= 1.0, pass share <= 5%.

Compile time: each variant compiles in its own process with a fresh inductor cache, after
compiling an unrelated warm-up function, so every variant compiles its kernels cold and
none pays inductor's one-time start-up in the measurement. Step time: all variants in one
process, steps interleaved round by round (order rotated), so that load from other
processes on the machine falls on every variant alike.

Run:  python benchmarks/backend_bench.py                       (both models, about 5 minutes)
      python benchmarks/backend_bench.py --models gpt --rounds 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

VARIANTS = (
    "amp_graph",
    "amp_graph[recompute all]",
    "amp_graph[autocast]",
    "autocast",
    "autocast[again]",
)
COMPILE_VARIANTS = ("amp_graph", "autocast")  # cold compiles are slow: the two the issue compares
MODELS = ("gpt", "convnet")


def _make(model_name: str) -> tuple[Any, tuple[Any, ...]]:
    import torch

    from amp_graph.demo import models

    torch.manual_seed(0)
    if model_name == "gpt":
        model = models.GPTWithLoss(vocab=256, block=64, dim=128, heads=4, layers=2)
        idx = torch.randint(0, 256, (16, 64))
        return model, (idx, torch.roll(idx, -1, dims=1))
    model = models.WithCrossEntropy(models.ConvNet(in_channels=1, channels=32, classes=10))
    return model, (torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,)))


def _compiled(model: Any, variant: str) -> Any:
    import torch

    from amp_graph.frontends.dynamo_backend import backend

    if variant == "amp_graph":
        return torch.compile(model, backend="amp_graph")
    if variant == "amp_graph[autocast]":
        return torch.compile(model, backend=backend(policy="autocast"))
    if variant == "amp_graph[recompute all]":
        import dataclasses

        import amp_graph

        policy = dataclasses.replace(amp_graph.Policy.preset("O1"), recompute_casts=True)
        return torch.compile(model, backend=backend(policy=policy))
    return torch.compile(model)


def _stepper(batch: tuple[Any, ...], compiled: Any, variant: str, opt: Any) -> Callable[[], float]:
    """One training step of ``compiled``, returning its wall time."""
    import contextlib

    import torch

    def step() -> float:
        start = time.perf_counter()
        autocast = variant.startswith("autocast")
        with torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = compiled(*batch)  # each model computes its own loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return step


def _warm_start() -> None:
    """Pay inductor's one-time start-up costs (imports, C++ prefix) outside the timings."""
    import torch

    torch.compile(lambda x: (x.sin() + 1).sum())(torch.randn(8))


def _child_compile(model_name: str, variant: str) -> dict[str, Any]:
    """Compile time of one variant, in a process and cache of its own."""
    import torch

    from amp_graph.frontends.dynamo_backend import captured_graphs

    _warm_start()
    model, batch = _make(model_name)
    compiled = _compiled(model, variant)
    opt = torch.optim.AdamW(model.parameters())
    step = _stepper(batch, compiled, variant, opt)
    first = step()
    steady = statistics.median(step() for _ in range(3))
    result: dict[str, Any] = {"compile_s": first - steady}
    if variant.startswith("amp_graph"):
        graphs = captured_graphs(compiled)
        result["graphs"] = len(graphs)
        result["pass_s"] = sum(sum(g.meta["amp_graph"].seconds.values()) for g in graphs)
    return result


def _child_steady(model_name: str, rounds: int, warmup: int) -> dict[str, Any]:
    """Median step time of every variant, interleaved round by round in one process so that
    load from other processes on the machine hits all variants alike."""
    import torch

    _warm_start()
    steps = {}
    for variant in VARIANTS:
        model, batch = _make(model_name)
        opt = torch.optim.AdamW(model.parameters())
        steps[variant] = _stepper(batch, _compiled(model, variant), variant, opt)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(warmup + rounds):
        order = VARIANTS[i % len(VARIANTS) :] + VARIANTS[: i % len(VARIANTS)]  # rotate the order
        for variant in order:
            elapsed = steps[variant]()
            if i >= warmup:
                times[variant].append(elapsed)
    reference = times["autocast"]
    return {
        v: {
            "median_s": statistics.median(t),
            "quartiles_s": statistics.quantiles(t, n=4),
            # Paired: each step against the reference's step of the same round, so that a
            # burst of outside load slows both sides of a ratio.
            "paired_ratio": statistics.median(a / b for a, b in zip(t, reference, strict=True)),
        }
        for v, t in times.items()
    }


def _run_child(args: list[str], cache: str) -> dict[str, Any]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    done = subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure(model_name: str, rounds: int, warmup: int) -> dict[str, dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="amp_graph_bench_") as root:
        results: dict[str, dict[str, Any]] = {v: {} for v in VARIANTS}
        for variant in COMPILE_VARIANTS:  # each compiles cold: a fresh process and cache
            cache = os.path.join(root, variant)
            results[variant] = _run_child(["--compile", model_name, variant], cache)
        # The steady-state run reuses the reference's cache, which only shortens its compile.
        steady = _run_child(
            ["--steady", model_name, "--rounds", str(rounds), "--warmup", str(warmup)],
            os.path.join(root, "autocast"),
        )
    for variant in VARIANTS:
        results[variant].update(steady[variant])
    return results


def _table(model_name: str, results: dict[str, dict[str, Any]]) -> str:
    ref = results["autocast"]
    lines = [
        f"{model_name}: train step (forward + backward + AdamW), CPU, bfloat16",
        f"  {'variant':<25}{'median step':>12}{'(q1 - q3)':>19}{'ratio':>7}{'compile':>9}"
        f"{'ratio':>7}{'graphs':>7}{'passes':>9}{'share':>8}",
    ]
    for variant, r in results.items():
        q1, _, q3 = r["quartiles_s"]
        timed = "compile_s" in r
        compile_s = f"{r['compile_s']:.1f}s" if timed else "-"
        compile_ratio = f"{r['compile_s'] / ref['compile_s']:.2f}" if timed else "-"
        passes = f"{r['pass_s']:.3f}s" if "pass_s" in r else "-"
        share = f"{100 * r['pass_s'] / r['compile_s']:.2f}%" if "pass_s" in r else "-"
        spread = f"({1000 * q1:.0f} - {1000 * q3:.0f} ms)"
        lines.append(
            f"  {variant:<25}{1000 * r['median_s']:>10.1f}ms{spread:>19}"
            f"{r['paired_ratio']:>7.3f}{compile_s:>9}{compile_ratio:>7}"
            f"{r.get('graphs', '-'):>7}{passes:>9}{share:>8}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=30, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per variant")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--compile", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--steady", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compile:
        print(json.dumps(_child_compile(*args.compile)))
        return
    if args.steady:
        print(json.dumps(_child_steady(args.steady, args.rounds, args.warmup)))
        return
    import torch

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}; {args.rounds} measured steps per variant "
        f"after {args.warmup} warmup, variants interleaved"
    )
    start = time.perf_counter()
    for model_name in args.models:
        print(_table(model_name, _measure(model_name, args.rounds, args.warmup)), flush=True)
    print(
        "ratio: variant / autocast; for steps, the median over rounds of the two steps' ratio "
        "in the same round.\ncompile: first step minus a steady step, each variant in a "
        "fresh process and inductor cache.\nshare: amp_graph's own seconds inside the backend "
        f"(example values, passes, graph copies) / its compile time. Total "
        f"{time.perf_counter() - start:.0f}s."
    )


if __name__ == "__main__":
    main()
