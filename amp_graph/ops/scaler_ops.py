"""The ``amp_graph`` custom ops behind the gradient scaler.

Four ops, each one node in FX / ``torch.compile`` graphs (fake implementations included):

==============================================  ===================================================
op                                              effect
==============================================  ===================================================
``non_finite_check_and_unscale_(grads,          ``found_inf = 1`` if any grad element is inf/nan;
found_inf, inv_scale)``                         every grad ``*= inv_scale`` (fp32 math, rounded
                                                back), like torch's
                                                ``_amp_foreach_non_finite_check_and_unscale_``
``non_finite_check_(grads, found_inf)``         the check only: reads the grads, never writes them
``non_finite_check_unscale_and_norm_(grads,     the unscale, returning the float32 sum of squares
found_inf, inv_scale) -> Tensor``               of the unscaled grads (for ``clip_grad_norm_``)
``update_scale_(scale, trackers, found_inf,     growth / backoff / hysteresis / clamps of the loss
growth_factor, backoff_factor, growth_interval, scale and its int64 ``trackers``
hysteresis, min_scale, max_scale)``             ``[growth, hysteresis, skipped, consecutive]``
==============================================  ===================================================

``found_inf`` and ``inv_scale`` are one-element float32 tensors on the grads' device; ``found_inf``
is only ever set to 1.0, never cleared. Grads may be float32, float16 or bfloat16 (other floating
dtypes take torch's native path), any layout, mixed dtypes in one call; all on one device.

One semantics on every path (``tests/test_kernel_ops.py`` runs the same cases on CPU and CUDA):

* grads that are not floating point (integer, bool, complex) raise ``ValueError``, as do
  ``found_inf``/``inv_scale`` of the wrong dtype, size or device;
* the unscale rounds like torch's op (float32 multiply, rounded back to the grad's dtype);
* the sum of squares is a float32 sum of the squares of the *stored* (unscaled, rounded) values
  converted to float32, summed per dtype group in the order float32, float16, bfloat16, other
  dtypes; within a group the summation order is the implementation's (per tensor on CPU, per
  block on CUDA), fixed for given shapes, so results agree to float32 rounding and repeat
  exactly. Non-finite grads give a non-finite sum.

Implementations:

* ``CompositeExplicitAutograd`` (CPU, and CUDA while the extension is not loaded): torch ops, no
  host synchronization;
* ``CUDA``: registered in C++ by the extension (``csrc/binding.cpp``) when it loads, the first
  time a CUDA tensor reaches an op. One launch per dtype for all grads; no Python in the path.
  The launch plan (tiles, device table) is built once per gradient list and found again by a
  fingerprint of the list (each tensor's address, size and dtype); the typed entry points below
  pass the list to the dispatcher unboxed (``csrc/python_entry.cpp``).

The ops are defined with :class:`torch.library.Library` rather than ``torch.library.custom_op``:
custom_op's Python-level dispatch and version-counter bumps cost about 5 us per tensor, which
would dominate a call over 10,000 small gradients.

Example::

    >>> import torch
    >>> from amp_graph.ops import scaler_ops as ops
    >>> grads = [torch.tensor([2.0, 4.0]), torch.tensor([float("inf")], dtype=torch.float16)]
    >>> found_inf = torch.zeros(())
    >>> ops.non_finite_check_and_unscale_(grads, found_inf, torch.tensor(0.5))
    >>> found_inf, grads[0]
    (tensor(1.), tensor([1., 2.]))
"""

from __future__ import annotations

import torch

from amp_graph.ops.cuda_extension import load_extension, python_entry

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Slots of the trackers tensor (amp_graph::Tracker in csrc/tiling.h).
GROWTH_TRACKER, HYSTERESIS_TRACKER, SKIPPED_STEPS, CONSECUTIVE_SKIPS = range(4)
NUM_TRACKERS = 4

SCHEMAS = {
    "non_finite_check_and_unscale_": (
        "(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale) -> ()"
    ),
    "non_finite_check_": "(Tensor[] grads, Tensor(a!) found_inf) -> ()",
    "non_finite_check_unscale_and_norm_": (
        "(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale) -> Tensor"
    ),
    "update_scale_": (
        "(Tensor(a!) scale, Tensor(b!) trackers, Tensor found_inf, float growth_factor, "
        "float backoff_factor, int growth_interval, int hysteresis, float min_scale, "
        "float max_scale) -> ()"
    ),
}

# FRAGMENT: other parts of amp_graph may define ops in the same namespace.
_lib = torch.library.Library("amp_graph", "FRAGMENT")
for _name, _schema in SCHEMAS.items():
    _lib.define(_name + _schema)


def _op(name: str) -> torch._ops.OpOverload:
    return getattr(torch.ops.amp_graph, name).default


def _check_flag(t: torch.Tensor, name: str, device: torch.device | None = None) -> None:
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if t.dtype != torch.float32 or t.numel() != 1:
        raise ValueError(
            f"{name} must be a one-element float32 tensor, got {t.dtype} {tuple(t.shape)}"
        )


