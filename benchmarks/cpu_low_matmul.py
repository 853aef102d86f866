"""This CPU's matrix products in bfloat16 and float16 against float32, and what amp_graph's
probe (amp_graph.frontends.cpu_low_speed) decides.

Square products of several sizes, each dtype in turn within a round (rounds interleaved, so
that drift hits all alike); the fastest of ``--repeats`` rounds per dtype and size, and the
ratio to float32's. Run it as it is, and with oneDNN held to AVX2 to see an AVX2-only CPU's
bfloat16 (what CI machines of that kind run):

    python benchmarks/cpu_low_matmul.py
    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/cpu_low_matmul.py
"""

from __future__ import annotations

import argparse

import torch
from measure import cpu_name

from amp_graph.frontends import cpu_low_speed

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| n (n x n x n) | float32 | bfloat16 (/ float32) | float16 (/ float32) |")
    print("|---|---|---|---|")
    for size in args.sizes:
        t = cpu_low_speed.fastest_products(DTYPES, size, args.repeats)
        full = t[torch.float32]
        cells = [f"{t[d] * 1e3:.3f} ms ({t[d] / full:.1f}x)" for d in DTYPES[1:]]
        print(f"| {size} | {full * 1e3:.3f} ms | {' | '.join(cells)} |")
    for dtype in DTYPES[1:]:
        speed = cpu_low_speed.low_matmul_speed(dtype)
        if speed is None:
            print(f"probe, {dtype}: cannot run")
            continue
        action = "warns" if speed.slow else "quiet"
        print(f"probe ({cpu_low_speed.PROBE_SIZE}^3), {dtype}: {speed.ratio:.1f}x: {action}")


if __name__ == "__main__":
    main()
