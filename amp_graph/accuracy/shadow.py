"""Run a rewritten graph and a float32 shadow of it side by side, node by node.

The shadow executes every node of the *same* graph on float32 values: a cast to a low
floating dtype (amp_graph's, the model's own, a ``dtype=`` argument) becomes a cast to
float32, the fp8 linears become ``F.linear``. So node ``n``'s shadow value is what ``n``
computes when the whole model runs in float32, and the two values of a node compare
directly. Each node's statistics are reduced on the node's device right after it runs
(before any later in-place op can change its value) and read back once, at the end.

Nodes run through ``torch.fx.Interpreter``: two of them over the same graph, ``_MixedRun``
(the graph as written) and ``_ShadowRun`` (its float32 counterpart, which overrides only
the node kinds whose float32 meaning differs), each stepped one node at a time with
``run_node`` by :func:`shadow_run`'s loop. Not ``Interpreter.run``: it runs one graph to
its end, and the two runs must stay in lockstep, so that a node's two values are measured
as soon as both exist (before a later in-place op changes them), a random op's generator
state is replayed for the shadow, and both values are freed after their last use. Not
``FakeTensorProp``: the shadow computes real numbers, not shapes and dtypes.

Guarantees: the model's parameters, buffers, gradients and the global RNG state are the
same after a run as before it. Random ops (dropout) draw the same numbers in both runs.

:func:`shadow_run` is the engine under :func:`amp_graph.numerics` (the report) and
:func:`amp_graph.autopolicy` (the search).
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

from amp_graph.capture.autograd_functions import FunctionCall
from amp_graph.frontends.compiler import CompiledModule
from amp_graph.frontends.front_door import COMPILE_META, CompileRecord
from amp_graph.ops.recompute_ops import recomputed_cast, recomputed_quantize
from amp_graph.passes.meta import (
    AMP,
    FP8_OF,
    LOW_FLOATS,
    inputs_behind_reads,
    users_through_reads,
)
from amp_graph.passes.schema import written_storage


@functools.cache
def shadow_targets() -> dict[Any, Callable[..., Any]]:
    """Nodes whose float32 counterpart is another function: fp8 ops run their math."""
    from amp_graph.ops import fp8_ops  # noqa: F401  (registers torch.ops.amp_graph)

    amp = torch.ops.amp_graph
    return {  # called with the shadow's tensors and the node's own dtype arguments
        amp.fp8_scale.default: amp.fp8_scale.default,
        amp.fp8_linear.default: lambda x, w, _xq, _xs, _wq, _ws, b, _r: F.linear(x, w, b),
        amp.fp8_quantize.default: lambda x, scale, _dtype: x.float() * scale,
        recomputed_quantize: lambda x, scale, _dtype: x.float() * scale,
    }


@functools.cache
def quantize_targets() -> frozenset[Any]:
    """The fp8 quantizations, ``(x, scale, dtype)``: ``fp8_quantize`` and its recomputed form."""
    from amp_graph.ops import fp8_ops  # noqa: F401  (registers torch.ops.amp_graph)

    return frozenset({torch.ops.amp_graph.fp8_quantize.default, recomputed_quantize})


# ---- per-node statistics ----------------------------------------------------------------

FORWARD_STATS = (
    "numel",
    "max_abs",
    "zeros",
    "subnormals",
    "underflow",
    "nonfinite",
    "new_nonfinite",
    "diff_norm",
    "shadow_norm",
    "shadow_max_abs",
)


def reads_back_per_node(device: torch.device) -> bool:
    """Whether statistics are read back as each node runs (CPU: free, and it allows an
    all-finite fast path) or once at the end (devices: no stall per node)."""
    return device.type == "cpu"


def _stats(
    value: torch.Tensor, shadow: torch.Tensor, range_of: torch.dtype | None = None
) -> torch.Tensor | list[float]:
    """FORWARD_STATS of a low-precision value against its float32 shadow: a list of floats
    on CPU, else one float64 tensor on the value's device (read back with the others at
    the end). Subnormal and underflow are judged in ``range_of``
    (default: the value's own dtype).

    On CPU, where reading a flag costs nothing, all-finite values (the usual case) take a
    path with fewer passes; elsewhere nothing is read back, so a run does not stall the
    device once per node.
    """
    tiny = torch.finfo(range_of or value.dtype).tiny
    x = value.detach()  # kept in its dtype: comparisons and reductions need no float copy
    if x.dtype.itemsize == 1:  # float8: torch has no comparisons or reductions for it
        x = x.float()
    s = shadow.detach().to(x.device, torch.float32)
    if s.shape != x.shape:  # a model whose shapes depend on values: not comparable
        s = torch.full_like(s, float("nan"), dtype=torch.float32).expand(x.shape)
    magnitude, shadow_magnitude = x.abs(), s.abs()
    small = magnitude < tiny
    zeros = (magnitude == 0).sum()
    if reads_back_per_node(x.device):  # reading back costs nothing: the all-finite path
        peak, shadow_peak = magnitude.amax().item(), shadow_magnitude.amax().item()
        if math.isfinite(peak) and math.isfinite(shadow_peak):  # amax propagates nan
            zero_count = zeros.item()
            return [
                float(x.numel()),
                peak,
                zero_count,
                small.sum().item() - zero_count,
                (small & (shadow_magnitude > 0)).sum().item(),
                0.0,
                0.0,
                torch.linalg.vector_norm(x - s).item(),
                torch.linalg.vector_norm(s).item(),
                shadow_peak,
            ]
    finite = magnitude < math.inf  # False for inf and nan
    shadow_finite = shadow_magnitude < math.inf
    both = finite & shadow_finite
    zero = torch.zeros((), device=x.device)
    parts = [
        torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device),
        torch.where(finite, magnitude, zero).amax(),
        zeros,
        small.sum() - zeros,
        (small & (shadow_magnitude > 0) & shadow_finite).sum(),
        (~finite).sum(),
        shadow_finite.sum() - both.sum(),
        torch.linalg.vector_norm(torch.where(both, x - s, zero)),
        torch.linalg.vector_norm(torch.where(shadow_finite, s, zero)),
        torch.where(shadow_finite, shadow_magnitude, zero).amax(),
    ]
    if reads_back_per_node(x.device):
        return [p.item() for p in parts]
    return torch.stack([p.double() for p in parts])


def _flush_stats(x: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor | list[float]:
    """The counts behind :attr:`NumericsRow.flushed`: ``x``'s nonzero elements, and those of
    them that are zero in ``quantized`` (its float8 form). Floats on CPU, else one float64
    tensor on the device, read back with the other statistics at the end."""
    nonzero = x.detach() != 0
    # a float8 zero is the bit pattern 0x00 or 0x80 (-0) in e4m3fn and e5m2, the formats the
    # fp8 ops accept: read as bytes, with no float copy (and no float8 comparison kernel)
    zero = (quantized.detach().view(torch.uint8) & 0x7F) == 0
    counts = torch.stack([nonzero.sum(), (nonzero & zero).sum()])
    if reads_back_per_node(x.device):
        return [float(c) for c in counts.tolist()]
    return counts.double()


def _flushed(counts: Sequence[float]) -> float:
    nonzero, flushed = counts
    return flushed / nonzero if nonzero else 0.0


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _floating(value: Any) -> list[tuple[int, torch.Tensor]]:
    return [
        (i, t) for i, t in enumerate(_tensors(value)) if t.is_floating_point() and t.numel() > 0
    ]


@dataclass
class Measure:
    """Forward (or gradient) statistics of one value, summed over its tensors."""

    dtype: torch.dtype | None
    numel: int = 0
    max_abs: float = 0.0
    zeros: float = 0.0  # fractions of numel
    subnormals: float = 0.0
    underflow: float = 0.0  # zero or subnormal here, nonzero in float32
    nonfinite: int = 0
    new_nonfinite: int = 0  # non-finite here, finite in float32
    rel_error: float = 0.0  # ||x - x32|| / ||x32|| over the finite positions
    shadow_max_abs: float = 0.0

    @classmethod
    def of(cls, dtype: torch.dtype | None, rows: Sequence[Sequence[float]]) -> Measure:
        total = dict.fromkeys(FORWARD_STATS, 0.0)
        for row in rows:
            for name, v in zip(FORWARD_STATS, row, strict=True):
                if name in ("max_abs", "shadow_max_abs"):
                    total[name] = max(total[name], v)
                elif name in ("diff_norm", "shadow_norm"):
                    total[name] += v * v
                else:
                    total[name] += v
        n = max(total["numel"], 1.0)
        diff, norm = math.sqrt(total["diff_norm"]), math.sqrt(total["shadow_norm"])
        if total["new_nonfinite"]:
            rel = math.inf
        elif norm > 0:
            rel = diff / norm
        else:
            rel = 0.0 if diff == 0 else math.inf
        return cls(
            dtype=dtype,
            numel=int(total["numel"]),
            max_abs=total["max_abs"],
            zeros=total["zeros"] / n,
            subnormals=total["subnormals"] / n,
            underflow=total["underflow"] / n,
            nonfinite=int(total["nonfinite"]),
            new_nonfinite=int(total["new_nonfinite"]),
            rel_error=rel,
            shadow_max_abs=total["shadow_max_abs"],
        )


@dataclass
class NumericsRow:
    """One graph node's measurements: ``row.node`` (its name in the graph), ``row.module``
    (the path of the module that ran it), ``row.forward`` (its value against float32),
    with ``backward=True`` ``row.grad`` (the gradient arriving at its output), and for an fp8
    quantization ``row.flushed`` (the share of its input's nonzero values it makes zero)."""

    index: int  # position in the graph
    node: str
    module: str
    op: str
    role: str  # "op", "cast" (amp_graph's), "user_cast", "inplace", "input", ...
    forward: Measure
    grad: Measure | None = None  # backward=True: the gradient arriving at its output
    inputs: tuple[str, ...] = ()  # the nodes it reads (for local-error attribution)
    users: tuple[str, ...] = ()
    # whether a policy decides its dtype: not for a view or a getitem, which take their
    # input's (an override of one changes nothing)
    decided: bool = True
    # the name a node override of its dtype uses: the captured linear's for an fp8 linear
    # (``linear`` for ``linear_fp8``), else ``node``
    override: str = ""
    # an fp8 quantization's: the fraction of its input's nonzero values that are zero in
    # float8 (a scale set by one large value flushes the rest); None for other nodes
    flushed: float | None = None

    @property
    def dtype(self) -> torch.dtype | None:
        return self.forward.dtype

    @property
    def max_abs(self) -> float:
        return self.forward.max_abs

    @property
    def nonfinite(self) -> int:
        return self.forward.nonfinite

    @property
    def rel_error(self) -> float:
        return self.forward.rel_error

    @property
    def zeros(self) -> float:
        return self.forward.zeros

    @property
    def subnormals(self) -> float:
        return self.forward.subnormals


@dataclass
class ParamMeasure:
    """One parameter's gradient, mixed vs float32, at the loss scale."""

    name: str
    module: str
    grad: Measure  # of the scaled gradient: underflow/overflow are at ``scale``


@dataclass
class ShadowResult:
    """What :func:`shadow_run` measured: rows in graph order, parameters (``backward``),
    outputs, and the losses of both runs (``backward``)."""

    nodes: list[NumericsRow]
    params: list[ParamMeasure]
    outputs: list[Measure]  # the model's floating outputs, in order
    dtype: torch.dtype  # the policy's low dtype
    scale: float | None  # the loss scale of the backward run
    graph_module: fx.GraphModule
    loss: float | None = None
    shadow_loss: float | None = None
    output: Any = None  # what the graph returned (the mixed run), detached


def scale_text(scale: float) -> str:
    """A loss scale as people write it: ``2**16``, or ``0.3`` when not a power of two."""
    exponent = math.log2(scale) if scale > 0 else 0.5
    return f"2**{int(exponent)}" if exponent.is_integer() else f"{scale:.3g}"


# ---- the lockstep interpreter -------------------------------------------------------------


def _to_fp32(value: Any) -> Any:
    """The float32 counterpart of an argument: low float dtypes and tensors widened."""
    if isinstance(value, torch.dtype):
        return torch.float32 if value in LOW_FLOATS else value
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in LOW_FLOATS else value
    return value


def _is_random(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    if node.op == "call_method":
        return node.target not in ("to", "size", "view", "reshape", "contiguous", "float")
    if node.op == "call_function":
        return not (
            isinstance(target, torch._ops.OpOverloadPacket)
            or target in (operator.getitem, operator.add, operator.mul)
            or target in (recomputed_cast, recomputed_quantize)
        )
    return node.op == "call_module"


class _RngStates:
    """The global generators' states (CPU and every CUDA device the graph touches)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda and torch.cuda.is_available()

    def get(self) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if self.cuda else None)

    def set(self, state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state_all(state[1])


class _MixedRun(fx.Interpreter):
    """The rewritten graph as it runs: torch.fx's own node execution, with inputs that are
    copies of the leaves (the graph may write them in place; a leaf left out, or ``None``,
    takes the placeholder's default)."""

    def __init__(self, gm: fx.GraphModule, leaves: Iterable[Any]) -> None:
        # run_node never frees a value (only Interpreter.run does): shadow_run frees both
        # runs' values itself, after the node that uses them last has been measured.
        # extra_traceback is left as it is: it too applies only in Interpreter.run, so an
        # op that fails here raises its own error, as it does in the compiled module.
        super().__init__(gm, garbage_collect_values=False)
        self.leaves = iter(leaves)

    def placeholder(self, target: Any, args: tuple, kwargs: dict) -> Any:
        value = next(self.leaves, None)
        if value is None and args:
            value = args[0]
        return value.detach().clone() if isinstance(value, torch.Tensor) else value


class _ShadowRun(_MixedRun):
    """The same graph in float32: every argument widened (:func:`_to_fp32`: a low float
    tensor or dtype becomes float32), except a :func:`shadow_targets` node's, which runs its
    substitute on the node's own dtype arguments."""

    def __init__(self, gm: fx.GraphModule, mixed: _MixedRun, written: bool) -> None:
        # The inputs are the mixed run's copies, each read when the mixed run has made it
        # (the two runs step through the graph in lockstep).
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        super().__init__(gm, (mixed.env[n] for n in placeholders))
        self.written = written

    def placeholder(self, target: Any, args: tuple, kwargs: dict) -> Any:
        value = next(self.leaves)
        wide = _to_fp32(value)
        if self.written and wide is value and isinstance(value, torch.Tensor):
            return value.clone()  # each run writes its own copy
        return wide

    def get_attr(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return _to_fp32(super().get_attr(target, args, kwargs))

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        substitute = shadow_targets().get(target)
        if substitute is not None:
            return substitute(*args, **kwargs)
        if isinstance(target, FunctionCall):  # a custom Function runs under autocast: not here
            target = target.in_float32()
        return super().call_function(target, *_widened(args, kwargs))

    def call_method(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return super().call_method(target, *_widened(args, kwargs))

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return super().call_module(target, *_widened(args, kwargs))


def _widened(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return pytree.tree_map(_to_fp32, (args, kwargs))


@contextlib.contextmanager
def _model_state_kept(gm: fx.GraphModule, written: set[fx.Node]) -> Iterator[None]:
    """Restore every buffer, and every parameter the graph writes (``written``: its written
    storage roots), after the block. The graph reaches all of the model's state."""
    state = {id(t): t for t in gm.buffers()}
    for node in written:
        if node.op == "get_attr":
            tensor = operator.attrgetter(node.target)(gm)
            if isinstance(tensor, torch.Tensor):
                state.setdefault(id(tensor), tensor)
    with tensors_kept(state.values()):
        yield


@contextlib.contextmanager
def tensors_kept(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """Each of ``tensors`` holds, after the block, the values it held before it."""
    saved = [(tensor, tensor.detach().clone()) for tensor in tensors]
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, copy in saved:
                tensor.copy_(copy)


def _role(node: fx.Node) -> str:
    return str(node.meta[AMP].role)


_MEASURED_ROLES = {"op", "cast", "user_cast", "inplace", "input", "param"}


def _measured(node: fx.Node) -> bool:
    return node.op != "output" and _role(node) in _MEASURED_ROLES


SAME_VALUES = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "transpose",
        "permute",
        "t",
        "unsqueeze",
        "squeeze",
        "contiguous",
        "clone",
        "alias",
        "detach",
        "flatten",
        "unflatten",
        "movedim",
    }
)
"""Ops whose output holds exactly their first input's values, rearranged: the statistics
are the same (min, max, fractions, norms), so they are not computed twice."""


def _same_values_as(node: fx.Node) -> fx.Node | None:
    amp = node.meta.get(AMP)
    if amp is None or amp.aten is None or amp.aten.split(".", 1)[0] not in SAME_VALUES:
        return None
    first = node.args[0] if node.args else None
    return first if isinstance(first, fx.Node) else None


def _returns_an_input(value: Any, args: tuple) -> bool:
    return isinstance(value, torch.Tensor) and any(value is a for a in _tensors(args))


def _dtype_of(value: Any) -> torch.dtype | None:
    floats = _floating(value)
    return floats[0][1].dtype if floats else None


def _scalar_loss(output: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.Tensor:
    loss = loss_fn(output) if loss_fn is not None else output
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"backward=True needs a scalar floating loss; the "
            f"{'loss_fn' if loss_fn else 'model'} returned {shape}. Pass "
            "loss_fn=lambda output: ... that reduces the model's output to a scalar"
        )
    return loss.float().reshape(())


def _rows(stats: list[torch.Tensor | list[float]]) -> list[list[float]]:
    """Every statistic as floats (rows of any lengths): the device tensors read back
    together, at the end."""
    on_device = [s for s in stats if isinstance(s, torch.Tensor)]
    read = iter(torch.cat([s.cpu() for s in on_device]).tolist() if on_device else [])
    return [
        [next(read) for _ in range(len(s))] if isinstance(s, torch.Tensor) else s for s in stats
    ]


def _prepare(
    compiled: Any, args: tuple, kwargs: dict
) -> tuple[fx.GraphModule, list[Any], Callable[[Any], Any], nn.Module | None]:
    """The rewritten graph for these inputs, its flat inputs and how to rebuild its output."""
    if isinstance(compiled, CompiledModule):
        captured, leaves = compiled._captured_for(args, kwargs)
        return captured.graph_module, list(leaves), captured.unflatten, compiled.model
    if isinstance(compiled, fx.GraphModule) and isinstance(
        compiled.meta.get(COMPILE_META), CompileRecord
    ):
        return compiled, [*args, *kwargs.values()], lambda out: out, None
    raise TypeError(
        "numerics runs what amp_graph.compile returned (a CompiledModule) or a GraphModule "
        f"rewritten by amp_graph; got {type(compiled).__name__}. Compile the model first: "
        "amp_graph.numerics(amp_graph.compile(model, policy='O3', dtype=torch.float16), x)"
    )


def shadow_run(
    compiled: Any,
    args: tuple,
    kwargs: dict | None = None,
    *,
    backward: bool = False,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    scale: float | None = None,
) -> ShadowResult:
    """Run ``compiled`` on ``args`` and its float32 shadow, measuring every node.

    ``backward=True`` also back-propagates ``loss_fn(output) * scale`` (the output itself
    when it is a scalar) through both, measuring the gradient at every node's output and
    every parameter, without touching ``.grad``. ``scale`` defaults to 2**16 for float16
    (``torch.amp.GradScaler``'s initial scale) and 1 otherwise.
    """
    kwargs = dict(kwargs or {})
    gm, leaves, unflatten, model = _prepare(compiled, tuple(args), kwargs)
    record: CompileRecord = gm.meta[COMPILE_META]
    low = record.dtype
    if scale is None:
        scale = 2.0**16 if low == torch.float16 else 1.0
    scale = float(scale)
    devices = {t.device.type for t in _tensors(leaves)} | {p.device.type for p in gm.parameters()}
    rng = _RngStates(cuda="cuda" in devices)
    start_state = rng.get()
    grad_mode = torch.enable_grad() if backward else torch.no_grad()
    nodes = list(gm.graph.nodes)
    last_use = {n: i for i, node in enumerate(nodes) for n in node.all_input_nodes}
    mixed = _MixedRun(gm, leaves)
    written = written_storage(gm.graph)  # in-place ops: measure every node itself
    shadow = _ShadowRun(gm, mixed, bool(written))
    stats: list[tuple[fx.Node, list[torch.Tensor], torch.dtype | None]] = []
    hooks: list[tuple[fx.Node, Any, Any]] = []  # (node, mixed value, shadow value)
    measured: dict[fx.Node, list] = {}
    flushes: list[tuple[str, torch.Tensor | list[float]]] = []  # (fp8 quantization, counts)
    try:
        with _model_state_kept(gm, written), grad_mode:
            for i, node in enumerate(nodes):
                if _is_random(node):  # the shadow draws the numbers the mixed run drew
                    state = rng.get()
                    mixed.env[node] = mixed.run_node(node)
                    rng.set(state)
                else:
                    mixed.env[node] = mixed.run_node(node)
                shadow.env[node] = shadow.run_node(node)
                m_value, s_value = mixed.env[node], shadow.env[node]
                m_inputs = [mixed.env[n] for n in node.all_input_nodes]
                s_inputs = [shadow.env[n] for n in node.all_input_nodes]
                if _returns_an_input(s_value, s_inputs) and not _returns_an_input(
                    m_value, m_inputs
                ):  # `.float()` of a float32 tensor is the tensor: copy as the mixed run did
                    s_value = shadow.env[node] = s_value.clone()
                if _measured(node):
                    m_floats = _floating(m_value)
                    source = _same_values_as(node) if not written else None
                    if source is not None and source in measured:
                        node_stats = measured[source]  # a view or copy: its input's numbers
                    else:
                        s_all = _tensors(s_value)
                        node_stats = [_stats(t, s_all[j]) for j, t in m_floats if j < len(s_all)]
                    measured[node] = node_stats
                    stats.append((node, node_stats, _dtype_of(m_value)))
                    if node.target in quantize_targets():
                        x = mixed.env[node.args[0]]  # type: ignore[index]
                        flushes.append((node.name, _flush_stats(x, m_value)))
                    if backward and m_floats and node.op != "get_attr":
                        # parameters: their gradients are measured as ``params``
                        hooks.append((node, m_value, s_value))
                if not backward:
                    for arg in node.all_input_nodes:
                        if last_use.get(arg) == i and arg.op != "get_attr":
                            mixed.env.pop(arg, None)
                            shadow.env.pop(arg, None)
            (output_node,) = gm.graph.find_nodes(op="output")
            output, shadow_output = mixed.env[output_node], shadow.env[output_node]
            out = unflatten(output)
            shadow_out = unflatten(shadow_output)
            output_stats = [
                _stats(t, s)
                for t, s in zip(_tensors(out), _tensors(shadow_out), strict=False)
                if t.is_floating_point() and t.numel() > 0
            ]
            losses: dict[str, float] = {}
            grads = None
            if backward:
                grads = _backward(gm, model, out, shadow_out, hooks, loss_fn, scale, low)
                losses = grads.pop("losses")
    finally:
        rng.set(start_state)
    names = {n: n.name for n in nodes}
    flat = [s for _, node_stats, _ in stats for s in node_stats]
    grad_flat = [s for s in (grads or {}).get("node_stats", {}).values() for s in s]
    param_flat = [s for _, s in (grads or {}).get("param_stats", [])]
    flush_flat = [counts for _, counts in flushes]
    values = iter(_rows(flat + grad_flat + param_flat + output_stats + flush_flat))
    measures: list[NumericsRow] = []
    for index, (node, node_stats, dtype) in enumerate(stats):
        rows = [next(values) for _ in node_stats]
        measures.append(
            NumericsRow(
                index=index,
                node=node.name,
                module=node.meta[AMP].module_path,
                op=node.meta[AMP].op,
                role=_role(node),
                forward=Measure.of(dtype, rows),
                inputs=tuple(names[a] for a in inputs_behind_reads(node)),
                users=tuple(names[u] for u in users_through_reads(node)),
                decided=node.meta[AMP].source != "fixed",
                override=node.meta.get(FP8_OF, node.name),
            )
        )
    by_name = {m.node: m for m in measures}
    if grads is not None:
        for name, node_stats in grads["node_stats"].items():
            rows = [next(values) for _ in node_stats]
            by_name[name].grad = Measure.of(grads["node_dtypes"][name], rows)
    params = []
    for name, _ in (grads or {}).get("param_stats", []):
        module = name.rsplit(".", 1)[0] if "." in name else ""
        params.append(ParamMeasure(name, module, Measure.of(low, [next(values)])))
    outputs = [Measure.of(None, [next(values)]) for _ in output_stats]
    for name, _ in flushes:
        by_name[name].flushed = _flushed(next(values))
    return ShadowResult(
        nodes=measures,
        params=params,
        outputs=outputs,
        dtype=low,
        scale=scale if backward else None,
        graph_module=gm,
        loss=losses.get("loss"),
        shadow_loss=losses.get("shadow_loss"),
        output=pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out),
    )


def _named_parameters(
    gm: fx.GraphModule, model: nn.Module | None
) -> list[tuple[str, nn.Parameter]]:
    owner = model if model is not None else gm
    return [(n, p) for n, p in owner.named_parameters() if p.requires_grad]


def _backward(
    gm: fx.GraphModule,
    model: nn.Module | None,
    out: Any,
    shadow_out: Any,
    hooks: list[tuple[fx.Node, Any, Any]],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    scale: float,
    low: torch.dtype,
) -> dict[str, Any]:
    """Gradients of both runs at every node output and parameter, compared; ``.grad`` is
    never written (``torch.autograd.grad``)."""
    loss = _scalar_loss(out, loss_fn)
    shadow_loss = _scalar_loss(shadow_out, loss_fn)
    params = _named_parameters(gm, model)
    tensors = [p for _, p in params]
    shadow_grads: dict[tuple[str, int], torch.Tensor] = {}
    node_stats: dict[str, list[torch.Tensor]] = {}
    node_dtypes: dict[str, torch.dtype | None] = {}
    handles = []

    def keep_shadow(key: tuple[str, int]) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            shadow_grads[key] = shadow_grads[key] + grad if key in shadow_grads else grad.detach()

        return hook

    def compare(key: tuple[str, int]) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            reference = shadow_grads.get(key)
            if reference is None:
                reference = torch.zeros_like(grad, dtype=torch.float32)
            node_stats.setdefault(key[0], []).append(_stats(grad, reference))
            node_dtypes.setdefault(key[0], grad.dtype)

        return hook

    for node, m_value, s_value in hooks:
        s_all = _tensors(s_value)
        for j, t in _floating(m_value):
            if t.requires_grad and j < len(s_all) and s_all[j].requires_grad:
                handles.append(s_all[j].register_hook(keep_shadow((node.name, j))))
                handles.append(t.register_hook(compare((node.name, j))))
    try:
        shadow_param_grads = _grads(shadow_loss * scale, tensors)
        mixed_param_grads = _grads(loss * scale, tensors)
    finally:
        for handle in handles:
            handle.remove()
    param_stats = []
    for (name, p), m, s in zip(params, mixed_param_grads, shadow_param_grads, strict=True):
        if m is None and s is None:
            continue
        m = torch.zeros_like(p, dtype=torch.float32) if m is None else m
        s = torch.zeros_like(p, dtype=torch.float32) if s is None else s
        # float32 gradients that came through low-precision ops: judged in ``low``'s range
        param_stats.append((name, _stats(m, s, range_of=low)))
    return {
        "node_stats": node_stats,
        "node_dtypes": node_dtypes,
        "param_stats": param_stats,
        "losses": {"loss": loss.item(), "shadow_loss": shadow_loss.item()},
    }


def _grads(loss: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor | None]:
    if not loss.requires_grad:
        return [None] * len(tensors)
    return list(torch.autograd.grad(loss, tensors, allow_unused=True))
