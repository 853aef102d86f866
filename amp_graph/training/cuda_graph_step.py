"""The whole step of an :class:`amp_graph.Graph` as one CUDA graph: ``config.enable_cuda_graph``.

A replayed CUDA graph runs the captured kernels again on the same memory and runs no Python.
So the step's tensors must stay where the capture saw them, and nothing the step decides on
the host may change between replays. What this module holds, and why:

* the refusals, made at the first call before any step is taken, each naming its cause and
  the way out: an optimizer that cannot skip on the device or be captured (``fused=True``,
  ``capturable=True``), a float learning rate an LR scheduler would change (a replay keeps
  the captured value; a device tensor changed in place is read by every replay), torch.compile
  modes that capture CUDA graphs themselves, distributed steps (not yet), a ``build`` that
  reads a device value on the host (``.item()``, boolean-mask indexing: a node list), and
  (in :class:`CudaGraphCapture`) tensors that are not on a CUDA device;
* :class:`StepReplayer`: per input signature (sizes, dtypes, devices, the values of
  non-tensor inputs) ``warmup_steps`` eager steps on a side stream, then one capture into
  static inputs, then replays; the captured graphs share one memory pool and live in a
  bounded least-recently-used cache, with a log line per capture and per eviction; what a
  replay returns is cloned, so that it survives the next replay; a monitor's logging step is
  a step graph of its own (its statistics go through one fixed buffer: see
  :meth:`amp_graph.monitoring.Monitor.replayable`); a smaller batch may be padded up to a
  captured one (:mod:`amp_graph.training.batch_padding`);
* :class:`CudaGraphCapture`: the CUDA half (side stream, pool, ``torch.cuda.graph``), the
  only part that needs a GPU. Tests on the CPU give the replayer a stand-in that reruns the
  step, which checks the replayer's bookkeeping but not a capture (``pytest -m cuda`` does).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils import _pytree as pytree

from amp_graph.frontends.compile_modes import INDUCTOR_CUDA_GRAPH_MODES
from amp_graph.frontends.graphed_calls import (
    CudaGraphError,
    LeastRecentlyUsed,
    Signature,
    is_sharded,
    on_side_stream,
    refuse_off_cuda,
    release_cached_blocks,
    signature_of,
    static_copy,
)
from amp_graph.passes.meta import AMP
from amp_graph.training.batch_padding import (
    PaddedBatch,
    PadValue,
    checked_pad_values,
    padded_batch,
    refuse_padding,
)

log = logging.getLogger(__name__)

aten = torch.ops.aten

# aten ops whose result the host must read before it can go on: a device-to-host copy
# (a synchronization), which stream capture forbids.
HOST_READS = frozenset(
    {
        aten._local_scalar_dense,
        aten.item,
        aten.is_nonzero,
        aten.equal,
        aten.nonzero,
        aten.masked_select,
        aten._unique,
        aten._unique2,
        aten.unique_dim,
        aten.unique_consecutive,
    }
)

OUT_OF_GRAPH = "turn it off with config.enable_cuda_graph(False)"


@dataclass(frozen=True)
class CudaGraphOptions:
    """``config.enable_cuda_graph``'s settings (see there)."""

    warmup_steps: int = 3
    max_graphs: int = 8
    pad_batches: tuple[PadValue, ...] | None = None  # batch_padding
    set_to_none: bool = False  # gradients set to None (each graph its own) or zeroed in place

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "max_graphs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"enable_cuda_graph: {name} is a positive int; got {value!r}")
        if not isinstance(self.set_to_none, bool):
            raise ValueError(f"enable_cuda_graph: set_to_none is a bool; got {self.set_to_none!r}")
        object.__setattr__(self, "pad_batches", checked_pad_values(self.pad_batches))


# ---- refusals ----------------------------------------------------------------------------


