"""Statistics of a tensor, computed on its device into a buffer row: the monitor's graph ops.

:func:`record_stats` (a forward value) and :func:`record_grad_stats` (the gradient that
backward computes for a value) are the calls ``passes.instrument`` puts into a graph. Each
adds one row of :data:`STATS` into a :class:`StatsSink`'s buffer with a few tensor ops on the
tensor's device: no host synchronization, no Python branch on a tensor's values. The
monitor (:mod:`amp_graph.monitoring`) reads the buffer on the host only when asked.

The statistics of a value ``x`` that an op runs in ``run_dtype`` (the dtype the op casts it
to, or its own), at ``scale`` (the fp8 quantization's, else 1), counting elements:

* ``amax``: the largest finite ``|x|`` (0 where none is finite);
* ``zeros``: elements equal to 0;
* ``underflow``: nonzero elements that are zero or subnormal in ``run_dtype`` at ``scale``
  (``x != 0 and |(x * scale).to(run_dtype)| < finfo(run_dtype).tiny``): what the op loses;
* ``nonfinite``: inf and nan elements;
* ``<fmt>_underflow`` / ``<fmt>_overflow`` for ``fmt`` in fp16, bf16, e4m3, e5m2: the what-if
  of Transformer Engine's ``underflows%`` / ``overflows%``: nonzero elements that a cast of
  ``x * scale`` to that format rounds to 0, and finite elements whose ``|x * scale|``
  exceeds its largest finite value (where a cast gives inf, or clips as e4m3 does);
* ``numel``: the elements counted (so that accumulated counts give fractions).

A row accumulates: ``amax`` by maximum, everything else by sum, so that micro-batches of a
step (or several calls) add up.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

from amp_graph.ops import cpu_extension
from amp_graph.ops.dtensors import is_dtensor

__all__ = [
    "STATS",
    "STAT_GROUPS",
    "WHATIF_FORMATS",
    "StatsSink",
    "accumulate",
    "measure",
    "record_grad_stats",
    "record_stats",
]

WHATIF_FORMATS: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
}

STATS: tuple[str, ...] = (
    "amax",
    "zeros",
    "underflow",
    "nonfinite",
    *(f"{fmt}_{side}" for fmt in WHATIF_FORMATS for side in ("underflow", "overflow")),
    "numel",
)
_COLUMN = {name: i for i, name in enumerate(STATS)}

# what ``stats=`` may name: a group switches its columns on
STAT_GROUPS: dict[str, tuple[str, ...]] = {
    "amax": ("amax",),
    "zeros": ("zeros",),
    "underflow": ("underflow",),
    "nonfinite": ("nonfinite",),
    "whatif": tuple(s for s in STATS if s.split("_")[0] in WHATIF_FORMATS),
}


@functools.cache
def _zero_threshold(dtype: torch.dtype) -> float:
    """Magnitudes at or below this round to 0 in ``dtype``: half its smallest subnormal (a
    tie rounds to even, and 0 is even)."""
    info = torch.finfo(dtype)
    return info.tiny * info.eps / 2


@functools.cache
def _normal_threshold(dtype: torch.dtype) -> float:
    """Magnitudes below this are zero or subnormal once in ``dtype``. For a format narrower
    than float32: halfway between its largest subnormal and its smallest normal (the tie
    rounds up to the normal, whose mantissa is even). float32 and float64 values are
    measured as they are: their own smallest normal."""
    info = torch.finfo(dtype)
    if dtype in (torch.float32, torch.float64):
        return info.tiny
    return info.tiny - info.tiny * info.eps / 2


class StatsSink:
    """Where an instrumented graph's probes write: one buffer row per probe.

    ``buffer`` is ``[probes, len(STATS)]`` float64 on the model's device, or None (the
    probes then do nothing). ``columns``: the :data:`STATS` indices to compute (the others
    stay 0). The monitor installs a new ``buffer`` per logging step; a gradient hook keeps
    writing into the buffer of the step that registered it. A step replayed from a CUDA
    graph writes where its capture wrote (:meth:`through_fixed_buffer`).
    """

    def __init__(self, rows: int, columns: frozenset[int]) -> None:
        self.rows = rows
        self.columns = columns
        self.buffer: torch.Tensor | None = None
        self.fixed: torch.Tensor | None = None  # where captured logging steps write
        self._leaf_hooks: list[torch.utils.hooks.RemovableHandle] = []

    def start(self, device: torch.device) -> torch.Tensor:
        """A zeroed buffer for a new logging step, on ``device``; returned and installed."""
        self.clear_leaf_hooks()
        self.buffer = torch.zeros(self.rows, len(STATS), dtype=torch.float64, device=device)
        return self.buffer

    @contextlib.contextmanager
    def through_fixed_buffer(self) -> Iterator[None]:
        """While the step runs, its probes write into :attr:`fixed`, one buffer kept for every
        logging step of this graph (zeroed first), at the address a CUDA graph capture
        records; the step's own buffer (:meth:`start`) gets a copy once the step has run.
        Both are device ops: no host synchronization."""
        step_buffer = self.buffer
        if step_buffer is None:
            raise RuntimeError("through_fixed_buffer: start() the logging step first")
        fixed = self.fixed
        if fixed is None or fixed.device != step_buffer.device or fixed.shape != step_buffer.shape:
            fixed = self.fixed = torch.zeros_like(step_buffer)
        else:
            fixed.zero_()
        self.buffer = fixed
        try:
            yield
        finally:
            self.buffer = step_buffer
        step_buffer.copy_(fixed)

    def clear_leaf_hooks(self) -> None:
        """Remove the hooks left on leaf tensors whose backward never ran (an eval call)."""
        for handle in self._leaf_hooks:
            handle.remove()
        self._leaf_hooks.clear()


def measure(
    x: torch.Tensor,
    run_dtype: torch.dtype,
    scale: torch.Tensor | None = None,
    columns: frozenset[int] | None = None,
) -> torch.Tensor:
    """One row of :data:`STATS` for ``x`` (float64, on ``x``'s device; see the module)."""
    x = x.detach()
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    magnitude = x.to(wide).abs()
    scaled = magnitude if scale is None else magnitude * scale.detach().to(wide)
    wanted = set(range(len(STATS))) if columns is None else columns
    values: list[torch.Tensor | float] = [0.0] * len(STATS)
    finite = torch.isfinite(magnitude)
    if _COLUMN["amax"] in wanted and x.numel():
        values[_COLUMN["amax"]] = torch.where(finite, magnitude, 0).amax()
    if _COLUMN["zeros"] in wanted:
        values[_COLUMN["zeros"]] = (magnitude == 0).sum()
    if _COLUMN["nonfinite"] in wanted:
        values[_COLUMN["nonfinite"]] = (~finite).sum()
    nonzero = magnitude > 0
    if _COLUMN["underflow"] in wanted:
        values[_COLUMN["underflow"]] = (nonzero & (scaled < _normal_threshold(run_dtype))).sum()
    for fmt, dtype in WHATIF_FORMATS.items():
        under, over = _COLUMN[f"{fmt}_underflow"], _COLUMN[f"{fmt}_overflow"]
        if under in wanted:
            values[under] = (nonzero & (scaled <= _zero_threshold(dtype))).sum()
        if over in wanted:
            values[over] = (finite & (scaled > torch.finfo(dtype).max)).sum()
    values[_COLUMN["numel"]] = float(x.numel())
    # numbers become tensors by a fill on the device, not a host-to-device copy (which waits
    # for the host and which a CUDA graph capture refuses)
    return torch.stack([_on_device(v, x.device) for v in values])


def _on_device(value: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(torch.float64)
    return torch.full((), value, dtype=torch.float64, device=device)


def _accumulate(buffer: torch.Tensor, row: int, values: torch.Tensor) -> None:
    target = buffer[row]
    torch.maximum(target[:1], values[:1], out=target[:1])
    target[1:] += values[1:]


@functools.cache
def _format_limits() -> tuple[list[float], list[float]]:
    """Per :data:`WHATIF_FORMATS`: what rounds to zero, and the largest finite value."""
    formats = WHATIF_FORMATS.values()
    return [_zero_threshold(f) for f in formats], [torch.finfo(f).max for f in formats]


def _kernel_applies(x: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Whether the one-pass CPU kernel measures ``x`` (built on first use; see
    :mod:`amp_graph.ops.cpu_extension`). A per-row fp8 scale goes to torch ops."""
    if x.device.type != "cpu" or (scale is not None and scale.numel() != 1):
        return False
    if x.dtype not in _KERNEL_DTYPES or is_dtensor(x):
        return False
    return cpu_extension.load_cpu_extension()


_KERNEL_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16, *WHATIF_FORMATS.values()}
)


def accumulate(
    buffer: torch.Tensor,
    row: int,
    x: torch.Tensor,
    run_dtype: torch.dtype,
    scale: torch.Tensor | None = None,
    columns: frozenset[int] | None = None,
) -> None:
    """Add ``x``'s statistics (:func:`measure`) into row ``row`` of ``buffer``: on the CPU in
    one pass of the C++ kernel, elsewhere (or where it is not built) with torch ops."""
    x = x.detach()
    if _kernel_applies(x, scale):
        zero_at, max_of = _format_limits()
        torch.ops.amp_graph_cpu.tensor_stats_(
            x, buffer[row], scale, _normal_threshold(run_dtype), zero_at, max_of
        )
        return
    _accumulate(buffer, row, measure(x, run_dtype, scale, columns))


def _in_backward() -> bool:
    # a checkpointed region runs its forward again inside backward: count it once
    return torch._C._current_graph_task_id() != -1


def record_stats(
    x: torch.Tensor,
    sink: StatsSink,
    row: int,
    run_dtype: torch.dtype,
    scale: torch.Tensor | None = None,
) -> None:
    """Add ``x``'s statistics into row ``row`` of ``sink``'s buffer (nothing without one)."""
    buffer = sink.buffer
    if buffer is None or _in_backward():
        return
    with torch.no_grad():
        accumulate(buffer, row, x, run_dtype, scale, sink.columns)


def record_grad_stats(x: torch.Tensor, sink: StatsSink, row: int) -> None:
    """Add the statistics of the gradient backward computes for ``x`` into row ``row`` of
    ``sink``'s buffer (as the forward made it: the step's buffer), in the gradient's dtype.
    Nothing where ``x`` needs no gradient or no buffer is installed."""
    buffer = sink.buffer
    if buffer is None or not x.requires_grad or _in_backward():
        return
    leaf = x.grad_fn is None
    handle = x.register_hook(_grad_hook(buffer, row, sink.columns, once=leaf))
    if leaf:  # a leaf keeps its hooks across backwards: the next start() removes this one
        sink._leaf_hooks.append(handle)


def _grad_hook(
    buffer: torch.Tensor, row: int, columns: frozenset[int], *, once: bool
) -> Callable[[torch.Tensor], None]:
    fired = False

    def hook(grad: torch.Tensor) -> None:
        nonlocal fired
        if once and fired:
            return
        fired = True
        with torch.no_grad():
            accumulate(buffer, row, grad, grad.dtype, None, columns)

    return hook
