"""Sweep of the check+unscale kernel's build-time tuning knobs, against ``cudaMemcpyAsync``.

    python benchmarks/kernel_sweep.py                    # on a GPU: build every variant, run it
    python benchmarks/kernel_sweep.py --json sweep.json
    python benchmarks/kernel_sweep.py --compile-only     # anywhere nvcc is: build, do not run

Each variant compiles the library's own ``amp_graph/ops/csrc/amp_kernels.cu`` with some of the
knobs of ``tiling.h`` / ``amp_kernels.cu`` set by ``-D`` (``AMP_GRAPH_UNROLL``: 16-byte vectors in
flight per thread; ``AMP_GRAPH_TILE_VECS``: vectors per tile; ``AMP_GRAPH_MIN_BLOCKS``: blocks
per multiprocessor asked of the register allocator; ``AMP_GRAPH_STREAMING``: streaming cache
hints; ``AMP_GRAPH_CONTIGUOUS_TILES``: each block a contiguous run of tiles), beside the
harness ``benchmarks/kernel_sweep.cu`` (no torch), and runs it: one tensor of 1e8 elements in
fp32, fp16 and bf16, and GPT-2 small's 148 gradients in fp32 and fp16. Printed
per case: the kernel's GB/s over the copy's (medians of interleaved rounds, CUDA events), the
grid, and whether an unscale by 0.5 gave every element exactly. The extension itself always builds
with the defaults (the ``base`` variant); this script only measures what other values would give.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "amp_graph" / "ops" / "csrc"
HARNESS = Path(__file__).resolve().parent / "kernel_sweep.cu"

VARIANTS: dict[str, dict[str, int]] = {
    "base": {},  # the library's build: unroll 4, tiles of 2048 vectors, no bound, plain hints
    "streaming hints": {"AMP_GRAPH_STREAMING": 1},  # the default until 2026-11-28's sweep
    "min 5 blocks": {"AMP_GRAPH_MIN_BLOCKS": 5},
    "min 6 blocks": {"AMP_GRAPH_MIN_BLOCKS": 6},
    "tile 8192": {"AMP_GRAPH_TILE_VECS": 8192},
    "tile 512": {"AMP_GRAPH_TILE_VECS": 512},
    "unroll 8": {"AMP_GRAPH_UNROLL": 8},
    "unroll 8, min 3": {"AMP_GRAPH_UNROLL": 8, "AMP_GRAPH_MIN_BLOCKS": 3},
    "unroll 2, min 6": {"AMP_GRAPH_UNROLL": 2, "AMP_GRAPH_MIN_BLOCKS": 6},
    "unroll 8, tile 8192": {"AMP_GRAPH_UNROLL": 8, "AMP_GRAPH_TILE_VECS": 8192},
    # each block one contiguous run of tiles (block_tiles), not grid-stride; with smaller tiles
    # the last wave's imbalance (at most one tile per block) shrinks without shared-tile costs
    "contiguous tiles": {"AMP_GRAPH_CONTIGUOUS_TILES": 1},
    "contiguous, tile 1024": {"AMP_GRAPH_CONTIGUOUS_TILES": 1, "AMP_GRAPH_TILE_VECS": 1024},
}


def nvcc_command(flags: dict[str, int], out: Path, arch: str) -> list[str]:
    """The build of one variant: the harness and the library's kernel, one executable."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("nvcc not found: the sweep compiles the kernel itself")
    defines = [f"-D{name}={value}" for name, value in flags.items()]
    return [
        nvcc, "-O3", "-std=c++17", f"-arch={arch}", *defines, f"-I{CSRC}",
        str(HARNESS), str(CSRC / "amp_kernels.cu"), "-o", str(out),
    ]  # fmt: skip


def build_all(variants: dict[str, dict[str, int]], folder: Path, arch: str) -> dict[str, Path]:
    """Every variant's executable, built in parallel."""

    def build(item: tuple[str, dict[str, int]]) -> tuple[str, Path]:
        name, flags = item
        exe = folder / ("sweep_" + "".join(c if c.isalnum() else "_" for c in name))
        done = subprocess.run(nvcc_command(flags, exe, arch), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {name!r} failed:\n{done.stderr[-3000:]}")
        return name, exe

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        return dict(pool.map(build, variants.items()))


def run_variant(exe: Path, reps: int) -> list[dict]:
    done = subprocess.run([str(exe), str(reps)], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{exe.name} failed: {done.stderr[-2000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30, help="timed rounds per case")
    parser.add_argument("--json", type=Path, default=None, help="also write every row here")
    parser.add_argument("--compile-only", action="store_true", help="build (for sm_90), no run")
    parser.add_argument(
        "--only", nargs="+", default=None, help='variant names, each quoted ("unroll 8, min 3")'
    )
    args = parser.parse_args(argv)
    variants = VARIANTS
    if args.only:
        wanted = args.only
        unknown = [name for name in wanted if name not in VARIANTS]
        if unknown:
            parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
        variants = {name: VARIANTS[name] for name in wanted}
    with tempfile.TemporaryDirectory() as tmp:
        exes = build_all(variants, Path(tmp), "sm_90" if args.compile_only else "native")
        if args.compile_only:
            print(f"built {len(exes)} variants: {', '.join(exes)}")
            return 0
        rows = []
        print(f"{'variant':<28} {'case':<9} {'dtype':<5} {'ms':>8} {'GB/s':>7} {'/copy':>6} "
              f"{'grid':>5} {'blk/SM':>6} exact")  # fmt: skip
        for name, exe in exes.items():
            for row in run_variant(exe, args.reps):
                row["variant"] = name
                row["flags"] = variants[name]
                rows.append(row)
                print(
                    f"{name:<28} {row['case']:<9} {row['dtype']:<5} {row['ms']:>8.4f} "
                    f"{row['gbps']:>7.0f} {row['gbps'] / row['copy_gbps']:>6.3f} "
                    f"{row['grid']:>5} {row['blocks_per_sm']:>6} {row['exact']}",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if not all(row["exact"] for row in rows):
        print("SOME VARIANT GAVE INEXACT RESULTS", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
