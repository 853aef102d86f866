"""Where the time of ``amp_graph.compile`` goes, per pass, on GPT-style decoders of about 1k to
10k nodes: the capture (``torch.export`` under the policy) beside each pass, in microseconds
per node of the captured graph, and export's share of the whole.

The baseline for issue 20's "fast passes" (target: the passes at most 100 us per node on the
10k-node graph). Each size is compiled ``--repeats`` times from a fresh model (medians).

    python benchmarks/pass_bench.py              # 1k, 4k and 10k nodes, 3 repeats
    python benchmarks/pass_bench.py --quick      # small graphs, one repeat (a smoke run)
"""

from __future__ import annotations

import argparse
import statistics

import torch

import amp_graph
from amp_graph import models
from amp_graph.compiler import compile_record

DTYPE = torch.bfloat16


def compile_seconds(layers: int) -> tuple[int, dict[str, float]]:
    """(nodes of the rewritten graph, seconds by stage) of one compile of a fresh GPT."""
    torch.manual_seed(0)
    model = models.GPT(vocab=64, block=16, dim=32, heads=2, layers=layers)
    idx = torch.randint(0, 64, (1, 16))
    compiled = amp_graph.compile(model, "O1", DTYPE, example_inputs=(idx,))
    record = compile_record(compiled)
    captured_nodes = len(record.original.graph.nodes)
    return captured_nodes, dict(record.seconds)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small graphs, one repeat")
    parser.add_argument("--repeats", type=int, default=None)
    options = parser.parse_args()
    repeats = options.repeats or (1 if options.quick else 3)
    sizes = (2, 8) if options.quick else (28, 110, 280)  # about 1k, 4k and 10k nodes
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, O1 {DTYPE}")
    for layers in sizes:
        runs = [compile_seconds(layers) for _ in range(repeats)]
        nodes = runs[0][0]
        stages = list(runs[0][1])
        median = {s: statistics.median(r[1].get(s, 0.0) for r in runs) for s in stages}
        passes = sum(v for k, v in median.items() if k != "capture")
        total = passes + median["capture"]
        print(
            f"\nGPT, {layers} layers: {nodes} captured nodes; capture {median['capture']:.2f} s "
            f"({median['capture'] / total:.0%} of the compile), passes {passes:.2f} s = "
            f"{passes / nodes * 1e6:.0f} us per node"
        )
        print(f"  {'stage':<22} {'seconds':>8} {'us/node':>8} {'share':>6}")
        for stage in sorted(median, key=median.get, reverse=True):
            seconds = median[stage]
            print(
                f"  {stage:<22} {seconds:8.3f} {seconds / nodes * 1e6:8.0f} {seconds / total:6.0%}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
