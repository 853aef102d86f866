"""Casts that backward makes again instead of keeping: the graph op and its runtime.

An op that reads a cast saves the cast for its backward (``linear`` keeps its bf16 weight
copy to compute the input's gradient), and torch.autocast holds every such copy from the
forward to the backward. Where the cast's source stays alive anyway (a parameter, or a
value backward keeps in any case, such as softmax's float32 output), keeping the copy is
pure cost: backward can cast the source again, bit for bit (a cast is deterministic).

:func:`recomputed_cast` is the graph op ``passes.recompute_casts`` puts where it decided
so. It casts, and records the copy while a graph runs with :func:`install` 's hooks; a
``torch.autograd.graph.saved_tensors_hooks`` pair then packs every saved tensor that is
such a copy, or a view of one, as ``(source, dtype, view geometry)`` and casts again when
backward unpacks it. Where nothing is recording (tracing for ``torch.compile`` or export,
a ``no_grad`` call, a run inside someone else's saved-tensor hooks: a checkpoint or
``save_on_cpu`` around the graph) it is a plain cast.

Where AOTAutograd compiles the graph instead, the same decision reaches its partitioner
through torch's activation-checkpointing keys: the pass tags the cast node
(``meta["recompute"]``, copied onto the nodes AOTAutograd traces from it), and under dynamo
(``Graph``'s ``enable_compile`` retraces the graph) :func:`recomputed_cast` is a
``torch.utils.checkpoint`` region of one cast.

Why saved-tensor hooks rather than selective checkpointing for the eager graph: the copy is
the only thing to recompute, and the hooks recompute exactly it, where backward needs it,
with no second forward; and under FSDP2 the source is the unit's unsharded parameter,
which FSDP frees after the unit's forward and all-gathers again before the unit's
backward, so the copy exists only while that unit's backward runs.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint

from amp_graph.ops.dtensors import is_dtensor

__all__ = [
    "KEPT_BY_AUTOGRAD",
    "KEPT_BY_MODULE",
    "KEPT_SMALLER",
    "ModifiedSourceError",
    "install",
    "recomputed_cast",
    "recomputed_quantize",
    "recording",
    "recording_call",
    "uninstall",
]


class ModifiedSourceError(RuntimeError):
    """A cast backward would make again reads a source written since the forward."""


class _Recording(threading.local):
    # id(copy) -> (weak reference to the copy, (source, make, args)), while a graph's
    # forward runs (ids, checked against the reference: cheaper than weak-keyed lookups,
    # which every saved tensor pays)
    copies: dict[int, tuple[weakref.ref, tuple]] | None = None


_recording = _Recording()


KEPT_BY_MODULE = "module"  # a parameter or buffer: the module keeps it
KEPT_BY_AUTOGRAD = "autograd"  # an op's result its own backward saves (softmax's output)
# an upcast's low-precision source, kept in the float32 copy's place: fewer bytes, and the
# copy is exact (float32 holds every bf16 and fp16 value), so backward loses nothing
KEPT_SMALLER = "smaller"


def recomputed_cast(source: torch.Tensor, dtype: torch.dtype, kept_by: str) -> torch.Tensor:
    """``source.to(dtype)``, which backward casts again from ``source`` instead of keeping
    (while a graph with :func:`install` 's hooks runs and records grad). ``kept_by`` says
    why the source outlives the forward: ``"module"`` (a parameter or buffer) or
    ``"autograd"`` (a result its op's backward saves, which holds only where autograd
    recorded that op: otherwise the copy is kept as usual) or ``"smaller"`` (an upcast's
    source, kept in the copy's place where its storage is the smaller: not a view into a
    larger tensor)."""
    if torch.compiler.is_dynamo_compiling():
        # dynamo retraces the graph (Graph's enable_compile): the cast as a region of torch's
        # activation checkpointing, which AOTAutograd's partitioner recomputes in backward
        return torch.utils.checkpoint.checkpoint(
            torch.Tensor.to, source, dtype, use_reentrant=False
        )
    copy = source.to(dtype)
    if kept_by == KEPT_SMALLER:
        if _recording.copies is not None and _smaller_storage(source, copy):
            _record(copy, source, torch.Tensor.to, (source, dtype))
    elif kept_by == KEPT_BY_MODULE or source.grad_fn is not None:
        _record(copy, source, torch.Tensor.to, (source, dtype))
    return copy


def _smaller_storage(source: torch.Tensor, copy: torch.Tensor) -> bool:
    """Keeping ``source`` alive costs less than keeping ``copy``: compared by storage, since a
    view keeps its whole base alive (a tensor subclass, whose storage may be elsewhere or
    none: never)."""
    if type(source) is not torch.Tensor or type(copy) is not torch.Tensor:
        return False
    return source.untyped_storage().nbytes() < copy.untyped_storage().nbytes()


def recomputed_quantize(
    source: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``amp_graph.fp8_quantize(source, scale, dtype)`` of a parameter (its float8 copy, which
    the fp8 linear saves for backward), quantized again in backward instead of kept."""
    quantize = torch.ops.amp_graph.fp8_quantize.default
    copy = quantize(source, scale, dtype)
    _record(copy, source, quantize, (source, scale, dtype))
    return copy


def _record(
    copy: torch.Tensor, source: torch.Tensor, make: Callable[..., torch.Tensor], args: tuple
) -> None:
    """While a graph's forward records: backward remakes ``copy`` as ``make(*args)``."""
    copies = _recording.copies
    if copies is not None and copy is not source:
        copies[id(copy)] = (weakref.ref(copy), (source, make, args))


class _Recast:
    """What autograd keeps for a saved copy: its source, and how to remake the copy."""

    __slots__ = ("args", "geometry", "make", "source", "version")

    def __init__(self, recipe: tuple, saved: torch.Tensor, base: torch.Tensor) -> None:
        self.source, self.make, self.args = recipe
        self.version = self.source._version
        # a view of the copy (linear saves weight.t()): its geometry on the copy's storage
        self.geometry = (
            None if saved is base else (saved.size(), saved.stride(), saved.storage_offset())
        )

    def remake(self) -> torch.Tensor:
        if self.source._version != self.version:
            raise ModifiedSourceError(
                "backward needs a cast that amp_graph recomputes from its source, but the "
                f"source (shape {tuple(self.source.shape)}, {self.source.dtype}) was written "
                "in place between the forward and the backward, so the cast would differ from "
                "the one the forward used. Do not modify parameters between forward and "
                "backward (step the optimizer after backward), or set "
                "Policy(recompute_casts=False)."
            )
        copy = self.make(*self.args)
        if self.geometry is not None:
            copy = copy.as_strided(*self.geometry)
        return copy


def _pack(saved: torch.Tensor) -> Any:
    """A recomputed copy (or a view of one) as its recipe; any other tensor as itself with
    its version: autograd checks no version of what saved-tensor hooks return, so
    :func:`_unpack` checks it, as autograd would have."""
    copies = _recording.copies
    base = saved if saved._base is None else saved._base
    entry = copies.get(id(base)) if copies is not None else None
    if entry is None or entry[0]() is not base or (saved is not base and is_dtensor(saved)):
        # a view of a DTensor copy cannot be remade from its geometry (DTensor has no
        # as_strided): kept, as torch.autocast keeps it
        return (saved, saved._version)
    return _Recast(entry[1], saved, base)


def _unpack(packed: Any) -> torch.Tensor:
    if type(packed) is not tuple:
        return packed.remake()
    tensor, version = packed
    if tensor._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{tensor.type()} {list(tensor.shape)}] is at version "
            f"{tensor._version}; expected version {version} instead (checked by amp_graph's "
            "saved-tensor hooks, in autograd's place)"
        )
    return tensor


