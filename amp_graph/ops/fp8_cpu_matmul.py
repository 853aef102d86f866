"""The CPU's float8 scaled matmul, where torch's is slow: the same arithmetic, from float32.

``torch._scaled_mm`` on a CPU either emulates (its operands widened to float32, multiplied by
their scales, one float32 matmul, the bias added, the result cast to ``out_dtype``) or, on
Xeons with AMX, calls oneDNN, which has no optimized float8 matmul there and runs its
reference kernel: a 512x256 by 256x256 product took 1.67 s against 1.7 ms in bfloat16
(issue 39, torch 2.13). Elsewhere (an AVX512-BF16 EPYC, torch 2.13) torch's kernel is the
emulation, as fast as the same steps written in torch ops (0.82 and 0.72 ms for that
product), and nothing changes.

:func:`cpu_scaled_mm_is_slow` times both once per process on a 128x128x128 product; where
torch's is more than :data:`SLOWER` times slower, amp_graph's fp8 linears call
:func:`emulated_scaled_mm` instead and a warning says so once. A float8 value widens to
float32 exactly, so the emulation computes what torch's emulated path computes, bit for bit
(tested against ``torch._scaled_mm`` on every CPU the suite runs on, tensorwise and rowwise,
with and without bias). Against oneDNN's reference kernel (AMX Xeons) the bits may differ in
the last place: that kernel accumulates in its own order.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings

import torch

log = logging.getLogger(__name__)

SLOWER = 4.0  # torch's kernel this many times slower than the emulation: use the emulation
_PROBE_SIZE = 128


def emulated_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``torch._scaled_mm(a, b, scale_a=, scale_b=, bias=, out_dtype=)`` as torch's CPU
    emulation computes it (``scale_a``/``scale_b``: dequantization scales, a scalar or one
    per row of ``a`` / column of ``b``)."""
    out = (a.to(torch.float32) * scale_a) @ (b.to(torch.float32) * scale_b)
    if bias is not None:
        out = out + bias
    return out.to(out_dtype)


def _median_seconds(run: object, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@functools.cache
def cpu_scaled_mm_is_slow() -> bool:
    """Whether this CPU's ``torch._scaled_mm`` is over :data:`SLOWER` times slower than
    :func:`emulated_scaled_mm` (timed once per process; False where it cannot run)."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    from torch.utils._python_dispatch import _disable_current_modes

    size = _PROBE_SIZE
    # real tensors, whatever trace or mode the first fp8 linear runs under (it may call this
    # while inductor compiles its backward); fixed values, no random generator, which torch
    # 2.11 refuses there
    try:
        with _disable_current_modes(), torch.autocast("cpu", enabled=False), torch.no_grad():
            values = torch.arange(size * size, dtype=torch.float32).reshape(size, size)
            values = values % 13 / 4 - 1.5
            one = torch.ones((), dtype=torch.float32)
            a = values.to(torch.float8_e4m3fn)
            b = values.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major

            def torch_kernel() -> torch.Tensor:
                return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

            def emulation() -> torch.Tensor:
                return emulated_scaled_mm(a, b, one, one, None, torch.bfloat16)

            torch_kernel(), emulation()  # warm up (oneDNN builds its primitive once)
            ours = _median_seconds(emulation)
            theirs = _median_seconds(torch_kernel, repeats=1 if ours * 50 < 0.01 else 3)
    except (RuntimeError, NotImplementedError):
        return False  # no float8 matmul at all: fp8_matmul_error says so where it matters
    slow = theirs > SLOWER * ours
    if slow:
        warnings.warn(
            f"amp_graph: torch._scaled_mm on this CPU took {theirs * 1e3:.1f} ms for a "
            f"{size}x{size}x{size} float8 product, {theirs / ours:.0f}x the same arithmetic "
            "written from float32 (oneDNN's reference kernel on AMX Xeons, a slow emulation "
            "elsewhere); amp_graph's fp8 linears compute it that way instead, with the same "
            "result as torch's CPU emulation (amp_graph.ops.fp8_cpu_matmul)",
            stacklevel=2,
        )
    log.info("torch._scaled_mm on this CPU: %.3f ms; emulation %.3f ms", theirs * 1e3, ours * 1e3)
    return slow


__all__ = ["SLOWER", "cpu_scaled_mm_is_slow", "emulated_scaled_mm"]
