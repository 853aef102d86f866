"""torch's CPU float8 scaled matmul against amp_graph's emulation and a bfloat16 matmul, side
by side in one run (issue 39, part 4), and what the probe decides on this CPU.

For each size M x K x N: ``torch._scaled_mm`` (float8 e4m3 operands, tensorwise scales,
bfloat16 out), ``amp_graph.ops.fp8_cpu_matmul.emulated_scaled_mm`` on the same operands, and
``a @ b`` in bfloat16; medians of 7 (3 for a kernel over 100 ms), after one warm-up call.
The emulation's result is checked against torch's bit for bit on every size.

    python benchmarks/fp8_cpu_matmul.py
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import torch

from amp_graph.ops.fp8_cpu_matmul import cpu_scaled_mm_is_slow, emulated_scaled_mm

SIZES = [(128, 128, 128), (512, 256, 256), (1024, 1024, 1024)]


def median_ms(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(m: int, k: int, n: int, gen: torch.Generator) -> str:
    """One size's line: the three timings, their ratios, and whether the bits agree."""
    one = torch.ones(())
    a = torch.randn(m, k, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn).t()
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)

    def theirs() -> torch.Tensor:
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    def ours() -> torch.Tensor:
        return emulated_scaled_mm(a, b, one, one, None, torch.bfloat16)

    repeats = 3 if median_ms(theirs, 1) > 100 else 7
    t_theirs, t_ours = median_ms(theirs, repeats), median_ms(ours, 7)
    t_bf16 = median_ms(lambda: a16 @ b16, 7)
    return (
        f"{m}x{k}x{n}: torch._scaled_mm {t_theirs:.2f} ms, emulation {t_ours:.2f} ms, "
        f"bf16 {t_bf16:.2f} ms; torch/emulation {t_theirs / t_ours:.2f}, "
        f"emulation/bf16 {t_ours / t_bf16:.2f}; same bits: {torch.equal(theirs(), ours())}"
    )


def main() -> None:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    units = [f for f in ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_fp16") if f in flags]
    print(f"torch {torch.__version__}, {cpu_name()} ({', '.join(units) or 'no bf16 units'})")
    print(f"{torch.get_num_threads()} threads; probe: torch._scaled_mm slow here: ", end="")
    print(cpu_scaled_mm_is_slow())
    gen = torch.Generator().manual_seed(0)
    for m, k, n in SIZES:
        print(measure(m, k, n, gen))


if __name__ == "__main__":
    main()
