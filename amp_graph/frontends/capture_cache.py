"""Captured graphs by input signature: which graph serves a call, and when to capture again.

:class:`CaptureCache` serves :class:`~amp_graph.frontends.compiler.CompiledModule` and
:class:`amp_graph.Graph` alike: a new structure, dtype, device type, rank or memory layout
of the inputs, which of their dims have size 0 or 1, or a module's ``training`` flag, is a
new signature; new sizes within one get one more capture with symbolic sizes. A call whose
plain tensors have the last call's properties is answered without flattening its inputs
(the common step: the same batch shape every time).
"""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from amp_graph.capture import Captured, CaptureError
from amp_graph.passes.pipeline import PassError

log = logging.getLogger(__name__)

MAX_GRAPHS_PER_SIGNATURE = 8  # static captures of one input structure before warning


def _layout(tensor: torch.Tensor) -> Any:
    """A tensor's memory layout as a capture sees it: a graph traced on a contiguous tensor
    has no copy where the model calls ``.contiguous()`` (a no-op there), so its ``view``
    fails on a transposed input of the same shape; each layout gets its own graph."""
    if tensor.is_contiguous():
        return "contiguous"
    if tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    return tensor.stride()


def _unit_dims(tensor: torch.Tensor) -> tuple[int, ...]:
    """The dims of size 0 or 1: torch.export specializes them (a capture with symbolic sizes
    made at batch 2 refuses batch 1, and one made at batch 1 has no symbol for the batch),
    so a call with such a dim gets its own signature, and its own capture with symbolic
    sizes, rather than one static graph per size of the others."""
    return tuple(d for d, size in enumerate(tensor.shape) if size < 2)


