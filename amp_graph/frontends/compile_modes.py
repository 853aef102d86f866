"""``amp_graph.compile(model, policy, mode=...)``: how the rewritten graphs run.

The passes decide every op's dtype and leave an ordinary GraphModule; the mode says what
runs it. The names are torch.compile's, so a user who knows ``torch.compile(mode=...)``
knows these:

* ``"eager"``: the GraphModule as it is, op by op through PyTorch's kernels (as
  ``torch.compile(backend="eager")`` runs dynamo's graph). No compile time; the recompute of
  casts runs through saved-tensor hooks (:mod:`amp_graph.ops.recompute_ops`).
* ``"cudagraphs"``: ``"eager"`` with each graph's forward and backward replayed as CUDA
  graphs (:mod:`amp_graph.frontends.graphed_calls`; ``torch.compile(backend="cudagraphs")``
  is its torch namesake). What ``cuda_graph=True`` asked for, which is its deprecated alias.
* ``"default"``, ``"reduce-overhead"``, ``"max-autotune"``, ``"max-autotune-no-cudagraphs"``:
  each graph handed to ``torch.compile`` with that mode (inductor): the casts fuse into their
  neighbours, and AOTAutograd's partitioner decides what backward keeps
  (``recompute_casts=True`` tags the casts it should recompute).
  ``"reduce-overhead"`` adds CUDA graphs, so it is refused off CUDA rather than silently run
  without them.

``mode=None`` picks :data:`DEFAULT_MODES` by the model's device, by measurement: no default
may be slower than the eager ``torch.autocast`` loop on any setup measured (BENCHMARKS.md,
"The compile modes"). ``Graph.config.enable_compile`` checks its mode with the same
:func:`check_inductor_mode` and compiles through the same :func:`inductor_compiled`.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from amp_graph.frontends.compiled_segments import compiled_around_calls, has_kept_calls
from amp_graph.frontends.graphed_calls import CudaGraphError
from amp_graph.ops import recompute_ops
from amp_graph.policy import nearest

INDUCTOR_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
EAGER_MODES = ("eager", "cudagraphs")
MODES = (*EAGER_MODES, *INDUCTOR_MODES)
CUDA_GRAPH_MODES = ("cudagraphs", "reduce-overhead")  # their point is the CUDA graphs
# torch.compile modes that capture CUDA graphs of their own on CUDA (max-autotune's point is
# the autotuning, so it runs on the CPU, where it captures none)
INDUCTOR_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")

# What mode=None means, per device type, and why (a measurement each; BENCHMARKS.md, "The
# compile modes"). CPU: the eager graph is at parity with the eager autocast loop and its first
# call takes under a second, where inductor's takes 8-13 s and was slower on a ConvNet. CUDA:
# the eager graph measured 1.02-1.06x the eager autocast loop on an H200, so inductor, which
# fuses the casts. Devices never measured keep the eager graph.
DEFAULT_MODES = {"cpu": "eager", "cuda": "default"}


@dataclasses.dataclass(frozen=True)
class RunMode:
    """A resolved mode: its name, whether inductor compiles the graphs, and whether CUDA
    graphs replay them."""

    name: str

    @property
    def inductor(self) -> bool:
        return self.name in INDUCTOR_MODES

    @property
    def cuda_graphs(self) -> bool:
        return self.name in CUDA_GRAPH_MODES


EAGER = RunMode("eager")


def default_mode(device_type: str, sharded: bool = False) -> str:
    """The mode ``mode=None`` gives a model on ``device_type``: ``"eager"`` for one with
    DTensor parameters (FSDP2, tensor parallelism), whose graphs call the collectives'
    hooks, which the inductor modes do not take yet."""
    return "eager" if sharded else DEFAULT_MODES.get(device_type, "eager")


def check_mode(mode: Any, where: str = "compile") -> None:
    """``mode`` is one of :data:`MODES` or None (said where it is given, before any capture)."""
    if mode is not None and not isinstance(mode, str):
        raise TypeError(f"{where}: mode is one of {list(MODES)} or None; got {mode!r}")
    if mode is not None and mode not in MODES:
        raise ValueError(
            f"{where}: unknown compile mode {mode!r}; the modes are {list(MODES)}."
            f"{nearest(mode, MODES)}"
        )


def resolve_mode(
    mode: str | None, cuda_graph: bool | None, device_type: str, sharded: bool = False
) -> RunMode:
    """The mode a ``compile`` call asked for, checked against the model's device and
    whether its parameters are DTensors (``sharded``).

    ``cuda_graph=True`` is the deprecated spelling of ``mode="cudagraphs"`` (a FutureWarning
    says so); with another mode it is refused, as are a CUDA-graph mode off CUDA (it would run
    without the graphs it was asked for), an inductor mode for a sharded model, and a name
    that is no mode (naming the nearest)."""
    if cuda_graph is not None and not isinstance(cuda_graph, bool):
        raise TypeError(f"cuda_graph is True or False; got {cuda_graph!r}")
    check_mode(mode)
    if cuda_graph:
        if mode not in (None, "cudagraphs"):
            raise ValueError(
                f"compile(..., mode={mode!r}, cuda_graph=True) asks for two modes: cuda_graph=True "
                "is the old spelling of mode='cudagraphs'. Pass mode alone ('reduce-overhead' "
                "for inductor's kernels replayed as CUDA graphs)."
            )
        warnings.warn(
            "compile(..., cuda_graph=True) is deprecated: pass mode='cudagraphs' (the same: the "
            "eager graph replayed as CUDA graphs), or mode='reduce-overhead' for inductor's "
            "kernels replayed as CUDA graphs.",
            FutureWarning,
            stacklevel=3,
        )
        mode = "cudagraphs"
    if cuda_graph is False and mode == "cudagraphs":
        raise ValueError("compile(..., mode='cudagraphs', cuda_graph=False) contradicts itself")
    resolved = RunMode(mode if mode is not None else default_mode(device_type, sharded))
    refuse_cuda_graphs_off_cuda(resolved.name, device_type, "compile(..., mode=...)")
    if resolved.inductor and sharded:
        raise ValueError(
            f"compile(..., mode={resolved.name!r}): the model's parameters are DTensors (FSDP2 "
            "or tensor parallelism), whose graphs call the collectives' hooks, and amp_graph "
            "does not hand those graphs to inductor yet. Use mode='eager' (the default for "
            "such a model), or torch.compile(model, backend='amp_graph') for inductor's "
            "kernels of a tensor-parallel model."
        )
    return resolved


def refuse_cuda_graphs_off_cuda(mode: str | None, device_type: str, where: str) -> None:
    """A mode whose point is CUDA graphs, for a model off CUDA: refused, as torch.compile would
    run it without them and say nothing."""
    if mode in CUDA_GRAPH_MODES and device_type != "cuda":
        raise CudaGraphError(
            f"{where}: mode {mode!r} is for CUDA graphs, which capture CUDA work, and the model "
            f"is on {device_type}, not on a CUDA device. Move the model to the GPU, or use "
            "mode='default' (inductor)"
            + (" or mode='eager'" if where.startswith("compile") else "")
            + "."
        )


def check_inductor_mode(mode: Any, where: str) -> None:
    """A torch.compile ``mode=`` for ``where`` (``"enable_compile"``): one of
    :data:`INDUCTOR_MODES` or None, said early rather than at the first call."""
    if mode is None or mode in INDUCTOR_MODES:
        return
    hint = " (amp_graph.compile's 'eager' and 'cudagraphs' are not torch.compile modes)"
    raise ValueError(
        f"{where}: unknown torch.compile mode {mode!r}; the modes are "
        f"{list(INDUCTOR_MODES)}.{nearest(str(mode), INDUCTOR_MODES)}"
        + (hint if mode in EAGER_MODES else "")
    )


def inductor_compiled(fn: Callable[..., Any], options: dict[str, Any]) -> Callable[..., Any]:
    """``fn`` under ``torch.compile(**options)``; a GraphModule first loses the recompute's
    saved-tensor hooks (AOTAutograd's partitioner decides what backward keeps, and dynamo
    must not trace Python hooks around the forward). A GraphModule with kept Function or
    custom op calls is compiled around them, so that they run as torch.autocast runs them
    (:mod:`amp_graph.frontends.compiled_segments`). A GraphModule with symbolic sizes is
    compiled with ``dynamic=True`` unless ``options`` say otherwise."""
    if isinstance(fn, torch.nn.Module):
        recompute_ops.uninstall(fn)
    if isinstance(fn, fx.GraphModule) and "dynamic" not in options and has_symbolic_sizes(fn):
        # a graph captured for every size is compiled for every size: dynamo would
        # otherwise specialize it to the first size it runs with, and compile it again at
        # the next
        options = {**options, "dynamic": True}
    if isinstance(fn, fx.GraphModule) and has_kept_calls(fn):
        compiled = compiled_around_calls(fn, lambda piece: torch.compile(piece, **options))
    else:
        compiled = torch.compile(fn, **options)
    if isinstance(fn, torch.nn.Module) and any(
        isinstance(m, torch.nn.RNNBase) for m in fn.modules()
    ):
        return RnnAllowed(compiled)
    return compiled


class RnnAllowed(torch.nn.Module):
    """A compiled graph that reads an ``nn.LSTM``'s (GRU's, RNN's) weights, called with
    dynamo's ``allow_rnn``: dynamo refuses to trace through such a module by default (its
    forward would graph-break), but the graph calls ``aten.lstm`` itself and only reads the
    module's parameters. Set per call, as dynamo compiles again at a call with new sizes."""

    def __init__(self, compiled: Callable[..., Any]) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(allow_rnn=True):
            return self.compiled(*args, **kwargs)


