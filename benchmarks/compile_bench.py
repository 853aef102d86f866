"""amp_graph.compile against eager fp32 and eager torch.autocast, side by side in one run.

For the GPT-style decoder and the ConvNet, in bf16 on this CPU:
  * median train-step time (forward, backward, Adam step) and its ratio to fp32 and to
    torch.autocast, for fp32 eager, torch.autocast eager, amp_graph O1 and amp_graph with
    policy="autocast" (the like-for-like comparison: the same dtypes as autocast);
  * casts executed per train step (aten ``_to_copy``, counted with a TorchDispatchMode);
  * peak memory allocated during one train step, above what existed before it (the
    profiler's allocation events, summed in order);
the first call (capture with torch.export + the passes + one forward) on the GPT-style
decoder and on HF GPT-2 (when transformers is installed), beside torch.compile's first call
(inductor, and the amp_graph backend); and the capture and pass times on graphs of about 1k
to 10k nodes, per node.

    python benchmarks/compile_bench.py            # the full run recorded in BENCHMARKS.md
    python benchmarks/compile_bench.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from measure import interleaved_seconds, peak_cpu_step_mb
from torch.utils._python_dispatch import TorchDispatchMode

import amp_graph
from amp_graph.demo import models

DTYPE = torch.bfloat16
VARIANTS = ("fp32 eager", "autocast eager", "amp_graph O1", "amp_graph autocast")


def workload(name: str, quick: bool) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], Callable]:
    """(model, inputs, loss_fn(outputs, inputs))."""
    torch.manual_seed(0)
    if name == "gpt":
        batch, seq = (4, 64) if quick else (16, 128)
        model = models.GPT(vocab=512, block=seq, dim=256, heads=8, layers=4)
        idx = torch.randint(0, 512, (batch, seq))
        targets = torch.randint(0, 512, (batch, seq))
        return (
            model,
            (idx,),
            lambda out: F.cross_entropy(out.float().flatten(0, 1), targets.flatten()),
        )
    batch = 16 if quick else 64
    model = models.ConvNet(in_channels=3, channels=64)
    x = torch.randn(batch, 3, 32, 32)
    labels = torch.randint(0, 10, (batch,))
    return model, (x,), lambda out: F.cross_entropy(out.float(), labels)


def make_step(
    variant: str, model: torch.nn.Module, inputs: tuple, loss_fn: Callable
) -> Callable[[], None]:
    model = copy.deepcopy(model)
    forward: Callable = model
    if variant == "amp_graph O1":
        forward = amp_graph.compile(model, "O1", DTYPE, example_inputs=inputs)
    elif variant == "amp_graph autocast":
        forward = amp_graph.compile(model, "autocast", DTYPE, example_inputs=inputs)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step() -> None:
        if variant == "autocast eager":
            with torch.autocast("cpu", DTYPE):
                out = forward(*inputs)
        else:
            out = forward(*inputs)
        loss = loss_fn(out)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


class CastCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        if func.overloadpacket is torch.ops.aten._to_copy:
            self.casts += 1
        return func(*args, **(kwargs or {}))


def bench_workload(name: str, repeats: int, quick: bool) -> dict[str, Any]:
    model, inputs, loss_fn = workload(name, quick)
    steps = {v: make_step(v, model, inputs, loss_fn) for v in VARIANTS}
    casts = {}
    for variant, step in steps.items():
        counter = CastCounter()
        with counter:
            step()
        casts[variant] = counter.casts
    times = interleaved_seconds(steps, repeats, warmup=2)
    medians = {v: statistics.median(t) for v, t in times.items()}
    peak = {v: peak_cpu_step_mb(step) for v, step in steps.items()}
    return {"medians": medians, "casts": casts, "peak_mb": peak}


def pass_scaling(quick: bool) -> list[tuple[int, float, float, float]]:
    """(nodes, capture s, passes s, pass us per node) for growing GPTs, captured at once."""
    rows = []
    for layers in (2, 8) if quick else (30, 100, 200):
        model = models.GPT(vocab=64, block=16, dim=32, heads=2, layers=layers)
        idx = torch.randint(0, 64, (1, 16))
        compiled = amp_graph.compile(model, "O1", DTYPE, example_inputs=(idx,))
        seconds = compiled.meta["amp_graph"].seconds
        capture = seconds["capture"]
        passes = sum(v for k, v in seconds.items() if k != "capture")
        nodes = len(compiled.graph.nodes)
        rows.append((nodes, capture, passes, passes / nodes * 1e6))
    return rows


def first_calls(quick: bool) -> list[tuple[str, str, float, str]]:
    """(model, variant, seconds of the first call, detail) for fresh models."""
    cases: list[tuple[str, Callable[[], tuple[torch.nn.Module, tuple, dict]]]] = []

    def gpt() -> tuple[torch.nn.Module, tuple, dict]:
        torch.manual_seed(0)
        model = models.GPT(vocab=512, block=64, dim=128, heads=4, layers=2 if quick else 4)
        return model, (torch.randint(0, 512, (4, 64)),), {}

    cases.append(("GPT-style decoder", gpt))
    try:
        import transformers
    except ImportError:
        transformers = None
    if transformers is not None:

        def gpt2() -> tuple[torch.nn.Module, tuple, dict]:
            torch.manual_seed(0)
            config = transformers.GPT2Config(
                vocab_size=512, n_positions=64, n_embd=128, n_layer=2 if quick else 4,
                n_head=4, use_cache=False,
            )  # fmt: skip
            ids = torch.randint(0, 512, (4, 64))
            return transformers.GPT2LMHeadModel(config), (), {"input_ids": ids, "labels": ids}

        cases.append(("HF GPT-2", gpt2))
    rows = []
    for name, make in cases:
        for variant in ("amp_graph.compile O1", "torch.compile (inductor)", "backend amp_graph"):
            model, args, kwargs = make()
            torch._dynamo.reset()
            start = time.perf_counter()
            detail = ""
            if variant == "amp_graph.compile O1":
                compiled = amp_graph.compile(model, "O1", DTYPE)
                compiled(*args, **kwargs)
                seconds = compiled.meta["amp_graph"].seconds
                passes = sum(v for k, v in seconds.items() if k != "capture")
                detail = f"capture {seconds['capture']:.2f} s, passes {passes:.2f} s"
            elif variant == "torch.compile (inductor)":
                with torch.autocast("cpu", DTYPE):
                    torch.compile(model)(*args, **kwargs)
                detail = "under torch.autocast"
            else:
                torch.compile(model, backend=amp_graph.backend("O1", DTYPE))(*args, **kwargs)
            rows.append((name, variant, time.perf_counter() - start, detail))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args()
    repeats = args.repeats or (5 if args.quick else 30)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {DTYPE}, "
        f"{repeats} interleaved repeats, medians\n"
    )
    report: dict[str, Any] = {}
    for name in ("gpt", "cnn"):
        result = bench_workload(name, repeats, args.quick)
        report[name] = result
        med = result["medians"]
        print(f"== {name}: train step (forward + backward + Adam)")
        print(
            f"{'variant':<20} {'median ms':>10} {'vs fp32':>8} {'vs autocast':>12} "
            f"{'casts/step':>11} {'peak MB':>8}"
        )
        for v in VARIANTS:
            print(
                f"{v:<20} {med[v] * 1e3:>10.2f} {med[v] / med['fp32 eager']:>8.2f} "
                f"{med[v] / med['autocast eager']:>12.2f} {result['casts'][v]:>11} "
                f"{result['peak_mb'][v]:>8.1f}"
            )
        print()
    print("== first call: capture + passes + forward, against torch.compile's first call")
    print(f"{'model':<20} {'variant':<26} {'seconds':>8}  detail")
    calls = first_calls(args.quick)
    for name, variant, seconds, detail in calls:
        print(f"{name:<20} {variant:<26} {seconds:>8.2f}  {detail}")
    report["first_calls"] = calls
    print()
    print("== capture and pass time vs graph size (amp_graph.compile, O1, with example inputs)")
    print(f"{'nodes':>7} {'capture s':>10} {'passes s':>9} {'passes us/node':>15}")
    rows = pass_scaling(args.quick)
    for nodes, capture, passes, per_node in rows:
        print(f"{nodes:>7} {capture:>10.2f} {passes:>9.2f} {per_node:>15.1f}")
    print(f"pass time per node, largest/smallest graph: {rows[-1][3] / rows[0][3]:.2f}")
    report["scaling"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=float)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