def refuse_uncapturable_step(
    optimizers: Sequence[torch.optim.Optimizer],
    schedulers: Sequence[Any],
    compile_options: dict[str, Any] | None,
    process_group: Any,
    modules: dict[str, torch.nn.Module],
    build: fx.GraphModule,
    padding: bool = False,
    accumulation_steps: int = 1,
) -> None:
    """Every refusal a Graph's step meets before its first step, except the devices (which
    the :class:`StepCapture` checks): ``compile_options`` is None without enable_compile;
    ``padding``: whether ``pad_batches`` is set."""
    if padding:
        refuse_padding(modules.values(), accumulation_steps)
    scheduled = {id(s.optimizer) for s in schedulers if hasattr(s, "optimizer")}
    refuse_uncapturable_optimizers(optimizers, scheduled)
    if compile_options is not None:
        refuse_compile_cuda_graphs(compile_options)
    refuse_distributed(process_group, [p for m in modules.values() for p in m.parameters()])
    refuse_host_reads(build)


def step_tensors(
    modules: dict[str, torch.nn.Module], leaves: Sequence[Any]
) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a step reads or writes, named: parameters, buffers, tensor inputs."""
    named = [
        (f"{kind} {prefix}.{name}", t)
        for prefix, module in modules.items()
        for kind, items in (
            ("parameter", module.named_parameters()),
            ("buffer", module.named_buffers()),
        )
        for name, t in items
    ]
    return named + [(f"input {i}", x) for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]


def refuse_uncapturable_optimizers(
    optimizers: Sequence[torch.optim.Optimizer], scheduled: set[int]
) -> None:
    """Every optimizer must skip an inf/nan step on the device (it takes ``found_inf``:
    torch's ``fused=True``) and, where it has the flag, be ``capturable=True``; an optimizer
    that an LR scheduler drives (``id`` in ``scheduled``) must hold its learning rate as a
    tensor, which a scheduler changes in place."""
    for i, opt in enumerate(optimizers):
        name = f"optimizer {i} ({type(opt).__name__})"
        if not getattr(opt, "_step_supports_amp_scaling", False):
            raise CudaGraphError(
                f"enable_cuda_graph: {name} cannot skip an inf/nan step on the device, so "
                "each step would read the flag on the host, which a captured graph cannot "
                f"do. Construct it with fused=True (torch's Adam, AdamW and SGD), or "
                f"{OUT_OF_GRAPH}."
            )
        for k, group in enumerate(opt.param_groups):
            if "capturable" in group and not group["capturable"]:
                raise CudaGraphError(
                    f"enable_cuda_graph: {name}, param group {k}, has capturable=False: its "
                    "step count lives on the host. Construct it with capturable=True (and "
                    f"fused=True), or {OUT_OF_GRAPH}."
                )
            if id(opt) in scheduled and not isinstance(group["lr"], torch.Tensor):
                raise CudaGraphError(
                    f"enable_cuda_graph: {name}, param group {k}, has lr={group['lr']!r}, a "
                    "Python number, and an LR scheduler changes it: a replayed graph keeps "
                    "the value it was captured with. Pass the learning rate as a device "
                    "tensor (lr=torch.tensor(1e-3, device='cuda')); schedulers change it in "
                    "place, and every replay reads it."
                )


def learning_rates(optimizers: Sequence[torch.optim.Optimizer]) -> list[Any]:
    """The learning rates a capture bakes in (Python numbers; tensors are read by replays)."""
    return [
        group["lr"]
        for opt in optimizers
        for group in opt.param_groups
        if not isinstance(group["lr"], torch.Tensor)
    ]


def refuse_changed_learning_rates(captured: list[Any], now: list[Any]) -> None:
    """A Python learning rate set since the capture would be ignored by every replay."""
    if captured != now:
        raise CudaGraphError(
            f"enable_cuda_graph: a learning rate changed from {captured} to {now} since the "
            "step was captured; a replayed graph keeps the captured value. Pass the learning "
            "rate as a device tensor (lr=torch.tensor(1e-3, device='cuda')) and change it in "
            "place (schedulers do), or set it before the first call."
        )


def refuse_compile_cuda_graphs(compile_options: dict[str, Any]) -> None:
    """torch.compile modes that capture CUDA graphs of their own cannot run inside ours."""
    mode = compile_options.get("mode")
    cudagraphs = (compile_options.get("options") or {}).get("triton.cudagraphs")
    if mode in INDUCTOR_CUDA_GRAPH_MODES or cudagraphs:
        raise CudaGraphError(
            f"enable_cuda_graph: enable_compile(mode={mode!r}) captures CUDA graphs of its "
            "own, which cannot run inside the step's capture. Use enable_compile() with the "
            "default mode (the whole step is captured anyway), or keep torch.compile's graphs "
            "and turn enable_cuda_graph off."
        )


def refuse_distributed(process_group: Any, tensors: Iterable[torch.Tensor]) -> None:
    """Capturing collectives of the step (DDP, FSDP2, an agreeing process group) is not done
    yet: NCCL allows it in some setups, which amp_graph has not tested."""
    sharded = is_sharded(tensors)
    if process_group is not None or sharded:
        what = "DTensor (FSDP2) parameters" if sharded else "config.set_process_group"
        raise CudaGraphError(
            f"enable_cuda_graph: the step has {what}, whose collectives amp_graph does not "
            "capture yet (NCCL can be captured only in setups amp_graph has not tested). "
            f"Run distributed steps uncaptured: {OUT_OF_GRAPH}."
        )


def host_reads(build: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``build`` that read a device value on the host: ops of
    :data:`HOST_READS`, and any node whose size depends on the data (an unbacked symbol)."""
    found = []
    for node in build.graph.nodes:
        packet = getattr(node.target, "overloadpacket", None)
        val = node.meta.get("val")
        data_dependent = isinstance(val, torch.Tensor) and free_unbacked_symbols(val)
        if packet in HOST_READS or data_dependent:
            found.append(node)
    return found


def refuse_host_reads(build: fx.GraphModule) -> None:
    """Refuse a ``build`` that reads device values on the host, naming where."""
    nodes = host_reads(build)
    if nodes:
        where = [f"{n.name} ({getattr(n.target, '__name__', n.target)}{_in(n)})" for n in nodes[:5]]
        raise CudaGraphError(
            "enable_cuda_graph: build reads device values on the host, which a captured "
            f"graph cannot do: {', '.join(where)}. Remove the .item() / boolean-mask indexing "
            "/ data-dependent branch from build (or compute it with tensor ops such as "
            f"torch.where), or {OUT_OF_GRAPH}."
        )


def _in(node: fx.Node) -> str:
    info = node.meta.get(AMP)
    return f" in {info.module_path}" if info is not None and info.module_path else ""


# ---- capture and replay ------------------------------------------------------------------


class StepCapture(Protocol):
    """What :class:`StepReplayer` needs from a device: run a step uncaptured (a warm-up),
    capture one (the step is not computed), replay a capture (returns its
    outputs), release what the dropped graphs held."""

    def check_devices(self, named: Iterable[tuple[str, torch.Tensor]]) -> None: ...
    def warmup(self, fn: Callable[[], Any]) -> Any: ...
    def capture(self, fn: Callable[[], Any]) -> Any: ...
    def replay(self, captured: Any) -> Any: ...
    def release(self) -> None: ...


@dataclass
class _CudaCaptured:
    graph: torch.cuda.CUDAGraph
    outputs: Any


class CudaGraphCapture:
    """Warm-up and capture on one side stream, into one memory pool shared
    by all of this step's graphs (they never run at once); replay on the caller's stream.
    Each capture first hands the warm-ups' cached blocks back to the device
    (:func:`~amp_graph.frontends.graphed_calls.release_cached_blocks`).

    One stream for all of it, because autograd runs a parameter's gradient accumulation on
    the stream its AccumulateGrad node was created on, and that node outlives a step while
    anything holds the step's autograd graph: a node made on the default stream and used in a
    capture makes the capture fail (the legacy stream cannot wait on a capturing stream), one
    made on another stream costs a cross-stream wait. The outputs a step hands back are
    detached for the same reason (:class:`StepReplayer` detaches what a warm-up returns)."""

    def __init__(self) -> None:
        self._pool: Any = None
        self._side: torch.cuda.Stream | None = None

    def check_devices(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        refuse_off_cuda(named, OUT_OF_GRAPH)

    def _stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream()
        return self._side

    def warmup(self, fn: Callable[[], Any]) -> Any:
        with on_side_stream(self._stream()):
            return fn()

    def capture(self, fn: Callable[[], Any]) -> _CudaCaptured:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        release_cached_blocks()  # the warm-ups' cached blocks, which the capture cannot use
        try:
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream()):
                outputs = fn()
        except RuntimeError as error:
            if "captur" not in str(error):
                raise
            raise CudaGraphError(
                "enable_cuda_graph: the step did something a CUDA graph cannot capture (a "
                "host synchronization: .item(), printing a tensor, a branch on a tensor's "
                f"value, a CPU tensor): {error}. Remove it from build, or {OUT_OF_GRAPH}."
            ) from error
        return _CudaCaptured(graph, detached(outputs))

    def replay(self, captured: _CudaCaptured) -> Any:
        captured.graph.replay()
        return captured.outputs

    def release(self) -> None:
        """Every graph is dropped: the next capture takes a new pool (torch refuses to
        capture into a pool whose graphs are gone while its memory is still in use)."""
        self._pool = None


def detached(outputs: Any) -> Any:
    """``outputs`` with its tensors detached: nothing returned keeps a step's autograd
    graph (and its AccumulateGrad nodes) alive."""
    if isinstance(outputs, torch.Tensor):
        return outputs.detach()
    return pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, outputs)


