"""Benchmark of the amp_graph gradient ops against torch's op and a plain copy of the same bytes.

    python benchmarks/kernel_bench.py                 # CUDA if present, else the CPU path
    python benchmarks/kernel_bench.py --device cpu --reps 7 --threads 1
    python benchmarks/kernel_bench.py --peak-gbps 3350 --json results.json

Cases (on CUDA; a CPU run uses smaller sizes and says so):

* ``1x1e8``: one tensor of 1e8 elements;
* ``10000x1e4``: 10,000 tensors of 1e4 elements;
* ``10000x1e3``: 10,000 small tensors of 1e3 elements (packed several per block by our kernel);
* ``gpt2_mix``: the parameter shapes of GPT-2 small (148 tensors, 124M elements);

each in float32, float16 and bfloat16, for three variants:

* ``unscale``: ``amp_graph::non_finite_check_and_unscale_`` vs
  ``torch._amp_foreach_non_finite_check_and_unscale_`` (reads and writes every byte);
* ``check``: ``amp_graph::non_finite_check_`` (reads only) vs the same torch op, which is what
  ``torch.amp.GradScaler`` runs for fused optimizers (with inv_scale = 1);
* ``norm``: ``amp_graph::non_finite_check_unscale_and_norm_`` vs torch's op followed by
  ``torch._foreach_norm`` (what ``unscale_`` + ``clip_grad_norm_`` cost).

``host ns/tensor`` is the host's time per call divided by the number of tensors, ours and
torch's (``time.perf_counter`` around the calls alone, the GPU never waited for): with thousands
of small tensors the call's host work, not the kernel, sets the pace. Ours is then the check of
the list's fingerprint (``csrc/launch_plan.h``) and the unboxed call (``csrc/python_entry.cpp``).

``copy`` is a float32 ``copy_`` of a buffer as large as the gradients (reads and writes the same
number of bytes): the practical bandwidth limit. ``in place`` is a float32 ``mul_`` of such a
buffer by a one-element tensor: torch's own in-place pass over the same bytes, reading and
writing the same addresses as an in-place unscale must (the ceiling for such a kernel, where
it sits below the copy's). GB/s counts the bytes each variant must move
(unscale/norm: read + write; check: read). Ours, torch's and the copy are timed in interleaved
rounds (one of each per round, CUDA events on a GPU); the figures are medians over ``--reps``
rounds. Gradients hold finite values and inv_scale is 1.0, so repeated runs leave them unchanged
(torch's kernel still stores every element in that case). The peak bandwidth comes from the
device properties (memory clock x bus width x 2), else from a table of known GPUs, else
``--peak-gbps``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from amp_graph.ops import cuda_extension
from amp_graph.ops import scaler_ops as ops

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Memory bandwidth (GB/s) of common GPUs by a substring of their name, most specific first, for
# when the device properties do not tell (CUDA 13 dropped the memory clock from them).
KNOWN_PEAKS_GBPS = {
    "GH200": 4000.0,
    "H200": 4800.0,
    "H100 NVL": 3900.0,
    "H100 PCIe": 2000.0,
    "H100 80GB HBM3": 3350.0,  # H100 SXM5
    "H100": 3350.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,
    "L4": 300.0,
}


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of GPT-2 small (124M parameters)."""
    d, layers, vocab, context = 768, 12, 50257, 1024
    shapes: list[tuple[int, ...]] = [(vocab, d), (context, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,)]  # ln_1, attn, proj
        shapes += [(d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]  # ln_2, mlp
    return [*shapes, (d,), (d,)]  # ln_f


def cases(device: str) -> dict[str, list[tuple[int, ...]]]:
    if device == "cuda":
        return {
            "1x1e8": [(100_000_000,)],
            "10000x1e4": [(10_000,)] * 10_000,
            "10000x1e3": [(1_000,)] * 10_000,
            "gpt2_mix": gpt2_small_shapes(),
        }
    # CPU: same shapes of problem, 1/50 of the bytes, so the run takes seconds.
    return {
        "1x2e6": [(2_000_000,)],
        "1000x2e3": [(2_000,)] * 1_000,
        "1000x2e2": [(200,)] * 1_000,
        "gpt2_mix/64": [tuple(max(1, s // 8) for s in shape) for shape in gpt2_small_shapes()],
    }


@dataclass
class Row:
    case: str
    dtype: str
    variant: str
    tensors: int
    mbytes: float  # gradient bytes, MB
    ours_ms: float
    torch_ms: float
    copy_ms: float
    ours_gbps: float
    torch_gbps: float
    copy_gbps: float
    pct_peak: float | None
    speedup_vs_torch: float
    fraction_of_copy: float
    ours_host_ns_per_tensor: float = math.nan
    torch_host_ns_per_tensor: float = math.nan
    inplace_ms: float = math.nan  # torch's float32 mul_ in place over the same bytes
    inplace_gbps: float = math.nan
    fraction_of_inplace: float = math.nan


def _time_ms(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def interleaved_medians(
    fns: dict[str, Callable[[], object]], device: str, reps: int, warmup: int = 2
) -> dict[str, float]:
    """Median ms of each function over ``reps`` rounds, each round running every one once."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    if device == "cuda":
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(_time_ms(fn, device))
    return {name: statistics.median(t) for name, t in times.items()}


def host_ns_per_tensor(fn: Callable[[], object], tensors: int, device: str, reps: int) -> float:
    """Median host time of one call of ``fn`` per tensor, in ns: only the call is timed, and the
    GPU work it queues is waited for between calls, outside the timing."""
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    if device == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times) * 1e9 / max(tensors, 1)


def peak_gbps(device: str, override: float | None) -> tuple[float | None, str]:
    """The memory-bandwidth peak and where it came from."""
    if override is not None:
        return override, "--peak-gbps"
    if device != "cuda":
        return None, "no GPU"
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "device properties"  # double data rate
    for name, gbps in KNOWN_PEAKS_GBPS.items():
        if name.lower() in props.name.lower():
            return gbps, f"table entry {name!r}"
    return None, f"unknown GPU {props.name!r}: pass --peak-gbps"


def torch_runs(fn: Callable[[], object]) -> bool:
    """Whether torch's counterpart runs on these gradients (its CUDA unscale has no bfloat16
    kernel: that column is then nan rather than the run failing)."""
    try:
        fn()
    except NotImplementedError:
        return False
    return True


def measure(
    case: str,
    dtype_name: str,
    grads: list[torch.Tensor],
    device: str,
    reps: int,
    peak: float | None,
    only: set[str] | None,
) -> list[Row]:
    """Time every variant, torch's counterpart and the copy for one set of gradients."""
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    in_place = torch.ones_like(src)  # multiplied by one: it stays ones
    found = torch.zeros((), device=device)
    inv = torch.ones((), device=device)

    def torch_unscale() -> None:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)

    def torch_unscale_and_norm() -> None:
        torch_unscale()
        torch.stack(torch._foreach_norm(grads)).norm()

    variants = {  # name: (ours, torch's counterpart, bytes ours must move)
        "unscale": (lambda: ops.non_finite_check_and_unscale_(grads, found, inv), torch_unscale, 2),
        "check": (lambda: ops.non_finite_check_(grads, found), torch_unscale, 1),
        "norm": (
            lambda: ops.non_finite_check_unscale_and_norm_(grads, found, inv),
            torch_unscale_and_norm,
            2,
        ),
    }
    rows = []
    for variant, (ours, theirs, passes) in variants.items():
        if only and variant not in only:
            continue
        fns = {"ours": ours, "copy": lambda: dst.copy_(src), "in place": lambda: in_place.mul_(inv)}
        if torch_runs(theirs):
            fns["torch"] = theirs
        med = interleaved_medians(fns, device, reps)
        ours_ms, copy_ms = med["ours"], med["copy"]
        torch_ms = med.get("torch", math.nan)  # nan: torch has no kernel for this dtype here
        host = {  # ours and torch's: the copy's host time means nothing here
            name: host_ns_per_tensor(fn, len(grads), device, reps)
            for name, fn in fns.items()
            if name not in ("copy", "in place")
        }
        ours_gbps = passes * nbytes / ours_ms / 1e6
        copy_gbps = 2 * nbytes / copy_ms / 1e6
        inplace_gbps = 2 * nbytes / med["in place"] / 1e6
        rows.append(
            Row(
                case=case,
                dtype=dtype_name,
                variant=variant,
                tensors=len(grads),
                mbytes=nbytes / 1e6,
                ours_ms=ours_ms,
                torch_ms=torch_ms,
                copy_ms=copy_ms,
                ours_gbps=ours_gbps,
                torch_gbps=2 * nbytes / torch_ms / 1e6,  # torch's op reads and writes
                copy_gbps=copy_gbps,
                pct_peak=None if peak is None else 100 * ours_gbps / peak,
                speedup_vs_torch=torch_ms / ours_ms,
                fraction_of_copy=ours_gbps / copy_gbps,
                ours_host_ns_per_tensor=host["ours"],
                torch_host_ns_per_tensor=host.get("torch", math.nan),
                inplace_ms=med["in place"],
                inplace_gbps=inplace_gbps,
                fraction_of_inplace=ours_gbps / inplace_gbps,
            )
        )
        print(format_row(rows[-1]), flush=True)
    if found.item() != 0.0:
        raise RuntimeError("benchmark gradients must stay finite")
    return rows


def bench(device: str, reps: int, peak: float | None, only: set[str] | None) -> list[Row]:
    rows = []
    for case, shapes in cases(device).items():
        for dtype_name, dtype in DTYPES.items():
            grads = [torch.randn(shape, device=device).to(dtype) for shape in shapes]
            rows += measure(case, dtype_name, grads, device, reps, peak, only)
    return rows


HEADER = (
    f"{'case':<12} {'dtype':<5} {'variant':<8} {'MB':>8} {'ours ms':>9} {'torch ms':>9} "
    f"{'copy ms':>9} {'ours GB/s':>10} {'torch GB/s':>10} {'copy GB/s':>10} {'%peak':>6} "
    f"{'x torch':>8} {'/copy':>6} {'/in place':>9} {'host ns/t ours':>14} {'torch':>6}"
)


def format_row(r: Row) -> str:
    pct = "-" if r.pct_peak is None else f"{r.pct_peak:.0f}"
    return (
        f"{r.case:<12} {r.dtype:<5} {r.variant:<8} {r.mbytes:>8.1f} {r.ours_ms:>9.3f} "
        f"{r.torch_ms:>9.3f} {r.copy_ms:>9.3f} {r.ours_gbps:>10.1f} {r.torch_gbps:>10.1f} "
        f"{r.copy_gbps:>10.1f} {pct:>6} {r.speedup_vs_torch:>8.2f} {r.fraction_of_copy:>6.2f} "
        f"{r.fraction_of_inplace:>9.2f} "
        f"{r.ours_host_ns_per_tensor:>14.0f} {r.torch_host_ns_per_tensor:>6.0f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--reps", type=int, default=None, help="timed runs per measurement")
    parser.add_argument("--peak-gbps", type=float, default=None, help="memory bandwidth peak")
    parser.add_argument("--variants", default=None, help="comma list: unscale,check,norm")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but no CUDA device is available")
    reps = args.reps or (20 if device == "cuda" else 5)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    if device == "cpu":
        print(
            "NO GPU FOUND: running the CPU path (the ops' torch-native implementation, not the "
            "CUDA kernel), with 1/50 of the GPU case sizes. These numbers say nothing about "
            "the kernel; run this script on a CUDA machine for those."
        )
    else:
        ops.non_finite_check_([torch.zeros(1, device="cuda")], torch.zeros((), device="cuda"))
        status = cuda_extension.extension_status()
        print(f"device: {torch.cuda.get_device_name()}; amp_graph extension: {status.state}")
        if status.state != "loaded":
            print(f"  (extension not loaded: {status.detail}; timing the fallback)")
    peak, peak_source = peak_gbps(device, args.peak_gbps)
    print(
        f"peak memory bandwidth: {'unknown' if peak is None else f'{peak:.0f} GB/s'} "
        f"({peak_source})"
    )
    print(
        f"medians of {reps} interleaved rounds; 'x torch' = torch ms / ours ms; "
        "'/copy' = ours GB/s / copy GB/s; '/in place' = ours GB/s / an in-place mul_'s"
    )
    print(HEADER)
    only = set(args.variants.split(",")) if args.variants else None
    rows = bench(device, reps, peak, only)
    if args.json:
        meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
        meta |= {"torch": torch.__version__, "peak_gbps": peak, "peak_source": peak_source}
        meta["extension"] = cuda_extension.extension_status().state
        args.json.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