def _check_update_args(scale: torch.Tensor, trackers: torch.Tensor, found: torch.Tensor) -> None:
    _check_flag(scale, "scale")
    _check_flag(found, "found_inf")
    if trackers.dtype != torch.int64 or tuple(trackers.shape) != (NUM_TRACKERS,):
        raise ValueError(
            f"trackers must be int64 of shape ({NUM_TRACKERS},), "
            f"got {trackers.dtype} {tuple(trackers.shape)}"
        )
    if trackers.device != scale.device or found.device != scale.device:
        raise ValueError("scale, trackers and found_inf must be on one device")


def _check_grads(grads: list[torch.Tensor], device: torch.device) -> None:
    """The binding's checks (csrc/binding.cpp), with the same errors."""
    dtypes = {g.dtype for g in grads}
    devices = {g.device for g in grads}
    if all(dtype.is_floating_point for dtype in dtypes) and devices <= {device}:
        return  # the common case, checked per set rather than per tensor
    for i, g in enumerate(grads):
        if not g.is_floating_point():
            raise ValueError(
                f"amp_graph gradient ops take floating-point tensors; grads[{i}] is {g.dtype}"
            )
        if g.device != device:
            raise ValueError(
                f"amp_graph gradient ops take tensors on one device; grads[{i}] is on "
                f"{g.device}, found_inf on {device}"
            )


def _bump_versions(tensors: list[torch.Tensor]) -> None:
    """Mark in-place writes for autograd (the dispatcher does not, for Python kernels)."""
    try:
        torch._C._increment_version(tensors)
    except TypeError:  # torch versions whose binding takes one tensor
        for t in tensors:
            torch._C._increment_version(t)


def _extension_ready(t: torch.Tensor) -> bool:
    """True when ``t`` is on CUDA and the extension (with its CUDA kernels) is loaded."""
    return t.device.type == "cuda" and load_extension()


# ---- torch-native implementations: CPU, and CUDA without the extension -----------------------


def _native_check(grads: list[torch.Tensor], found_inf: torch.Tensor) -> None:
    # aminmax: one read-only pass per tensor, no temporary, and it propagates nan.
    extremes: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        if g.numel() > 0:
            extremes.setdefault(g.dtype, []).extend(torch.aminmax(g))
    if extremes:
        finite = torch.stack([torch.isfinite(torch.stack(e)).all() for e in extremes.values()])
        found_inf.masked_fill_(finite.all().logical_not(), 1.0)