def _describe(value: Any) -> Any:
    """What a capture is specialized on, for one input: a tensor's dtype, device, rank,
    layout and dims of size 0 or 1 (not its other sizes), a Python value itself; containers
    element by element."""
    if isinstance(value, torch.Tensor):
        return (
            "tensor",
            value.dtype,
            value.device.type,
            value.dim(),
            _layout(value),
            _unit_dims(value),
        )
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_describe(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _describe(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        return ("object", type(value).__name__, id(value))
    return ("value", type(value).__name__, value)


def _shapes(leaves: Sequence[Any]) -> tuple:
    return tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in leaves)


@dataclass
class _Signature:
    """The graphs captured for one input signature: one per static shape, or one dynamic."""

    static: dict[tuple, Captured] = field(default_factory=dict)
    dynamic: Captured | None = None
    tried_dynamic: bool = False


CaptureFn = Callable[[tuple, dict, bool], Captured]


def _tied(root: nn.Module) -> tuple[tuple[tuple[str, ...], ...], ...]:
    """The paths (``("lm_head", "weight")``) under which one tensor is several parameters or
    buffers of ``root`` (an embedding tied to the output layer, as GPT-2's): export reads
    such a tensor once, by one of its names, for all its uses."""
    names: dict[int, list[str]] = {}
    for name, tensor in itertools.chain(
        root.named_parameters(remove_duplicate=False), root.named_buffers(remove_duplicate=False)
    ):
        names.setdefault(id(tensor), []).append(name)
    return tuple(
        tuple(tuple(name.split(".")) for name in group)
        for group in names.values()
        if len(group) > 1
    )


def _state_tensor(root: nn.Module, path: tuple[str, ...]) -> torch.Tensor | None:
    """The parameter or buffer at ``path``, or None where there is none now (a module of the
    path replaced by one without it). Read from the modules' own dicts, not through
    ``nn.Module.__getattr__`` per name: this runs at every call of a model with ties."""
    module = root
    for name in path[:-1]:
        module = module._modules.get(name)
        if module is None:
            return None
    found = module._parameters.get(path[-1])
    return found if found is not None else module._buffers.get(path[-1])


def _still_tied(root: nn.Module, ties: tuple[tuple[tuple[str, ...], ...], ...]) -> bool:
    """Whether each group of paths still names one tensor (not after ``model.head.weight =
    nn.Parameter(...)`` or a new ``model.head``)."""
    for paths in ties:
        first = _state_tensor(root, paths[0])
        if first is None or any(_state_tensor(root, path) is not first for path in paths[1:]):
            return False
    return True


class CaptureCache:
    """Captured graphs by input signature: the structure of ``(args, kwargs)``, each
    tensor's dtype, device, rank and layout (contiguous or not), each Python value, and
    the ``training`` flag of every module. Within a signature, the first sizes get a
    static capture; other sizes get one capture with symbolic sizes, which then serves
    every size it accepts (a model that needs static sizes gets one graph per size).

    ``capture(args, kwargs, dynamic)`` makes a :class:`Captured`. ``symbolic_first``: the
    first capture of a signature tries symbolic sizes already (inputs whose sizes change at
    every call: a growing KV cache).
    """

    def __init__(
        self,
        capture: CaptureFn,
        modules: Sequence[nn.Module],
        what: str,
        *,
        symbolic_first: bool = False,
    ) -> None:
        self._capture_fn, self._modules, self._what = capture, modules, what
        self._symbolic_first = symbolic_first
        self._signatures: dict[tuple, _Signature] = {}
        self.captures: list[Captured] = []
        self._last: tuple[tuple, Captured] | None = None  # the last call of plain tensors
        self._ties = _tied(modules[0])  # modules[0]: the root, as nn.Module.modules() yields

    def _untied_since_capture(self) -> bool:
        """A tensor the graphs read once for several names is no longer one (a tied output
        layer untied for fine-tuning): each graph would read the old one for all its uses.
        Forgets every graph, so that the next call captures with the model as it is."""
        if not self._ties or _still_tied(self._modules[0], self._ties):
            return False
        log.info("amp_graph: tied parameters of %s were untied; capturing again", self._what)
        self._signatures.clear()
        self._last = None
        self._ties = _tied(self._modules[0])
        return True

    def get(self, args: tuple, kwargs: dict) -> tuple[Captured, list]:
        """The graph for these inputs (capturing it if needed) and the flat inputs."""
        # A step calls with the tensors of the last step, as a rule: this answers it without
        # flattening (the lookup below picks a graph by exactly these properties and sizes).
        if self._ties:
            self._untied_since_capture()
        training = tuple([m.training for m in self._modules])
        plain = not kwargs and all(type(a) is torch.Tensor for a in args)
        if plain:
            repeat = (tuple([(a.dtype, a.device, a.shape, a.stride()) for a in args]), training)
            if self._last is not None and self._last[0] == repeat:
                return self._last[1], list(args)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = (spec, tuple(_describe(v) for v in leaves), training)
        captured = self._lookup(key, leaves) or self._capture(key, args, kwargs, leaves)
        self._last = (repeat, captured) if plain else None
        return captured, leaves

    def _lookup(self, key: tuple, leaves: list) -> Captured | None:
        found = self._signatures.get(key)
        if found is None:
            return None
        # sizes captured statically keep their graph: a replayed CUDA graph of it stays valid
        static = found.static.get(_shapes(leaves))
        if static is None and found.dynamic is not None and found.dynamic.accepts(leaves):
            return found.dynamic
        return static

    def _capture(self, key: tuple, args: tuple, kwargs: dict, leaves: list) -> Captured:
        signature = self._signatures.setdefault(key, _Signature())
        if self.captures:
            log.info("amp_graph: new input signature or sizes for %s; capturing again", self._what)
        if (signature.static or self._symbolic_first) and not signature.tried_dynamic:
            signature.tried_dynamic = True  # sizes vary: one graph with symbolic sizes
            captured = None
            try:
                captured = self._capture_fn(args, kwargs, True)
            except (CaptureError, PassError) as error:
                # the passes too run ops on the symbolic sizes, where some of torch's kernels
                # refuse them (aten.lstm: "numel() on tensor with symbolic sizes"); a real
                # bug of a pass fails the static capture below as well
                log.info("capture with symbolic sizes failed (%s); capturing per size", error)
            if captured is not None and captured.accepts(leaves):
                signature.dynamic = captured
                self.captures.append(captured)
                return captured
        if len(signature.static) >= MAX_GRAPHS_PER_SIGNATURE:
            warnings.warn(
                f"amp_graph has captured {len(signature.static)} graphs for the input sizes "
                f"of {self._what} and captures another: it could not be captured with "
                "symbolic sizes. Pad inputs to a few sizes.",
                stacklevel=4,
            )
        captured = self._capture_fn(args, kwargs, False)
        if captured.guard is None:  # no size to guard: it serves any
            signature.dynamic = captured
        else:
            signature.static[_shapes(leaves)] = captured
        self.captures.append(captured)
        return captured


__all__ = ["MAX_GRAPHS_PER_SIGNATURE", "CaptureCache", "CaptureFn"]
