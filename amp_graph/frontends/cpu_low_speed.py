"""Whether the running CPU computes matrix products in the low dtype faster than in float32,
found by timing one.

A low-precision plan on a CPU buys speed only where the CPU has units for the dtype:
AVX512-BF16 or AMX for bfloat16, AVX512-FP16 or AMX-FP16 for float16. Elsewhere torch still
computes the products, by a slow path: with oneDNN held to AVX2 (what an AVX2-only EPYC
runs), bfloat16 products of 64 to 512 took 20-57x float32's time, and on an AVX512-BF16
EPYC without AVX512-FP16 float16 ones took 8-54x (BENCHMARKS.md). torch.autocast says
nothing, and the user sees only a slow step.

:func:`low_matmul_speed` times one :data:`PROBE_SIZE`-cubed product in the low dtype and in
float32, once per process and dtype. :func:`warn_if_low_matmul_is_slow` is called at every
entry point whose graph runs in this process (``compile``, the backend, ``Graph``,
``autopolicy``: :func:`amp_graph.frontends.front_door.admit`) for a CPU model whose policy
computes something low; where the low product takes over :data:`SLOWER` times float32's, it
warns once, with the measured factor and what to do, at the user's line (the first frame
outside amp_graph and torch). The plan is kept as asked: the low dtype still halves the
bytes. ``amp_graph.export`` does not ask: an exported program runs elsewhere.

>>> low_matmul_speed(torch.float32) is None  # nothing to compare
True
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings

import torch

from amp_graph.frontends.user_frames import users_stacklevel
from amp_graph.policy import Policy

SLOWER = 4.0
"""A low product over this many times float32's time is slow: at the probe's size a native
unit measured 1.1-1.2x, a slow path 20-40x (BENCHMARKS.md)."""

PROBE_SIZE = 128

_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_UNITS = {torch.bfloat16: "AVX512-BF16 or AMX", torch.float16: "AVX512-FP16 or AMX-FP16"}


@dataclasses.dataclass(frozen=True)
class LowMatmulSpeed:
    """One product's time in the low dtype and in float32, on this CPU (seconds)."""

    dtype: torch.dtype
    low_seconds: float
    float32_seconds: float

    @property
    def ratio(self) -> float:
        """The low product's time over float32's."""
        return self.low_seconds / self.float32_seconds

    @property
    def slow(self) -> bool:
        return self.ratio > SLOWER


def fastest_products(
    dtypes: tuple[torch.dtype, ...], size: int, rounds: int
) -> dict[torch.dtype, float]:
    """The fastest of ``rounds`` ``size``-cubed products in each of ``dtypes``, the dtypes in
    alternation within a round (other work on the machine then slows them alike, and the
    fastest is the least disturbed), after a round that warms up (oneDNN builds its
    primitive once)."""
    gen = torch.Generator().manual_seed(0)
    operands = {
        dtype: [torch.randn(size, size, generator=gen).to(dtype) for _ in range(2)]
        for dtype in dtypes
    }
    fastest = dict.fromkeys(dtypes, float("inf"))
    for round_ in range(rounds + 1):
        for dtype, (a, b) in operands.items():
            start = time.perf_counter()
            torch.mm(a, b)
            if round_:  # round 0 warms up
                fastest[dtype] = min(fastest[dtype], time.perf_counter() - start)
    return fastest


def _measure(dtype: torch.dtype) -> tuple[float, float]:
    """The probe: seven products in ``dtype`` and in float32 (seconds, the fastest of each)."""
    fastest = fastest_products((dtype, torch.float32), PROBE_SIZE, rounds=7)
    return fastest[dtype], fastest[torch.float32]


@functools.cache
def low_matmul_speed(dtype: torch.dtype) -> LowMatmulSpeed | None:
    """The time of one product in ``dtype`` against float32 on this CPU, measured once per
    process and dtype; None for a dtype that is not low, or where the product cannot run."""
    if dtype not in _NAMES:
        return None
    from torch.utils._python_dispatch import _disable_current_modes

    try:  # real tensors, whatever trace or mode the caller runs under
        with _disable_current_modes(), torch.autocast("cpu", enabled=False), torch.no_grad():
            low, full = _measure(dtype)
    except (RuntimeError, NotImplementedError):
        return None
    return LowMatmulSpeed(dtype, low, full)


def slow_low_matmul_message(speed: LowMatmulSpeed) -> str:
    """What the warning says: the measured factor, why, and the ways out."""
    name = _NAMES[speed.dtype]
    size = f"{PROBE_SIZE}x{PROBE_SIZE}x{PROBE_SIZE}"
    message = (
        f"amp_graph: on this CPU a {size} {name} matrix product takes {speed.ratio:.0f}x "
        f"float32's time ({speed.low_seconds * 1e3:.2f} ms against "
        f"{speed.float32_seconds * 1e3:.2f} ms): without {_UNITS[speed.dtype]} units torch "
        f"computes {name} products by a slow path. The {name} plan is kept (its tensors take "
        "half the bytes); for speed here use policy='O0' (float32)"
    )
    other = torch.bfloat16 if speed.dtype == torch.float16 else None
    other_speed = low_matmul_speed(other) if other is not None else None
    if other_speed is not None and not other_speed.slow:
        message += f", or dtype=torch.bfloat16 ({other_speed.ratio:.1f}x float32's time here)"
    return message + ", or a GPU."


def warn_if_low_matmul_is_slow(policy: Policy, dtype: torch.dtype, device_type: str) -> None:
    """Warn (once per process and dtype) where a CPU model's plan computes in ``dtype`` and
    this CPU's ``dtype`` products take over :data:`SLOWER` times float32's."""
    if device_type != "cpu" or policy.changes_nothing:
        return
    speed = low_matmul_speed(dtype)
    if speed is not None and speed.slow and dtype not in _warned:
        _warned.add(dtype)
        warnings.warn(slow_low_matmul_message(speed), UserWarning, stacklevel=users_stacklevel())


_warned: set[torch.dtype] = set()


def forget() -> None:
    """Forget what was measured and warned, so that the next call measures again."""
    low_matmul_speed.cache_clear()
    _warned.clear()


__all__ = [
    "PROBE_SIZE",
    "SLOWER",
    "LowMatmulSpeed",
    "fastest_products",
    "forget",
    "low_matmul_speed",
    "slow_low_matmul_message",
    "warn_if_low_matmul_is_slow",
]
