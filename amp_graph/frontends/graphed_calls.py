"""``amp_graph.compile(model, ..., mode="cudagraphs")``: the forward and the backward of each
rewritten graph replayed as two CUDA graphs, for users who keep their own training loop.

What ``torch.cuda.make_graphed_callables`` does, per input signature (the graph a call uses,
its inputs' sizes, dtypes and devices, the values of its non-tensor inputs), with what a
training loop needs beside it:

* the backward hands autograd *copies* of the gradients. make_graphed_callables returns views
  of the backward graph's static memory, which autograd may keep as a parameter's ``.grad``;
  the next replay then writes into that ``.grad``, so that two backwards before a step
  (gradient accumulation) or gradients zeroed in place are summed twice;
* the warm-up leaves no trace: buffers the graph writes (BatchNorm's statistics) and the CUDA
  RNG state are put back after it, so that a step computes what the uncaptured graph would;
* calls it does not capture run the graph uncaptured: without grad (evaluation), a monitor's
  logging steps, a graph none of whose outputs needs a gradient, one that returns values it
  computes on the host. Each reason but the monitor's (its logging steps are few, by design)
  is said once at WARNING, with the way out: the user asked for CUDA graphs;
* graphs in a bounded least-recently-used cache sharing one memory pool, a log line each; the
  first graph dropped (its signature will warm up and capture again) is a WARNING;
* refusals at the first call, before anything runs: tensors not on a CUDA device, DTensor
  (FSDP2) parameters.

The forward returns the forward graph's outputs, which the next replay of that graph
overwrites (as make_graphed_callables and ``torch.compile(mode="reduce-overhead")`` do):
run backward before the next call, and clone what you keep.

``signature_of`` and :class:`CudaGraphError` are shared with ``Graph.config.enable_cuda_graph``
(:mod:`amp_graph.training.cuda_graph_step`).
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from amp_graph.ops.dtensors import is_dtensor

log = logging.getLogger(__name__)

Signature = tuple
V = TypeVar("V")


class CudaGraphError(RuntimeError):
    """A step cannot be captured as it is: the message names the cause and the way out."""


def signature_of(leaves: Sequence[Any]) -> Signature:
    """What a capture fixes about the inputs: each tensor's sizes, dtype, device and
    ``requires_grad``; each other input's value (it is baked into the captured kernels)."""
    out: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            out.append((tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad))
        else:
            try:
                hash(leaf)
                out.append((type(leaf), leaf))
            except TypeError:
                out.append((type(leaf), repr(leaf)))
    return tuple(out)


def refuse_off_cuda(named: Iterable[tuple[str, torch.Tensor]], way_out: str) -> None:
    """Every tensor a captured graph reads or writes must be on a CUDA device."""
    named = list(named)
    elsewhere = [(what, t.device) for what, t in named if t.device.type != "cuda"]
    if not elsewhere:
        return
    if len(elsewhere) == len(named):
        raise CudaGraphError(
            f"cuda graphs: the model runs on {elsewhere[0][1]}, not on a CUDA device: CUDA "
            f"graphs capture CUDA work. Move the model and its inputs to the GPU (.cuda()), or "
            f"{way_out}."
        )
    listed = ", ".join(f"{what} on {device}" for what, device in elsewhere[:4])
    raise CudaGraphError(
        f"cuda graphs: tensors are not on a CUDA device ({listed}): a captured graph cannot "
        f"read or write them. Move them to the GPU, or {way_out}."
    )


WAY_OUT = "compile with another mode (mode='eager' or 'default')"


