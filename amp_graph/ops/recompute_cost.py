"""What recomputing a cast in backward costs on a device, measured once per device.

A recomputed cast (:mod:`amp_graph.ops.recompute_ops`) frees its copy's bytes from the
forward to the backward, and costs two kinds of time:

* **host time that does not grow with the copy**: recording the copy, the saved-tensor
  hooks' pack and unpack, the recast's dispatch (and, on a GPU, its launch);
* **device time that does**: the recast reads the source and writes the copy again.

Where the fixed part is larger than the bytes' part, the copy is too small for what it
frees to be worth the Python: a GPT of width 128 pays 5-10% of its step on a CPU for 1.7
MiB. :class:`RecomputeCost` holds the three figures the decision
(:func:`amp_graph.passes.recompute_casts.recompute_casts`, ``Policy(recompute_casts="auto")``)
weighs, and :func:`measured_cost` measures them once per device with the real hooks, on a
small autograd program, outside any mode the caller has on.

Once one cast of a graph is recomputed, the hooks also pack and unpack every other tensor
that forward saves (2-5 us each on a CPU): a graph keeps every copy where that would cost
more than all its recasts' bytes take (:meth:`RecomputeCost.hooks_pay`), as GPT of width
128 would for the one float32 copy of its logits above the threshold.

And a recompute is never free: the recast moves the bytes the first cast moved. Where the
step's GEMMs are short (few tokens against many weights: an HF Llama of width 512 at 4x128
tokens spent 3-4% of a CPU step recasting its weights), that time shows, so the recomputes
of a graph may take at most :data:`STEP_SHARE` of its step, estimated from its matmul FLOPs
at the device's measured matmul rate (:meth:`RecomputeCost.within_step_share`): the default
path is not slower than torch.autocast's, which keeps every copy.

The same measurement times one more choice of the kind, for
``Policy.cast_gradients_per_consumer``: a consumer of a shared cast reads the shared copy
through a Python ``autograd.Function`` or casts its own, natively, as torch.autocast does
(:attr:`RecomputeCost.max_own_cast_bytes`).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from amp_graph.ops import recompute_ops
from amp_graph.ops.cast_reads import cast_read

__all__ = [
    "IN_BACKWARD_SLOWDOWN",
    "STEP_SHARE",
    "RecomputeCost",
    "best_ns",
    "measured_cost",
    "size_text",
    "synchronizer",
]

log = logging.getLogger(__name__)

STEP_SHARE = 0.01
"""The share of a step's estimated time that ``"auto"``'s recomputes may take: within the
noise of two runs of one step (0.5-1% on the CPUs measured, BENCHMARKS.md)."""

IN_BACKWARD_SLOWDOWN = 2.0
"""How much slower a recast runs inside backward than the cold cast measured alone: on a
2-vCPU EPYC an HF Llama's 29 recasts (24 MiB) took 7.4 ms a step (3.4 GB/s, profiled) where
the cold cast measured 5-10 GB/s (backward's own allocations and cache misses around it;
BENCHMARKS.md, "The recomputes' share of the step"). The step share counts the bytes at
half the measured rate, so that an underestimate does not make the default path slower."""


@dataclass(frozen=True)
class RecomputeCost:
    """The figures the recompute decision weighs, for one device.

    Attributes:
        per_cast_ns: host time one recomputed cast adds to a forward + backward, beyond
            keeping its copy: recording it, the hooks on the copy, the recast's dispatch;
            never less than one cast's dispatch, measured on its own (the difference of two
            timings can come out at or below zero on a busy machine, which would make every
            recompute look free).
        per_saved_ns: host time the saved-tensor hooks add per tensor autograd saves, paid
            by every saved tensor of a forward in which any cast is recomputed.
        copy_bytes_per_ns: bytes of float32-to-bfloat16 copy the device writes per
            nanosecond, the source out of the caches (the recast's own speed).
        device: where it was measured (``"cpu"``, ``"cuda:0"``), for the report.
        flops_per_ns: the device's bf16 matmul rate, to estimate a step's time from its
            FLOPs; None (a cost made by hand) applies no step share.
        per_read_ns: host time one consumer's :func:`~amp_graph.ops.cast_reads.cast_read`
            of a shared cast adds to a forward + backward, beyond a cast of its own (a
            Python ``autograd.Function``, forward and backward, against a native cast);
            None (a cost made by hand): every consumer reads (:attr:`max_own_cast_bytes`).
        fresh_copy_bytes_per_ns: bytes of copy the device writes per ns where the source
            is still in the caches, as an activation just computed is when a consumer casts
            its own in forward (2-4x the cold rate on a CPU); None: the cold rate.
    """

    per_cast_ns: float
    per_saved_ns: float
    copy_bytes_per_ns: float
    device: str = ""
    flops_per_ns: float | None = None
    per_read_ns: float | None = None
    fresh_copy_bytes_per_ns: float | None = None

    @property
    def min_copy_bytes(self) -> int:
        """The smallest copy whose recast takes at least its fixed host time: below it the
        Python costs more than the bytes."""
        return math.ceil(self.per_cast_ns * self.copy_bytes_per_ns)

    @property
    def max_own_cast_bytes(self) -> int:
        """The largest copy a consumer of a shared cast gets a cast of its own for (as
        torch.autocast gives it) instead of a read of the shared one: the copy's bytes take
        no longer to write, from a source in the caches, than a read's host time
        (``passes.shared_cast_gradients``). A read measured alone is a lower bound (in a
        model's step it took 2-3x as long on a CPU), so the edge leans to reads, which hold
        less."""
        if not self.per_read_ns:
            return 0
        rate = self.fresh_copy_bytes_per_ns or self.copy_bytes_per_ns
        return math.floor(self.per_read_ns * rate)

    def hooks_pay(self, saved_tensors: int, casts: int, copy_bytes: int) -> bool:
        """Whether a forward that saves ``saved_tensors`` tensors, recomputing ``casts``
        casts of ``copy_bytes`` in all, spends no more host time on them than its recasts
        spend on their bytes: :attr:`min_copy_bytes`'s rule for the whole graph, whose
        every saved tensor goes through the hooks once one cast is recomputed."""
        return copy_bytes >= self._fixed_ns(saved_tensors, casts) * self.copy_bytes_per_ns

    def _fixed_ns(self, saved_tensors: int, casts: int) -> float:
        """The host time that does not grow with the bytes: the hooks on every saved
        tensor, and each recast's recording and dispatch."""
        return saved_tensors * self.per_saved_ns + casts * self.per_cast_ns

    def recompute_ns(self, saved_tensors: int, casts: int, copy_bytes: int) -> float:
        """Host and device time that recomputing ``casts`` casts of ``copy_bytes`` in all
        adds to a step whose forward saves ``saved_tensors`` tensors: the hooks on every
        saved tensor, each recast's fixed time, and the recasts' bytes (at the rate they
        run in backward: :data:`IN_BACKWARD_SLOWDOWN`)."""
        bytes_ns = copy_bytes * IN_BACKWARD_SLOWDOWN / self.copy_bytes_per_ns
        return self._fixed_ns(saved_tensors, casts) + bytes_ns

    def step_ns(self, step_flops: float) -> float | None:
        """A step's time at the measured matmul rate: its GEMMs' at least (None: no rate)."""
        return None if not self.flops_per_ns else step_flops / self.flops_per_ns

    def within_step_share(
        self, saved_tensors: int, casts: int, copy_bytes: int, step_ns: float
    ) -> bool:
        """Whether those recomputes take at most :data:`STEP_SHARE` of a step of
        ``step_ns`` (:meth:`step_ns`)."""
        return self.recompute_ns(saved_tensors, casts, copy_bytes) <= STEP_SHARE * step_ns

    def describe(self) -> str:
        """One line: the figures and the threshold they make."""
        return (
            f"on {self.device or 'this device'} a recomputed cast costs "
            f"{self.per_cast_ns / 1e3:.1f} us of host time and every saved tensor "
            f"{self.per_saved_ns / 1e3:.1f} us under the hooks, and a cast writes "
            f"{self.copy_bytes_per_ns:.1f} GB/s{self._rate_text()}: copies below "
            f"{size_text(self.min_copy_bytes)} are kept"
        )

    def _rate_text(self) -> str:
        if not self.flops_per_ns:
            return ""
        return f", and a bf16 matmul runs at {self.flops_per_ns / 1e3:.2f} TFLOP/s"


def size_text(nbytes: int) -> str:
    """A copy's size as the decision's messages give it: KiB below a MiB, else MiB."""
    return f"{nbytes / 1024:.0f} KiB" if nbytes < 2**20 else f"{nbytes / 2**20:.1f} MiB"


def best_ns(
    run: Callable[[], object],
    sync: Callable[[], None],
    calls: int,
    rounds: int,
    before: Callable[[], object] | None = None,
) -> float:
    """The fastest round's time per call: the least disturbed by the rest of the machine.
    ``before`` runs untimed ahead of each round (a cache flush)."""
    best = math.inf
    for _ in range(rounds):
        if before is not None:
            before()
        sync()
        start = time.perf_counter_ns()
        for _ in range(calls):
            run()
        sync()
        best = min(best, (time.perf_counter_ns() - start) / calls)
    return best


# The measuring program: LAYERS linears, each reading a cast of its own small weight (as a
# model reads its weights: linear saves a view of the copy), forward and backward.
_LAYERS = 32
_WIDTH = 8


def _program(weights: list[torch.Tensor], x: torch.Tensor, recompute: bool, hooks: bool) -> None:
    call = recompute_ops.recording_call() if hooks else None
    try:
        y = x
        for weight in weights:
            if recompute:
                copy = recompute_ops.recomputed_cast(weight, torch.bfloat16, "module")
            else:
                copy = weight.to(torch.bfloat16)
            y = F.linear(y, copy)
    finally:
        if call is not None:
            call.__exit__(None, None, None)
    y.float().sum().backward()


def _consumers_program(source: torch.Tensor, weights: list[torch.Tensor], reads: bool) -> None:
    """One activation read by ``len(weights)`` linears, each through a ``cast_read`` of one
    shared cast, or each through a cast of its own (torch.autocast's way), forward and
    backward."""
    activation = source * 1.0  # not a leaf: a leaf's shared cast is read as is
    shared = activation.to(torch.bfloat16) if reads else None
    total = None
    for weight in weights:
        copy = cast_read(activation, shared) if reads else activation.to(torch.bfloat16)
        out = F.linear(copy, weight)
        total = out if total is None else total + out
    assert total is not None
    total.float().sum().backward()


def _per_read_ns(where: torch.device, sync: Callable[[], None]) -> float:
    """What a read costs beyond a cast of its own, per consumer, on copies too small for
    their bytes to count: the median of five interleaved estimates, at least zero."""
    source = torch.ones(4, _WIDTH, device=where, requires_grad=True)
    weights = [torch.ones(_WIDTH, _WIDTH, device=where, dtype=torch.bfloat16)] * _LAYERS
    estimates = []
    for _ in range(5):
        ns = {
            reads: best_ns(
                lambda r=reads: _consumers_program(source, weights, r), sync, calls=4, rounds=2
            )
            for reads in (True, False)
        }
        estimates.append((ns[True] - ns[False]) / _LAYERS)
    return max(statistics.median(estimates), 0.0)


def synchronizer(device: torch.device) -> Callable[[], None]:
    """What waits for ``device``'s queued work, for the timings: nothing on the CPU,
    ``torch.<type>.synchronize`` on an accelerator (CUDA, XPU, MPS: their kernels run
    asynchronously, and timing only their launches would make every recompute look free)."""
    if device.type == "cpu":
        return lambda: None
    module = getattr(torch, device.type, None)
    synchronize = getattr(module, "synchronize", None)
    if synchronize is None:
        raise RuntimeError(
            f"amp_graph recompute_casts='auto' times the casts on {device}, and torch has no "
            f"torch.{device.type}.synchronize to wait for them; set Policy(recompute_casts=True "
            "or False) on this device"
        )
    if device.type == "cuda":
        return functools.partial(synchronize, device)
    return synchronize


def _cold_copy_bytes_per_ns(where: torch.device, sync: Callable[[], None]) -> float:
    """How fast the device casts a weight-sized float32 tensor (4 MB) to bf16, bytes of the
    copy written per ns, with the source out of the caches: backward recasts a weight long
    after the forward read it. (A copy timed in a loop, its source hot in the cache, ran
    3-4x faster on a 2-vCPU EPYC than one after the cache was flushed, and the recomputes
    cost that much more than such a rate said.)"""
    source = torch.ones(1 << 20, device=where)
    # 128 MiB read, not written (written, its dirty lines' write-back made the timing vary
    # 5x): past the last-level cache of a server CPU (32 MiB on this EPYC, 105 MiB on a
    # Sapphire Rapids Xeon) and a GPU's L2 (50-60 MiB on an H100 or H200)
    flush = torch.ones(1 << 25, device=where)
    copy_ns = best_ns(lambda: source.to(torch.bfloat16), sync, calls=1, rounds=7, before=flush.max)
    return source.numel() * 2 / copy_ns


def _fresh_copy_bytes_per_ns(where: torch.device, sync: Callable[[], None]) -> float:
    """How fast the device casts a float32 tensor of 4 MiB to bf16 with the source in the
    caches (the last level's, on a CPU), bytes of the copy written per ns."""
    source = torch.ones(1 << 20, device=where)
    copy_ns = best_ns(lambda: source.to(torch.bfloat16), sync, calls=16, rounds=3)
    return source.numel() * 2 / copy_ns


def _matmul_flops_per_ns(where: torch.device, sync: Callable[[], None]) -> float:
    """A square bf16 matmul's FLOP rate: one large enough to run near the device's rate (a
    model's GEMMs are rarely faster, so a step estimated with it is no longer than the real
    one) and quick to time (about 10 ms on a 2-vCPU CPU, under 1 ms on a GPU)."""
    n = 512 if where.type == "cpu" else 4096
    a = torch.ones(n, n, device=where, dtype=torch.bfloat16)
    b = torch.ones(n, n, device=where, dtype=torch.bfloat16)
    torch.mm(a, b)  # first call: the kernel's own setup
    return 2 * n**3 / best_ns(lambda: torch.mm(a, b), sync, calls=2, rounds=3)


@functools.cache
def _measure(device: str) -> RecomputeCost:
    where = torch.device(device)
    sync = synchronizer(where)

    weights = [torch.ones(_WIDTH, _WIDTH, device=where).requires_grad_() for _ in range(_LAYERS)]
    x = torch.ones(4, _WIDTH, device=where, dtype=torch.bfloat16)
    variants = {
        "kept": lambda: _program(weights, x, recompute=False, hooks=False),
        "hooks": lambda: _program(weights, x, recompute=False, hooks=True),
        "recomputed": lambda: _program(weights, x, recompute=True, hooks=True),
    }
    saved, casts = [], []
    for _ in range(5):  # interleaved; the median of five estimates, each from the fastest
        ns = {name: best_ns(run, sync, calls=3, rounds=2) for name, run in variants.items()}
        # each linear saves its input and its weight's copy (as a view): two saved tensors
        saved.append((ns["hooks"] - ns["kept"]) / (2 * _LAYERS))
        casts.append((ns["recomputed"] - ns["hooks"]) / _LAYERS)
    # the recast runs one cast at least: its dispatch, timed directly, bounds the estimate
    one_cast_ns = best_ns(lambda: weights[0].to(torch.bfloat16), sync, calls=32, rounds=5)
    per_saved = max(statistics.median(saved), 0.0)
    per_cast = max(statistics.median(casts), one_cast_ns)
    cost = RecomputeCost(
        per_cast_ns=per_cast,
        per_saved_ns=per_saved,
        copy_bytes_per_ns=_cold_copy_bytes_per_ns(where, sync),
        device=str(where),
        flops_per_ns=_matmul_flops_per_ns(where, sync),
        per_read_ns=_per_read_ns(where, sync),
        fresh_copy_bytes_per_ns=_fresh_copy_bytes_per_ns(where, sync),
    )
    log.info("amp_graph recompute_casts='auto': %s", cost.describe())
    return cost


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No garbage collection pause inside a timed round (one would be charged to a variant)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def measured_cost(device: torch.device | str) -> RecomputeCost:
    """What recomputing a cast costs on ``device``, measured at the first call for it (about
    0.2 s on a CPU; on a GPU it synchronizes) and then remembered for the process. The
    measurement runs outside the caller's dispatch modes and fake mode, with grad on and
    autocast off, and leaves the random number generators as they were."""
    where = torch.device(device)
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", torch.cuda.current_device())
    with (
        _gc_paused(),
        _disable_current_modes(),
        torch.inference_mode(False),
        torch.enable_grad(),
        torch.autocast(where.type, enabled=False),
    ):
        return _measure(str(where))
