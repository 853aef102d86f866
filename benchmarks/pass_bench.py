"""Where the time of ``amp_graph.compile`` goes, per pass, on GPT-style decoders of about 1k to
10k nodes: the capture (``torch.export`` under the policy) beside each pass, in microseconds
per node of the captured graph, and export's share of the whole.

The baseline for issue 20's "fast passes" (target: the passes at most 100 us per node on the
10k-node graph). Each size is compiled ``--repeats`` times from a fresh model (medians).

    python benchmarks/pass_bench.py              # 1k, 4k and 10k nodes, 3 repeats
    python benchmarks/pass_bench.py --layers 44 444   # 1.6k and 16k nodes (issue 57's sizes)
    python benchmarks/pass_bench.py --quick      # small graphs, one repeat (a smoke run)
    python benchmarks/pass_bench.py --first-call # also the first call against torch.compile

With several sizes, the last line gives the growth: the passes' time per node on the
largest graph over that on the smallest (linear passes: 1.0; target <= 1.2).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import amp_graph
from amp_graph.demo import models
from amp_graph.frontends.compiler import compile_record

DTYPE = torch.bfloat16


def compile_seconds(layers: int) -> tuple[int, dict[str, float]]:
    """(nodes of the rewritten graph, seconds by stage) of one compile of a fresh GPT."""
    torch.manual_seed(0)
    model = models.GPT(vocab=64, block=16, dim=32, heads=2, layers=layers)
    idx = torch.randint(0, 64, (1, 16))
    start = time.perf_counter()
    compiled = amp_graph.compile(model, "O1", DTYPE, example_inputs=(idx,))
    wall = time.perf_counter() - start
    record = compile_record(compiled)
    captured_nodes = len(record.original.graph.nodes)
    stages = dict(record.seconds)
    # what is neither the capture nor a pass: the copy of the captured graph kept for
    # amp_graph.diff, the one recompile, the checks around them
    stages["rest of compile"] = wall - sum(stages.values())
    return captured_nodes, stages


_FIRST_CALL = """
import sys, time, torch, amp_graph
from amp_graph.demo import models
torch.manual_seed(0)
model = models.GPT(vocab=512, block=64, dim=128, heads=4, layers=4)
idx = torch.randint(0, 512, (4, 64))
start = time.perf_counter()
if sys.argv[1] == "amp_graph":
    amp_graph.compile(model, "O1", torch.bfloat16)(idx)
else:
    with torch.autocast("cpu", torch.bfloat16):
        torch.compile(model)(idx)
print(time.perf_counter() - start)
"""


def first_call_seconds(variant: str) -> float:
    """The first call (compile and one forward) of a fresh GPT in a fresh process, which
    imports torch and amp_graph before the clock starts."""
    with tempfile.TemporaryDirectory() as cache:  # no inductor cache from an earlier run
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        out = subprocess.run(
            [sys.executable, "-c", _FIRST_CALL, variant],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small graphs, one repeat")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--layers", type=int, nargs="+", default=None, help="GPT depths (about 36 nodes each)"
    )
    parser.add_argument(
        "--first-call",
        action="store_true",
        help="also the first call of amp_graph.compile O1 against torch.compile under "
        "torch.autocast, each in a fresh process (GPT, 4 layers, dim 128)",
    )
    options = parser.parse_args()
    repeats = options.repeats or (1 if options.quick else 3)
    sizes = options.layers or ((2, 8) if options.quick else (28, 110, 280))  # 1k, 4k, 10k nodes
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, O1 {DTYPE}")
    per_node: list[float] = []  # the passes' seconds per node, by size
    for layers in sizes:
        runs = [compile_seconds(layers) for _ in range(repeats)]
        nodes = runs[0][0]
        stages = list(runs[0][1])
        median = {s: statistics.median(r[1].get(s, 0.0) for r in runs) for s in stages}
        passes = sum(v for k, v in median.items() if k not in ("capture", "rest of compile"))
        total = sum(median.values())
        rest = median["rest of compile"]
        per_node.append(passes / nodes)
        print(
            f"\nGPT, {layers} layers: {nodes} captured nodes; compile {total:.2f} s, capture "
            f"{median['capture']:.2f} s ({median['capture'] / total:.0%} of it), passes "
            f"{passes:.2f} s = {passes / nodes * 1e6:.0f} us per node, rest "
            f"{rest / nodes * 1e6:.0f} us per node"
        )
        print(f"  {'stage':<22} {'seconds':>8} {'us/node':>8} {'share':>6}")
        for stage in sorted(median, key=median.get, reverse=True):
            seconds = median[stage]
            print(
                f"  {stage:<22} {seconds:8.3f} {seconds / nodes * 1e6:8.0f} {seconds / total:6.0%}"
            )
    if len(per_node) > 1:
        print(
            f"\ngrowth: the passes' time per node at {sizes[-1]} layers / at {sizes[0]} layers"
            f" = {per_node[-1] / per_node[0]:.2f} (linear: 1.00; target <= 1.2)"
        )
    if options.first_call:
        rounds = [
            (first_call_seconds("amp_graph"), first_call_seconds("torch.compile"))
            for _ in range(repeats)
        ]  # interleaved: a slow spell of the machine falls on both
        ours, theirs = [r[0] for r in rounds], [r[1] for r in rounds]
        ratio = statistics.median(ours) / statistics.median(theirs)
        print(
            f"\nfirst call, fresh process, GPT (4 layers, dim 128), bf16: amp_graph.compile O1 "
            f"{statistics.median(ours):.2f} s, torch.compile + autocast "
            f"{statistics.median(theirs):.2f} s: {ratio:.3f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