def _outer_hooks_active() -> bool:
    """Someone's saved-tensor hooks (a checkpoint around the graph, ``save_on_cpu``) are
    on: they decide what is kept, and ours stay off."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


class _RecordingCall:
    """One graph call's recording: the hooks entered at the forward's start, left at its end."""

    def __init__(self) -> None:
        self.hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        self.previous = _recording.copies

    def __enter__(self) -> None:
        self.hooks.__enter__()
        _recording.copies = {}

    def __exit__(self, *exc: Any) -> None:
        _recording.copies = self.previous
        self.hooks.__exit__(*exc)


def _start_recording() -> _RecordingCall | None:
    """Record this forward's copies, unless grad is off (nothing is saved), a graph's
    forward already records (a graph called inside one), or outer hooks decide."""
    if not torch.is_grad_enabled() or _recording.copies is not None or _outer_hooks_active():
        return None
    call = _RecordingCall()
    call.__enter__()
    return call


def recording_call() -> _RecordingCall:
    """A recording entered unconditionally (leave it with ``__exit__(None, None, None)``):
    what :mod:`amp_graph.ops.recompute_cost` measures the hooks with."""
    call = _RecordingCall()
    call.__enter__()
    return call


def recording(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a graph's forward that is not called as a module: what dynamo's eager backend
    returns) run as :func:`install` 's hooks run a module."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        call = _start_recording()
        try:
            return fn(*args, **kwargs)
        finally:
            if call is not None:
                call.__exit__(None, None, None)

    return run


_CALLS = "_amp_graph_recompute_calls"


def _before_forward(module: nn.Module, args: Any) -> None:
    module.__dict__.setdefault(_CALLS, []).append(_start_recording())


def _after_forward(module: nn.Module, args: Any, output: Any) -> None:
    calls = module.__dict__.get(_CALLS)
    call = calls.pop() if calls else None
    if call is not None:
        call.__exit__(None, None, None)


_HANDLES = "_amp_graph_recompute_handles"


def install(module: nn.Module) -> None:
    """Record the copies :func:`recomputed_cast` makes in ``module`` 's forward, so that
    backward casts them again instead of keeping them. Idempotent."""
    if _HANDLES in module.__dict__:
        return
    module.__dict__[_HANDLES] = (
        module.register_forward_pre_hook(_before_forward),
        module.register_forward_hook(_after_forward, always_call=True),
    )


def uninstall(module: nn.Module) -> None:
    """Undo :func:`install` (a graph handed to ``torch.compile``, whose partitioner decides
    what backward keeps, must not run Python hooks around its forward)."""
    for handle in module.__dict__.pop(_HANDLES, ()):
        handle.remove()