class InductorCalls:
    """Each rewritten graph compiled by ``torch.compile(mode=...)`` at its first call, kept
    while the graph lives. A graph compiled once serves every call with its inputs' sizes
    (dynamo recompiles on new ones, as it does for any model)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._compiled: weakref.WeakKeyDictionary[fx.GraphModule, Callable[..., Any]] = (
            weakref.WeakKeyDictionary()
        )

    def __len__(self) -> int:
        return len(self._compiled)

    def __reduce__(self) -> tuple[type, tuple[str]]:
        """Pickled as its mode: compiled graphs are this process's (loaded, they compile
        again at their first call)."""
        return (InductorCalls, (self.mode,))

    def call(self, gm: fx.GraphModule, leaves: Sequence[Any]) -> Any:
        """The flat outputs of ``gm`` on ``leaves``, through its compiled form."""
        compiled = self._compiled.get(gm)
        if compiled is None:
            # fullgraph: the graph is aten ops already, so a break would be a bug of ours,
            # not something to run around silently
            compiled = inductor_compiled(gm, {"mode": self.mode, "fullgraph": True})
            self._compiled[gm] = compiled
        return compiled(*leaves)


def has_symbolic_sizes(gm: fx.GraphModule) -> bool:
    """An input of ``gm`` has a symbolic size, or is one (the capture made it for every
    size, :mod:`amp_graph.capture.symbolic_sizes`)."""
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("val")
        sizes = value.shape if isinstance(value, torch.Tensor) else (value,)
        if any(isinstance(size, torch.SymInt) for size in sizes):
            return True
    return False


__all__ = [
    "CUDA_GRAPH_MODES",
    "DEFAULT_MODES",
    "EAGER",
    "EAGER_MODES",
    "INDUCTOR_CUDA_GRAPH_MODES",
    "INDUCTOR_MODES",
    "MODES",
    "InductorCalls",
    "RunMode",
    "check_inductor_mode",
    "default_mode",
    "has_symbolic_sizes",
    "inductor_compiled",
    "refuse_cuda_graphs_off_cuda",
    "resolve_mode",
]
