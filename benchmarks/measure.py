"""How the benchmarks measure: interleaved timing and the peak memory of one step.

Every script in this folder imports this module (they run as ``python benchmarks/x.py``,
which puts this folder on ``sys.path``; the tests add it themselves).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU."""
    if device == "cuda":
        torch.cuda.synchronize()


def release(device: str) -> None:
    """Let go of what earlier measurements left on the device: dynamo's compiled graphs
    (and the CUDA graph pools torch.compile's reduce-overhead trees hold), the reference
    cycles a ``Graph`` or a compiled module sits in, and the allocator's cached blocks. A
    script that measures one setup after another calls it between them, so that a later
    setup's peak memory is its own and an 80 GB GPU holds it."""
    import gc

    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def interleaved_seconds(
    steps: dict[str, Callable[[], object]],
    repeats: int,
    *,
    warmup: int = 0,
    device: str = "cpu",
    seed: int = 0,
) -> dict[str, list[float]]:
    """Each step's wall times over ``repeats`` rounds. Every round runs each step once, so
    that machine drift hits every variant alike, in an order shuffled per round (seeded by
    ``seed``, so a rerun repeats it): a fixed order (ABCD ABCD ...) gives whichever step
    follows another the caches that step left, a bias measured at about 1% on a CPU
    (BENCHMARKS.md, "How the benchmarks measure"). ``warmup`` untimed calls of each first."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    rounds = random.Random(seed)
    for _ in range(repeats):
        rounds.shuffle(order)
        for name in order:
            step = steps[name]
            sync(device)
            start = time.perf_counter()
            step()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return times


def peak_cpu_step_mb(step: Callable[[], object]) -> float:
    """Peak of the bytes allocated during one step (activations, casts, gradients), from the
    profiler: each event's own allocations minus frees, summed in time order (op granularity)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return _peak_mb(prof.events(), float("-inf"), float("inf"))


def peak_cpu_next_step_mb(step: Callable[[], object]) -> float:
    """Like :func:`peak_cpu_step_mb`, but for the second of two steps profiled together, from
    the bytes live at its start: what a step frees of the step before (gradients set to None)
    counts, which the profiler cannot attribute for blocks allocated before it started."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        with record_function("measure.next_step"):
            step()
    events = prof.events()
    marker = next(e for e in events if e.name == "measure.next_step")
    return _peak_mb(events, marker.time_range.start, marker.time_range.end)


def _peak_mb(events: Any, start: float, end: float) -> float:
    """The peak, in MiB, of the profiled events' own allocations minus frees, summed in time
    order over the events that start within [start, end]."""
    timed = sorted(
        (e for e in events if e.self_cpu_memory_usage and start <= e.time_range.start <= end),
        key=lambda e: e.time_range.start,
    )
    live = peak = 0
    for event in timed:
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak / 2**20


def cpu_name() -> str:
    """The CPU's model name and whether it has AVX512-BF16, from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if "model name" in ln), "")
    bf16 = "avx512_bf16" in text
    return f"{name or 'unknown CPU'} ({'with' if bf16 else 'no'} AVX512-BF16)"
