"""The monitor's CPU statistics kernel against the same statistics as torch ops, per call.

One row of :data:`amp_graph.ops.tensor_stats.STATS` for a tensor of ``--numel`` values, by
``amp_graph_cpu::tensor_stats_`` (the kernel a logging step runs on the CPU) and by
:func:`amp_graph.ops.tensor_stats.measure` (torch ops: the fallback where the kernel cannot be
built), interleaved, medians; the rows are checked equal first. Values like a step's:
activations (randn), ReLU outputs (half zeros), gradients (randn x 1e-5 in float32 and
bf16, x 1e-3 in fp16), each in float32, bf16 and fp16.

    python benchmarks/stats_kernel_bench.py --threads 1     # the run in BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import statistics

import torch
from measure import interleaved_seconds

from amp_graph.ops import cpu_extension
from amp_graph.ops.tensor_stats import STATS, accumulate, measure

RUN_DTYPE = torch.bfloat16


def cases(numel: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    randn = torch.randn(numel, generator=gen)
    return {
        "float32 activations": randn,
        "float32 ReLU outputs": randn.relu(),
        "float32 gradients": randn * 1e-5,
        "bf16 activations": randn.bfloat16(),
        "bf16 gradients": (randn * 1e-5).bfloat16(),
        "fp16 activations": randn.half(),
        "fp16 gradients": (randn * 1e-3).half(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=262_144)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=101)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_extension.load_cpu_extension():
        raise SystemExit(f"the CPU kernel is not built: {cpu_extension.cpu_extension_status()}")
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {args.numel} values, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}; medians of {args.repeats}"
    )
    print(f"{'values':<22} {'kernel':>10} {'torch ops':>10} {'ratio':>7} {'G values/s':>11}")
    row = torch.zeros(1, len(STATS), dtype=torch.float64)
    for name, x in cases(args.numel).items():
        row.zero_()
        accumulate(row, 0, x, RUN_DTYPE)
        if not torch.equal(row[0], measure(x, RUN_DTYPE)):
            raise SystemExit(f"{name}: the kernel's row differs from torch ops'")
        times = interleaved_seconds(
            {
                "kernel": lambda x=x: accumulate(row, 0, x, RUN_DTYPE),
                "torch ops": lambda x=x: measure(x, RUN_DTYPE),
            },
            args.repeats,
            warmup=3,
        )
        kernel, ops = (statistics.median(times[k]) for k in ("kernel", "torch ops"))
        print(
            f"{name:<22} {kernel * 1e6:8.1f}us {ops * 1e6:8.1f}us {ops / kernel:6.1f}x "
            f"{args.numel / kernel / 1e9:10.2f}"
        )


if __name__ == "__main__":
    main()
