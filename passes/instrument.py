"""Pass instrument: a copy of a rewritten graph that measures the chosen nodes' tensors.

For each node the caller selects, the copy measures, with the graph ops of
:mod:`amp_graph.ops.tensor_stats`:

* forward: each tensor operand (its schema name: ``input``, ``weight``, ``mat2``; a bias or
  an additive ``self`` is skipped) and the output. An operand that reaches the op through a
  cast amp_graph inserted is measured *before* the cast, against the dtype the op runs in,
  so ``underflow`` counts what the cast loses. An fp8 operand is measured against its
  float8 format at the quantization's scale;
* backward: the gradient of the output (``grad_output``) and of each operand read from a
  parameter (``grad_weight``), as backward computes them, by tensor hooks the forward
  registers.

Reads: ``meta["amp"]`` (role, module path, which casts are amp_graph's), ``meta["val"]``.
Writes: a new GraphModule over a copy of the graph (and of each activation-checkpoint region
it calls, instrumented alike), sharing every parameter, buffer and other submodule with the
input; the probes' nodes carry ``meta["amp"]`` with ``role=RUNTIME``. Guarantees: the input
GraphModule is not modified; the copy computes the same values (a probe returns nothing and
changes nothing); row ``i`` of the sink's buffer is ``probes[i]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from amp_graph.ops.recompute_ops import recomputed_quantize
from amp_graph.ops.tensor_stats import STATS, StatsSink, record_grad_stats, record_stats

from .graph_copy import copy_graph_module
from .meta import AMP, VAL, AmpInfo, Role, is_dtype_cast, short

SINK_ATTR = "amp_monitor"

# operands that are no operand of the product: measured nowhere
_SKIPPED = {"bias"}
_ADDITIVE_SELF = {"aten::addmm", "aten::baddbmm", "aten::addbmm", "aten::addmv"}
# fp8 operand -> (its quantized form, its scale): measured in that format at that scale
_FP8_OPERANDS: dict[str, dict[str, tuple[str, str]]] = {
    "amp_graph::fp8_linear": {"x": ("x_fp8", "x_scale"), "weight": ("w_fp8", "w_scale")},
}
_ROLE_NAMES = {"self": "input", "x": "input"}


@dataclass(frozen=True)
class Probe:
    """One measured tensor: row ``i`` of the buffer is ``probes[i]``."""

    node: str  # the measured op's node name
    graph: str  # "" for the graph itself, else the checkpoint region submodule holding it
    op: str  # the op ("aten.linear.default")
    module: str  # its module path
    role: str  # "input", "weight", "output", "grad_output", "grad_weight", ...
    dtype: torch.dtype  # the measured tensor's dtype (forward) or its value's (backward)
    run_dtype: torch.dtype  # what "underflow" is counted against
    weight: bool  # read from a parameter
    backward: bool  # a gradient
    # the node's place in the forward: (its index in the graph,), or, inside a checkpoint
    # region, (the index of the region's call, its index in the region)
    position: tuple[int, ...] = ()

    @property
    def where(self) -> str:
        """The node's name, prefixed by its checkpoint region's (``checkpoint_0.linear``)."""
        return f"{self.graph}.{self.node}" if self.graph else self.node


@dataclass
class InstrumentResult:
    graph_module: fx.GraphModule
    probes: tuple[Probe, ...]
    sink: StatsSink


def _schema_name(node: fx.Node) -> str:
    target = node.target
    return target._schema.name if isinstance(target, torch._ops.OpOverload) else str(target)


def _arg_names(node: fx.Node) -> list[str]:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return [a.name for a in target._schema.arguments]
    return [f"arg{i}" for i in range(len(node.args))]


def _floating(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point


def _dtype_of(node: fx.Node) -> torch.dtype | None:
    """The floating dtype of ``node``'s value, or None. amp_graph's casts carry no example
    value: theirs is the dtype they cast to."""
    if is_dtype_cast(node):
        source = node.args[0]
        floating = isinstance(source, fx.Node) and _floating(source.meta.get(VAL))
        return node.args[1] if floating else None
    value = node.meta.get(VAL)
    if value is None:  # a node the passes made after the capture: its planned dtype
        planned = node.meta[AMP].out_dtype if AMP in node.meta else None
        return planned if isinstance(planned, torch.dtype) and planned.is_floating_point else None
    return value.dtype if _floating(value) else None


def _reads_parameter(node: fx.Node) -> bool:
    """Whether ``node`` is a parameter or buffer, or amp_graph's cast of one."""
    while is_dtype_cast(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    amp = node.meta.get(AMP)
    return amp is not None and amp.role is Role.PARAM


class _Instrumenter:
    """Inserts the probes of one graph; each probe's row is its index in ``probes``, which
    the graphs of one instrumentation share (a region's rows follow its caller's)."""

    def __init__(
        self, graph_name: str, probes: list[Probe], positions: dict[str, tuple[int, ...]]
    ) -> None:
        self.graph_name = graph_name
        self.probes = probes
        self.positions = positions  # node name -> Probe.position

    def instrument(self, graph: fx.Graph, selected: Callable[[fx.Node], bool]) -> None:
        chosen = [n for n in graph.nodes if n.op == "call_function" and selected(n)]
        if not chosen:
            return
        first = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first):
            # a plain attribute, not a module or tensor: create_node, as get_attr would warn
            sink = graph.create_node("get_attr", SINK_ATTR)
        sink.meta[AMP] = AmpInfo.fixed(Role.RUNTIME, "get_attr", "the monitor's statistics sink")
        for node in chosen:
            self._probe_node(graph, node, sink)

    def _probe(
        self,
        graph: fx.Graph,
        node: fx.Node,
        sink: fx.Node,
        value: fx.Node,
        role: str,
        run_dtype: torch.dtype,
        *,
        weight: bool = False,
        scale: fx.Node | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """One probe of ``node``: ``value``'s statistics (forward), or with a ``grad_`` role
        those of its gradient (a hook the forward registers), at the insertion point."""
        amp = node.meta.get(AMP)
        backward = role.startswith("grad_")
        self.probes.append(
            Probe(
                node=node.name,
                graph=self.graph_name,
                op=amp.op if amp is not None and amp.op else str(node.target),
                module=amp.module_path if amp is not None else "",
                role=role,
                dtype=dtype or _dtype_of(value),  # type: ignore[arg-type]
                run_dtype=run_dtype,
                weight=weight,
                backward=backward,
                position=self.positions.get(node.name, ()),
            )
        )
        row = len(self.probes) - 1
        fn, args = (
            (record_grad_stats, (value, sink, row))
            if backward
            else (record_stats, (value, sink, row, run_dtype, scale))
        )
        call = graph.create_node("call_function", fn, args, {}, name=f"stats_{node.name}_{role}")
        call.meta[AMP] = AmpInfo.fixed(Role.RUNTIME, fn.__name__, "the monitor's probe")

    def _probe_quantize(self, graph: fx.Graph, node: fx.Node, sink: fx.Node) -> None:
        """``(x, scale, dtype)``: x in ``dtype`` at ``scale``, and the float8 result (which
        needs no gradient: a quantization is detached)."""
        x, scale, dtype = node.args[:3]
        weight = _reads_parameter(x)
        with graph.inserting_before(node):
            role = "weight" if weight else "input"
            self._probe(graph, node, sink, x, role, dtype, weight=weight, scale=scale)
        with graph.inserting_after(node):
            self._probe(graph, node, sink, node, "output", dtype, dtype=dtype)

    def _probe_node(self, graph: fx.Graph, node: fx.Node, sink: fx.Node) -> None:
        schema = _schema_name(node)
        if schema == "amp_graph::fp8_quantize" or node.target is recomputed_quantize:
            self._probe_quantize(graph, node, sink)
            return
        named = dict(zip(_arg_names(node), node.args, strict=False))
        named.update(node.kwargs)
        fp8 = _FP8_OPERANDS.get(schema, {})
        with graph.inserting_before(node):
            for arg_name, arg in named.items():
                if arg_name in _SKIPPED or (arg_name == "self" and schema in _ADDITIVE_SELF):
                    continue
                if not isinstance(arg, fx.Node) or _dtype_of(arg) is None:
                    continue
                if any(arg_name in pair for pair in fp8.values()):
                    continue  # the quantized form and scale of an operand measured below
                role = _ROLE_NAMES.get(arg_name, arg_name)
                weight = _reads_parameter(arg)
                measured, run_dtype, scale = arg, _dtype_of(arg), None
                if arg_name in fp8:
                    quantized, scale_name = fp8[arg_name]
                    scale, run_dtype = named[scale_name], _dtype_of(named[quantized])
                elif is_dtype_cast(arg):
                    measured = arg.args[0]
                assert run_dtype is not None
                self._probe(
                    graph, node, sink, measured, role, run_dtype, weight=weight, scale=scale
                )
                if weight:  # the gradient of the operand as the op reads it: its dtype
                    grad_dtype = _dtype_of(arg)
                    assert grad_dtype is not None
                    self._probe(graph, node, sink, arg, f"grad_{role}", grad_dtype, weight=True)
        out = node.meta.get(VAL)
        if not _floating(out):
            return
        with graph.inserting_after(node):  # each goes right after the node: last made first
            self._probe(graph, node, sink, node, "grad_output", out.dtype)
        with graph.inserting_after(node):
            self._probe(graph, node, sink, node, "output", out.dtype)


def region_graphs(gm: fx.GraphModule) -> list[str]:
    """The activation-checkpoint regions ``gm`` calls (``passes.checkpoints``' submodules)."""
    return [
        name
        for name, child in gm.named_children()
        if name.startswith("checkpoint_") and isinstance(child, fx.GraphModule)
    ]


def instrument(
    gm: fx.GraphModule,
    selected: Callable[[fx.Node], bool],
    columns: frozenset[int] | None = None,
) -> InstrumentResult:
    """The instrumented copy of ``gm`` (see the module), measuring the nodes ``selected``
    returns True for (in ``gm`` and in its checkpoint regions), computing the
    :data:`~amp_graph.ops.tensor_stats.STATS` columns ``columns`` (all by default).

    >>> import torch, amp_graph
    >>> from amp_graph.passes.instrument import instrument
    >>> c = amp_graph.compile(torch.nn.Linear(2, 2), policy="O1", dtype=torch.bfloat16)
    >>> gm = c.capture(torch.randn(3, 2))
    >>> result = instrument(gm, lambda n: n.name == "linear")
    >>> [p.role for p in result.probes]
    ['input', 'weight', 'grad_weight', 'grad_output', 'output']
    """
    columns = frozenset(range(len(STATS))) if columns is None else columns
    sink = StatsSink(0, columns)
    probes: list[Probe] = []
    copied = copy_graph_module(gm)
    setattr(copied, SINK_ATTR, sink)
    nodes = list(gm.graph.nodes)
    positions = {node.name: (i,) for i, node in enumerate(nodes)}
    calls = {node.target: i for i, node in enumerate(nodes) if node.op == "call_module"}
    _Instrumenter("", probes, positions).instrument(copied.graph, selected)
    instrumented = [copied]
    for name in region_graphs(gm):
        region = copy_graph_module(getattr(gm, name))
        setattr(region, SINK_ATTR, sink)
        before = len(probes)
        call = calls.get(name, len(nodes))
        inside = {n.name: (call, j) for j, n in enumerate(region.graph.nodes)}
        _Instrumenter(name, probes, inside).instrument(region.graph, selected)
        if len(probes) > before:
            setattr(copied, name, region)
            instrumented.append(region)
    sink.rows = len(probes)
    for module in instrumented:
        module.graph.lint()
        module.recompile()
    return InstrumentResult(copied, tuple(probes), sink)


def computed_order(probes: Sequence[Probe]) -> list[int]:
    """The probes' indices in the order a step computes what they measure: every forward
    probe in graph order (a node's operands, then its output), then the backward probes
    node by node in reverse graph order, as autograd runs a backward (a node's output
    gradient arrives before the gradients its backward computes)."""

    def key(i: int) -> tuple:
        probe = probes[i]
        if not probe.backward:
            return (0, probe.position, probe.role == "output")
        return (1, tuple(-p for p in probe.position), probe.role != "grad_output")

    return sorted(range(len(probes)), key=key)


def describe(probe: Probe) -> str:
    """``linear (mlp.fc1) weight bf16 -> e4m3``, for messages."""
    where = f" ({probe.module})" if probe.module else ""
    run = f" in {short(probe.run_dtype)}" if probe.run_dtype != probe.dtype else ""
    return f"{probe.node}{where} {probe.role} {short(probe.dtype)}{run}"