@dataclass(frozen=True)
class GradsPerGraph:
    """``enable_cuda_graph(set_to_none=True)``: the step sets its gradients to None before its
    backward, as the uncaptured step does, so that each capture allocates gradients of its
    own in the graphs' pool, where its forward's activations were (no zeroing pass, no
    accumulating add, no gradients held beside the activations). A replay writes the
    gradients of its own capture, so :class:`StepReplayer` keeps each graph's and points
    ``.grad`` back at them when another graph ran last.

    ``dropped``: the parameters whose gradients the step drops first (the optimizers');
    ``held``: every parameter whose ``.grad`` a capture sets (those, and O2's low copies,
    whose gradients move to their masters)."""

    dropped: tuple[torch.Tensor, ...]
    held: tuple[torch.Tensor, ...]


@dataclass
class _Entry:
    statics: list[Any]  # the inputs the capture reads: tensors (copied into) and values
    captured: Any
    pinned: list[tuple[Any, str, Any]] = field(default_factory=list)  # (owner, attr, value)
    grads: list[torch.Tensor | None] | None = None  # GradsPerGraph.held's, after the capture


class StepReplayer:
    """Warm-up, capture and replay of a step, one captured graph per input signature.

    :meth:`run` takes the step (a callable of the flat inputs), a key naming it (the same
    step graph: the same key) and the flat inputs. The first ``warmup_steps`` calls of a
    signature run the step eagerly (on a side stream); the next captures it, reading static
    copies of the inputs, and replays it; later calls copy their inputs into the statics and
    replay. ``pins`` are ``(owner, attribute)`` pairs whose values the capture set from
    Python (a replay runs none): each replay puts back its own capture's values. ``grads``
    (:class:`GradsPerGraph`): each graph's gradients, put back as ``.grad`` when another
    graph or an eager step ran last.
    """

    def __init__(
        self,
        name: str,
        options: CudaGraphOptions,
        capture: StepCapture,
        pins: Sequence[tuple[Any, str]] = (),
        grads: GradsPerGraph | None = None,
    ) -> None:
        self.name = name
        self.options = options
        self.device = capture
        self.pins = list(pins)
        self.grads = grads
        self._graphs: LeastRecentlyUsed[_Entry] = LeastRecentlyUsed(name, options.max_graphs, log)
        self._warmed: Counter[Signature] = Counter()
        self._grads_of: _Entry | None = None  # whose gradients .grad holds now, if a graph's
        self.captures = 0  # graphs captured so far (evicted ones included)
        self.replays = 0

    @property
    def graphs(self) -> int:
        """Captured graphs held now (at most ``max_graphs``)."""
        return len(self._graphs)

    def padded(self, args: tuple) -> PaddedBatch | None:
        """``args`` padded up to the batch of a held graph that fits them (``pad_batches``;
        :mod:`amp_graph.training.batch_padding`), or None where padding is off or none fits."""
        if self.options.pad_batches is None:
            return None
        captured = [entry.statics for entry in self._graphs.values()]
        return padded_batch(args, self.options.pad_batches, captured)

    def runner(
        self,
        step: Callable[..., Any],
        around: AbstractContextManager[None] = contextlib.nullcontext(),  # noqa: B008 (reusable)
    ) -> Callable[..., Any]:
        """``step`` called through :meth:`run` (keyed by the step itself), inside ``around``
        (a monitor's logging step: :meth:`Monitor.replayable`)."""

        def run(*leaves: Any) -> Any:
            with around:
                return self.run(id(step), step, leaves)

        return run

    def clear(self) -> None:
        """Drop every captured graph (the next calls warm up and capture again)."""
        self._graphs.clear()
        self._warmed.clear()
        self._grads_of = None
        self.device.release()

    def run(self, key: Any, step: Callable[..., Any], leaves: Sequence[Any]) -> Any:
        signature = (key, signature_of(leaves))
        entry = self._graphs.get(signature) if signature in self._graphs else None
        if entry is None:
            if self._warmed[signature] < self.options.warmup_steps:
                self._warmed[signature] += 1
                self._grads_of = None  # an eager step sets .grad itself
                return detached(self.device.warmup(lambda: step(*leaves)))
            entry = self._capture(signature, step, leaves)
        else:
            for static, leaf in zip(entry.statics, leaves, strict=True):
                if isinstance(static, torch.Tensor):
                    static.copy_(leaf)
        outputs = self.device.replay(entry.captured)
        for owner, attr, value in entry.pinned:
            setattr(owner, attr, value)
        if self.grads is not None and self._grads_of is not entry:
            for param, grad in zip(self.grads.held, entry.grads or (), strict=True):
                param.grad = grad
            self._grads_of = entry
        self.replays += 1
        # the outputs live in the graph's memory, which the next replay overwrites
        return _copied_out(outputs)

    def _capture(self, signature: Signature, step: Callable[..., Any], leaves: Sequence) -> _Entry:
        statics = [static_copy(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        if self.grads is not None:
            # the step drops them first anyway; dropped before the capture, they go back to
            # the device with the warm-ups' cache rather than sit beside the pool (the graphs
            # captured before keep theirs)
            for param in self.grads.dropped:
                param.grad = None
        captured = self.device.capture(lambda: step(*statics))
        pinned = [(owner, attr, getattr(owner, attr, None)) for owner, attr in self.pins]
        entry = _Entry(statics, captured, pinned)
        if self.grads is not None:
            entry.grads = [param.grad for param in self.grads.held]
            self._grads_of = entry
        for old in self._graphs.put(signature, entry):
            del self._warmed[old]  # a dropped signature warms up again before its capture
        self.captures += 1
        shapes = [tuple(x.shape) for x in leaves if isinstance(x, torch.Tensor)]
        log.info(
            "%s: captured the step as CUDA graph %d for input sizes %s (%d held, at most %d)",
            self.name,
            self.captures,
            shapes,
            len(self._graphs),
            self.options.max_graphs,
        )
        return entry


def _copied_out(outputs: Any) -> Any:
    """Copies of the outputs' tensors, outside autograd (``detach`` costs more than this)."""
    with torch.no_grad():
        if isinstance(outputs, torch.Tensor):
            return outputs.clone()
        return pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, outputs)


__all__ = [
    "CudaGraphCapture",
    "CudaGraphError",
    "CudaGraphOptions",
    "GradsPerGraph",
    "StepCapture",
    "StepReplayer",
    "host_reads",
    "learning_rates",
    "refuse_changed_learning_rates",
    "refuse_compile_cuda_graphs",
    "refuse_distributed",
    "refuse_host_reads",
    "refuse_uncapturable_optimizers",
    "refuse_uncapturable_step",
    "signature_of",
    "step_tensors",
]