def _native_unscale(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    if grads:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    _bump_versions([*grads, found_inf])


def _native_sum_of_squares(grads: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    # The rule of the module docstring: float32 squares, per dtype group in a fixed order.
    total = torch.zeros((), dtype=torch.float32, device=like.device)
    others = [g for g in grads if g.dtype not in KERNEL_DTYPES]
    for group in [[g for g in grads if g.dtype == dtype] for dtype in KERNEL_DTYPES] + [others]:
        if group:
            total.add_(torch.stack([g.float().square().sum() for g in group]).sum())
    return total


def _impl_check_and_unscale(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    _check_flag(found_inf, "found_inf")
    _check_flag(inv_scale, "inv_scale", found_inf.device)
    if _extension_ready(found_inf):
        return _op("non_finite_check_and_unscale_")(grads, found_inf, inv_scale)
    _check_grads(grads, found_inf.device)
    _native_unscale(grads, found_inf, inv_scale)
    return None


def _impl_check(grads: list[torch.Tensor], found_inf: torch.Tensor) -> None:
    _check_flag(found_inf, "found_inf")
    if _extension_ready(found_inf):
        return _op("non_finite_check_")(grads, found_inf)
    _check_grads(grads, found_inf.device)
    _native_check(grads, found_inf)
    _bump_versions([found_inf])
    return None


def _impl_check_unscale_and_norm(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> torch.Tensor:
    _check_flag(found_inf, "found_inf")
    _check_flag(inv_scale, "inv_scale", found_inf.device)
    if _extension_ready(found_inf):
        return _op("non_finite_check_unscale_and_norm_")(grads, found_inf, inv_scale)
    _check_grads(grads, found_inf.device)
    _native_unscale(grads, found_inf, inv_scale)
    return _native_sum_of_squares(grads, found_inf)


def _impl_update_scale(
    scale: torch.Tensor,
    trackers: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float,
) -> None:
    _check_update_args(scale, trackers, found_inf)
    args = (growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale)
    if _extension_ready(scale):
        return _op("update_scale_")(scale, trackers, found_inf, *args)
    # Branch-free transcription of amp_graph::update_scale (csrc/tiling.h); float64 like the C++.
    found = found_inf.reshape(()) > 0
    growth, hyst, skipped, consecutive = trackers.unbind()
    s = scale.reshape(()).double()
    hyst_next = torch.where(found, (hyst - 1).clamp(min=0), hysteresis)
    back_off = found & (hyst_next <= 0)
    growth_next = torch.where(found, 0, growth + 1)
    grow = found.logical_not() & (growth_next >= growth_interval)
    growth_next = torch.where(grow, 0, growth_next)
    grown = torch.maximum((s * growth_factor).clamp(max=max_scale), s).float()
    backed = torch.minimum((s * backoff_factor).clamp(min=min_scale), s).float()
    kept = torch.where(grow & torch.isfinite(grown), grown, scale.reshape(()))
    scale.copy_(torch.where(back_off, backed, kept).reshape(scale.shape))
    consecutive_next = torch.where(found, consecutive + 1, 0)
    trackers.copy_(torch.stack([growth_next, hyst_next, skipped + found, consecutive_next]))
    _bump_versions([scale, trackers])
    return None


_lib.impl("non_finite_check_and_unscale_", _impl_check_and_unscale, "CompositeExplicitAutograd")
_lib.impl("non_finite_check_", _impl_check, "CompositeExplicitAutograd")
_lib.impl(
    "non_finite_check_unscale_and_norm_", _impl_check_unscale_and_norm, "CompositeExplicitAutograd"
)
_lib.impl("update_scale_", _impl_update_scale, "CompositeExplicitAutograd")


# ---- fake (meta) implementations: shapes only, for FX / torch.compile ------------------------


@torch.library.register_fake("amp_graph::non_finite_check_and_unscale_", lib=_lib)
def _fake_check_and_unscale(grads, found_inf, inv_scale):  # type: ignore[no-untyped-def]
    _check_flag(found_inf, "found_inf")
    _check_flag(inv_scale, "inv_scale")


@torch.library.register_fake("amp_graph::non_finite_check_", lib=_lib)
def _fake_check(grads, found_inf):  # type: ignore[no-untyped-def]
    _check_flag(found_inf, "found_inf")


@torch.library.register_fake("amp_graph::non_finite_check_unscale_and_norm_", lib=_lib)
def _fake_check_unscale_and_norm(grads, found_inf, inv_scale):  # type: ignore[no-untyped-def]
    _check_flag(found_inf, "found_inf")
    _check_flag(inv_scale, "inv_scale")
    return found_inf.new_empty(())


@torch.library.register_fake("amp_graph::update_scale_", lib=_lib)
def _fake_update_scale(  # type: ignore[no-untyped-def]
    scale, trackers, found_inf, growth_factor, backoff_factor, growth_interval, hysteresis,
    min_scale, max_scale,
):  # fmt: skip
    _check_update_args(scale, trackers, found_inf)


# ---- typed Python entry points -----------------------------------------------------------
#
# Each calls the op through the extension's unboxed entry (csrc/python_entry.cpp) when it is
# loaded and found_inf is on CUDA: the same dispatcher call without boxing every tensor of the
# list, which costs more than the kernel with thousands of small gradients. The entry declines
# (tensor subclasses, torch function modes) and torch.compile traces go through torch.ops.


def _unboxed_entry(found_inf: torch.Tensor) -> object | None:
    entry = python_entry()
    if entry is None or found_inf.device.type != "cuda" or torch.compiler.is_compiling():
        return None
    return entry


def non_finite_check_and_unscale_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """Set ``found_inf`` to 1 if any grad holds inf/nan; multiply every grad by ``inv_scale``."""
    entry = _unboxed_entry(found_inf)
    if entry is None or not entry.check_and_unscale(grads, found_inf, inv_scale):
        torch.ops.amp_graph.non_finite_check_and_unscale_.default(grads, found_inf, inv_scale)


def non_finite_check_(grads: list[torch.Tensor], found_inf: torch.Tensor) -> None:
    """Set ``found_inf`` to 1 if any grad holds inf/nan; the grads are only read."""
    entry = _unboxed_entry(found_inf)
    if entry is None or not entry.check(grads, found_inf):
        torch.ops.amp_graph.non_finite_check_.default(grads, found_inf)


def non_finite_check_unscale_and_norm_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> torch.Tensor:
    """:func:`non_finite_check_and_unscale_`, returning the float32 sum of squares of the
    unscaled grads: the squared 2-norm ``clip_grad_norm_`` needs, without another pass."""
    entry = _unboxed_entry(found_inf)
    if entry is not None:
        sum_of_squares = entry.check_unscale_and_norm(grads, found_inf, inv_scale)
        if sum_of_squares is not None:
            return sum_of_squares
    return torch.ops.amp_graph.non_finite_check_unscale_and_norm_.default(
        grads, found_inf, inv_scale
    )


def update_scale_(
    scale: torch.Tensor,
    trackers: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float,
) -> None:
    """One update of the loss ``scale`` and its ``trackers`` from ``found_inf`` (> 0: overflow).

    With ``hysteresis=1``, ``min_scale=0`` and ``max_scale=inf`` this is
    ``torch._amp_update_scale_``; the rule is ``amp_graph::update_scale`` in ``csrc/tiling.h``.
    """
    torch.ops.amp_graph.update_scale_.default(
        scale,
        trackers,
        found_inf,
        growth_factor,
        backoff_factor,
        growth_interval,
        hysteresis,
        min_scale,
        max_scale,
    )