def is_sharded(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``tensors`` is a DTensor (FSDP2), whose collectives are not captured."""
    return any(is_dtensor(t) for t in tensors)


def static_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` for a capture to read: same layout and ``requires_grad``."""
    static = torch.empty_like(x, memory_format=torch.preserve_format).copy_(x.detach())
    return static.requires_grad_(x.requires_grad)


@contextlib.contextmanager
def on_side_stream(stream: torch.cuda.Stream) -> Iterator[None]:
    """Work queued inside runs on ``stream`` after what the current stream queued before, and
    the current stream waits for it on exit: torch's rule for the warm-up before a capture
    (lazy initialization, such as cuBLAS workspaces and optimizer state, happens outside)."""
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        yield
    current.wait_stream(stream)


def release_cached_blocks() -> None:
    """Hands the caching allocator's unused blocks back to the device; called right before a
    capture. A capture allocates from its own pool, and while one is underway the allocator
    frees no other pool's cached blocks to make room (CUDACachingAllocator releases them only
    when no capture is underway). Without this, the blocks the warm-up steps cached would sit
    beside the capture's pool: the first capture would reserve about twice the step's
    transient memory, and a step that fits uncaptured could run out of memory in its capture.
    Costs one device synchronization per capture, and later uncaptured allocations may have
    to ask the device again (``torch.cuda.empty_cache``'s usual cost)."""
    torch.cuda.empty_cache()


class LeastRecentlyUsed(Generic[V]):
    """Captured graphs by signature, at most ``limit``: putting one more drops the least
    recently used (a log line each on ``logger``, naming ``owner``), so that the graphs'
    memory stays bounded. :meth:`get` counts as a use."""

    def __init__(self, owner: str, limit: int, logger: logging.Logger = log) -> None:
        self.owner, self.limit, self.log = owner, limit, logger
        self._items: OrderedDict[Any, V] = OrderedDict()
        self._dropped_before = False

    def __contains__(self, key: Any) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def values(self) -> list[V]:
        """What is held, least recently used first (not counted as a use)."""
        return list(self._items.values())

    def get(self, key: Any) -> V:
        self._items.move_to_end(key)
        return self._items[key]

    def put(self, key: Any, value: V) -> list[Any]:
        """Keeps ``value`` as the most recently used; returns the keys dropped for it."""
        self._items[key] = value
        dropped = []
        while len(self._items) > self.limit:
            old, _ = self._items.popitem(last=False)
            dropped.append(old)
            # the first drop is a WARNING: from here on, returning signatures warm up and
            # capture again, which can cost more than the graphs save
            level = logging.INFO if self._dropped_before else logging.WARNING
            self._dropped_before = True
            self.log.log(
                level,
                "%s: dropped the least recently used CUDA graph (max_graphs=%d): more input "
                "signatures than graphs held, so a dropped one warms up and captures again when "
                "it returns. Raise max_graphs, or pad the inputs to fewer sizes.",
                self.owner,
                self.limit,
            )
        return dropped

    def clear(self) -> None:
        self._items.clear()


class _Bound(nn.Module):
    """A graph with its non-tensor inputs bound: called with the tensors alone, returning the
    tensors alone (what a capture takes and gives); its parameters are the graph's."""

    def __init__(self, gm: fx.GraphModule, leaves: Sequence[Any]) -> None:
        super().__init__()
        self.gm = gm
        self.tensor_positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.template = [None if isinstance(x, torch.Tensor) else x for x in leaves]

    def forward(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        leaves = list(self.template)
        for i, tensor in zip(self.tensor_positions, tensors, strict=True):
            leaves[i] = tensor
        return [t for t in pytree.tree_leaves(self.gm(*leaves)) if isinstance(t, torch.Tensor)]


def capture_forward_backward(
    module: nn.Module,
    sample: tuple[torch.Tensor, ...],
    pool: Any,
    warmup: int,
    named: list[tuple[str, torch.Tensor]],
) -> Callable[..., Any] | None:
    """``module``'s forward and backward as CUDA graphs (None: nothing needs a gradient);
    the returned function takes the tensors ``sample`` stands for and returns the outputs.
    ``named``: every tensor the module reads, for the refusals."""
    refuse_off_cuda(named, WAY_OUT)
    if is_sharded(t for _, t in named):
        raise CudaGraphError(
            "cuda graphs: the model has DTensor (FSDP2) parameters, whose collectives "
            f"amp_graph does not capture yet; {WAY_OUT}."
        )
    params = tuple(p for p in module.parameters() if p.requires_grad)
    statics = tuple(static_copy(x) for x in sample)
    surface = tuple(t for t in (*statics, *params) if t.requires_grad)
    if not surface:
        return None
    with on_side_stream(torch.cuda.Stream()):
        for _ in range(warmup):
            outs = [o for o in module(*statics) if o.requires_grad]
            if not outs:
                return None
            torch.autograd.grad(
                outs, surface, [torch.empty_like(o) for o in outs], allow_unused=True
            )
    # ``outs`` stays alive through the capture: its graph holds the parameters' AccumulateGrad
    # nodes made on the warm-up's stream, which the capture then reuses (on an H200 with
    # torch 2.11, dropping them first made the backward capture fail: "operation would make
    # the legacy stream depend on a capturing blocking stream")
    forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    release_cached_blocks()
    with torch.cuda.graph(forward, pool=pool):
        outputs = module(*statics)
    needing = [o for o in outputs if o.requires_grad]
    grad_outputs = [torch.empty_like(o) for o in needing]
    with torch.cuda.graph(backward, pool=pool):
        grads = torch.autograd.grad(needing, surface, grad_outputs, allow_unused=True)
    grad_of = {id(t): g for t, g in zip(surface, grads, strict=True)}
    inputs_grads = [grad_of.get(id(t)) for t in (*statics, *params)]
    which = [o.requires_grad for o in outputs]
    # Kept with their autograd graph, the outputs would keep the parameters' AccumulateGrad
    # nodes made on the capture's stream: each later backward would accumulate there,
    # unordered with the caller's stream (seen on an H200: wrong accumulated gradients).
    outputs = [o.detach() for o in outputs]
    del needing, outs

    class Replayed(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            for static, given in zip(statics, inputs[: len(statics)], strict=True):
                if static.data_ptr() != given.data_ptr():
                    static.copy_(given)
            forward.replay()
            return tuple(o.detach() for o in outputs)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx: Any, *grads_in: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            needed = [g for g, w in zip(grads_in, which, strict=True) if w]
            for static, given in zip(grad_outputs, needed, strict=True):
                if given is None:
                    static.zero_()
                elif static.data_ptr() != given.data_ptr():
                    static.copy_(given)
            backward.replay()
            # copies: autograd may keep a returned gradient as .grad, which the next replay
            # would overwrite (make_graphed_callables returns views, see the module)
            return tuple(None if g is None else g.clone() for g in inputs_grads)

    def run(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return Replayed.apply(*tensors, *params)

    return run


class GraphedCalls:
    """The captured forward/backward pairs of a compiled module, per input signature."""

    def __init__(
        self,
        name: str,
        max_graphs: int = 8,
        warmup: int = 3,
        capture: Callable[..., Callable[..., Any] | None] = capture_forward_backward,
    ) -> None:
        self.name, self.warmup = name, warmup
        self._capture = capture
        self._pool: Any = None
        self._graphs: LeastRecentlyUsed[Callable[..., Any] | None]
        self._graphs = LeastRecentlyUsed(name, max_graphs)
        self.captures = 0
        self.replays = 0
        self._said: set[str] = set()

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    def call(
        self, gm: fx.GraphModule, leaves: Sequence[Any], modules: Callable[[], Iterable]
    ) -> Any:
        """The flat outputs of ``gm`` on ``leaves``, replayed; None where this call runs
        uncaptured (no grad). ``modules`` gives the model's (name, tensor) pairs for the
        device check at the first capture."""
        if not torch.is_grad_enabled():
            self._say_once(
                "no-grad",
                "%s: a call without grad runs uncaptured: mode='cudagraphs' captures a training "
                "call's forward and backward. For inference, compile with "
                "mode='reduce-overhead' (inductor's kernels, replayed as CUDA graphs).",
            )
            return None
        key = (id(gm), signature_of(leaves))
        if key in self._graphs:
            replay = self._graphs.get(key)
        else:
            replay = self._new(key, gm, leaves, modules)
        if replay is None:
            return None
        self.replays += 1
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        return _merge(gm, leaves, replay(*tensors))

    def _new(
        self, key: Signature, gm: fx.GraphModule, leaves: Sequence[Any], modules: Callable
    ) -> Callable[..., Any] | None:
        named = [*modules(), *((f"input {i}", x) for i, x in enumerate(leaves) if _is_t(x))]
        if not _tensor_outputs_only(gm):
            self._say_once(
                "host-outputs",
                "%s: the graph returns values it computes on the host (a Python number from "
                "a tensor, .item(), .tolist()), which a CUDA graph cannot replay: it runs "
                "uncaptured. Return tensors, or compile with another mode.",
            )
            self._graphs.put(key, None)
            return None
        bound = _Bound(gm, leaves)
        tensors = tuple(x for x in leaves if isinstance(x, torch.Tensor))
        if self._pool is None and torch.cuda.is_available():
            self._pool = torch.cuda.graph_pool_handle()
        with _untouched(gm):  # the warm-up's forwards write buffers and draw random numbers
            replay = self._capture(bound, tensors, self._pool, self.warmup, named)
        if replay is None:
            self._graphs.put(key, None)
            self._say_once(
                "no-gradient",
                "%s: no output of the graph needs a gradient (frozen parameters, inputs "
                "without requires_grad): it runs uncaptured, as mode='cudagraphs' captures "
                "forward and backward. For a forward alone, compile with "
                "mode='reduce-overhead' (inductor's kernels, replayed as CUDA graphs).",
            )
            return None
        self.captures += 1
        self._graphs.put(key, replay)
        log.info(
            "%s: captured forward and backward as CUDA graphs for input sizes %s (%d held, "
            "at most %d)",
            self.name,
            [tuple(t.shape) for t in tensors],
            len(self._graphs),
            self._graphs.limit,
        )
        return replay

    def _say_once(self, reason: str, message: str) -> None:
        """A WARNING the first time this module's calls run uncaptured for ``reason``."""
        if reason not in self._said:
            self._said.add(reason)
            log.warning(message, self.name)


def _is_t(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _tensor_outputs_only(gm: fx.GraphModule) -> bool:
    """Whether every output ``gm`` computes is a tensor (constants aside)."""
    [output] = [n for n in gm.graph.nodes if n.op == "output"]
    return all(
        _is_t(a.meta.get("val"))
        for a in pytree.tree_leaves(output.args[0])
        if isinstance(a, fx.Node)
    )


def _merge(gm: fx.GraphModule, leaves: Sequence[Any], tensors: Sequence[torch.Tensor]) -> Any:
    """What ``gm`` returns, with the replayed tensors in its tensor outputs' places (its
    other outputs are constants of the graph: its output node holds them)."""
    [output] = [n for n in gm.graph.nodes if n.op == "output"]
    flat, spec = pytree.tree_flatten(output.args[0])
    replayed = iter(tensors)
    values = [next(replayed) if isinstance(a, fx.Node) else a for a in flat]
    return pytree.tree_unflatten(values, spec)


class _untouched:
    """Puts ``gm``'s buffers and the CUDA RNG state back as they were on entry."""

    def __init__(self, gm: nn.Module) -> None:
        self.gm = gm

    def __enter__(self) -> None:
        self.buffers = [(b, b.detach().clone()) for b in self.gm.buffers()]
        self.rng = torch.cuda.get_rng_state() if torch.cuda.is_available() else None

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        if self.rng is not None:
            torch.cuda.set_rng_state(self.rng)


__all__ = [
    "CudaGraphError",
    "GraphedCalls",
    "LeastRecentlyUsed",
    "capture_forward_backward",
    "is_sharded",
    "on_side_stream",
    "refuse_off_cuda",
    "signature_of",
    "static_copy",
]
