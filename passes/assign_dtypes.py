"""assign_dtypes: decide what every node computes in and what it returns.

This is torch.autocast's per-op logic, run once over the graph instead of at every call:

* ``ALLOW``: floating inputs are cast to the low-precision dtype;
* ``DENY``: floating inputs are cast to float32;
* ``PROMOTE``: floating inputs are cast to the widest floating input dtype (autocast's
  ``prioritize``: float32 if any input is float32, else the low dtype);
* ``FOLLOW``: no casts; torch's type promotion decides.

float64, integer and bool tensors are never cast (autocast's eligibility rule). With
policies whose default is ``ALLOW`` (O2, O3), a value the model itself cast to float32
(``x.float()`` in an RMSNorm) stays float32 until the model casts again: ops that read
it compute in float32, as they would in Apex O2, and so do values the forward makes from
integers (a sinusoidal timestep encoding; see :mod:`amp_graph.passes.float32_islands`).

Output dtypes come from fake values: every node of the captured graph has one in
``meta["val"]``, so torch computes them. The capture under the policy computed each value
at the dtypes the plan gives and recorded the decision (``meta[CAPTURE_PLAN]``, see
:mod:`amp_graph.capture.planned_dtypes`): where this pass decides the same for a node, on inputs of
the same dtypes, the captured value is the node's. Only nodes whose inputs the plan changed
(a model captured without the policy, the backend's graphs, a policy the capture did not
see) run on fake tensors. A node whose fake run fails is an error naming it (only a call
that returns no tensor, ``aten.item`` on data, may fail: it has no dtype to decide).

Reads: ``meta["amp"]`` (role, rule, source), ``meta["val"]``, ``meta[CAPTURE_PLAN]``. Writes:
``meta["amp"].compute_dtype``, ``.out_dtype``, ``.exact``, ``.detail`` (when a float32
rule changes a decision), and ``meta["val"]`` (fake values under the plan). The graph is
not changed.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from amp_graph.ops.dtensors import is_dtensor
from amp_graph.policy import Rule, autocast_tables, base_name

from . import schema
from .float32_islands import Float32Islands, effective_rule, track_islands
from .meta import (
    AMP,
    CAPTURE_PLAN,
    FSDP_GATHERED_DTYPE,
    LOW_PRECISION,
    NOT_TENSOR,
    STORED_DTYPE,
    UNKNOWN,
    VAL,
    AmpInfo,
    DtypeFact,
    Role,
    cast_fact,
    is_cast_read,
    is_castable,
    tensor_facts,
)
from .result import PassResult

log = logging.getLogger(__name__)

# Every op name any autocast list mentions (CPU or CUDA): their captured values may carry
# autocast's casts.
_AUTOCAST_LISTED: frozenset[str] = frozenset().union(
    *autocast_tables("cpu"), *autocast_tables("cuda")
)


def fact(value: Any) -> DtypeFact:
    """The dtype fact of an environment value (fake tensor or Python value)."""
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, list):
        return [fact(v) for v in value]
    if isinstance(value, tuple):  # also torch.Size and named tuples: facts are plain tuples
        return tuple(fact(v) for v in value)
    if isinstance(value, dict):
        return {k: fact(v) for k, v in value.items()}
    return NOT_TENSOR


def promote_dtype(facts: list[DtypeFact], low: torch.dtype) -> torch.dtype | None:
    """autocast's ``prioritize``: float32 wins over low precision; float64 is ignored.

    None when there is nothing to cast, or when an input whose dtype is not known yet
    (``UNKNOWN``, at capture) could still decide.
    """
    castable = [f for f in facts if is_castable(f)]
    if any(f == torch.float32 for f in castable):
        return torch.float32  # whatever the unknown ones are
    if any(f is UNKNOWN for f in facts) or not castable:
        return None
    return torch.float32 if any(f != low for f in castable) else low


def compute_dtype_for(rule: Rule, facts: list[DtypeFact], low: torch.dtype) -> torch.dtype | None:
    """The dtype floating inputs are cast to under ``rule``; None means no casts."""
    if not any(f is UNKNOWN or is_castable(f) for f in facts):
        return None
    if rule is Rule.ALLOW:
        return low
    if rule is Rule.DENY:
        return torch.float32
    if rule is Rule.PROMOTE:
        return promote_dtype(facts, low)
    return None


def read_dtypes(facts: tuple[DtypeFact, ...], compute: torch.dtype | None) -> tuple:
    """The dtypes an op reads its inputs at: cast to ``compute`` where it casts them. With
    the op and ``compute``, what ``meta[CAPTURE_PLAN]`` records of a capture's decision."""
    return facts if compute is None else tuple(cast_fact(f, compute) for f in facts)


def cast_value(value: Any, dtype: torch.dtype) -> Any:
    """Apply a planned cast to an environment value: autocast's eligibility, then .to()."""
    if isinstance(value, torch.Tensor):
        return (
            value.to(dtype)
            if value.dtype in (torch.float16, torch.bfloat16, torch.float32)
            else value
        )
    if isinstance(value, (tuple, list)):
        return type(value)(cast_value(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_value(v, dtype) for k, v in value.items()}
    return value


class FakeRunError(RuntimeError):
    """A node could not run on fake values, so its output dtype is unknown."""


class _Planner(fx.Interpreter):
    """Walks the graph once, deciding dtypes and propagating fake values under the plan.

    A ``torch.fx.Interpreter``: its ``run`` walks the nodes with their environment, and the
    op methods run each node (``call_function`` for aten ops and the capture's Python calls,
    ``call_method`` for the casts insert_casts writes). :meth:`run_node` adds the plan
    around that: the node's compute dtype from its inputs' dtype facts, and a value for it.
    ``FakeTensorProp`` is not the base: it runs every node and writes every value, and the
    point here is to run only the nodes whose inputs the plan changed. A node whose
    decision is the one the capture made (``meta[CAPTURE_PLAN]``) has its value already:
    the capture computed it on inputs of these dtypes, cast alike.
    """

    def __init__(
        self, gm: fx.GraphModule, low: torch.dtype, cast_inputs: bool, plan: bool = True
    ) -> None:
        super().__init__(gm, garbage_collect_values=False)
        # A failed fake run is a FakeRunError naming the node: no second message around it.
        self.extra_traceback = False
        # plan=False only propagates: no decisions, no casts, nothing written to the graph,
        # and no capture value reused unless the node runs as captured (the verifier's
        # independent check of the plan).
        self.gm, self.low, self.cast_inputs, self.plan = gm, low, cast_inputs, plan
        self.facts: dict[fx.Node, DtypeFact] = {}
        self.islands = Float32Islands()
        self.changed = 0
        self.fake_mode = self._fake_mode()
        self.casts: dict[tuple[int, torch.dtype], tuple[Any, Any]] = {}
        # Inputs written in place (directly or through a view) are never cast at entry: the
        # write must reach the caller's tensor, not a copy.
        self.written = schema.written_storage(gm.graph) if plan and cast_inputs else set()
        self._node: fx.Node | None = None  # the node being run, and its record
        self._amp: AmpInfo | None = None

    def _fake_mode(self) -> Any:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        for node in placeholders:
            if VAL not in node.meta:
                raise TypeError(
                    f"assign_dtypes needs an example value on every graph input; "
                    f"{node.name!r} has no meta['val']: capture the model with amp_graph"
                )
        vals = [n.meta[VAL] for n in placeholders]
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

        fakes = [v for v in vals if isinstance(v, FakeTensor)]
        if fakes:  # the mode the example values live in; an active TracingContext may hold another
            return fakes[0].fake_mode
        detected = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
        return detected or FakeTensorMode(allow_non_fake_inputs=True)

    def fake(
        self, tensor: torch.Tensor, captured: Any = None, read_as: torch.dtype | None = None
    ) -> Any:
        """A fake of a graph attribute: its captured value where that still describes it.
        ``read_as``: the dtype the graph reads it in, where not its own (an FSDP2 shard
        its unit all-gathers in its ``param_dtype``; an O2 low copy the plan stores in
        float32, :mod:`amp_graph.passes.widen_parameters`)."""
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(tensor, FakeTensor):
            return tensor
        dtype = read_as or tensor.dtype
        if (
            isinstance(captured, FakeTensor)
            and captured.fake_mode is self.fake_mode
            and captured.shape == tensor.shape
            and captured.device == tensor.device
        ):
            if captured.dtype == dtype:
                return captured
            # O2/O3: the capture saw the parameter low; a new fake of its own dtype costs
            # half of a conversion of the tensor
            with self.fake_mode:
                return torch.empty_strided(
                    tensor.shape,
                    tensor.stride(),
                    dtype=dtype,
                    device=tensor.device,
                    requires_grad=tensor.requires_grad,
                )
        if is_dtensor(captured):  # tensor parallel: the graph reads the DTensor itself
            fake = captured
            if getattr(captured._local_tensor, "fake_mode", None) is not self.fake_mode:
                # FSDP2 over tensor parallelism captures its units unsharded: the captured
                # value, not the resharded parameter, describes what the graph reads
                fake = self.fake_mode.from_tensor(captured, static_shapes=True)
            if fake.dtype == dtype:
                return fake
            with self.fake_mode:
                return fake.to(dtype)
        if is_dtensor(tensor):  # an FSDP2 shard: the graph reads it gathered (fsdp_hooks)
            with self.fake_mode:
                return torch.empty(tensor.shape, dtype=dtype, device=tensor.device)
        return self.fake_mode.from_tensor(tensor, static_shapes=True)

    def plan_graph(self) -> int:
        """Run the whole graph; the number of nodes whose plan was written."""
        self.run(enable_io_processing=False)
        return self.changed

    # --- one node -------------------------------------------------------------------------

    def run_node(self, node: fx.Node) -> Any:
        amp: AmpInfo = node.meta[AMP] if self.plan else _scratch(node)
        self._node, self._amp = node, amp
        if node.op in ("placeholder", "get_attr", "output"):
            value = super().run_node(node)
        elif is_cast_read(node):  # a consumer's read of a shared cast: that cast
            value = self.env[node.args[1]]
        elif amp.role is Role.RUNTIME:  # added after the passes: nothing to plan
            value = None
        else:
            value = self._planned_call(node, amp)
        self.facts[node] = fact(value)
        if self.plan:
            amp.exact = True
            if node.op == "placeholder":  # its own dtype; an entry cast carries the planned one
                amp.out_dtype = fact(node.meta[VAL])
            else:
                amp.out_dtype = self.facts[node]
                if node.op != "output":
                    node.meta[VAL] = value
                self.changed += 1
        return value

    def _planned_call(self, node: fx.Node, amp: AmpInfo) -> Any:
        """Decide the node's compute dtype, then its value: the captured one where the
        capture decided alike, else the node run on fake inputs cast as planned."""
        compute = None
        facts: list[DtypeFact] = []
        if self.plan:
            facts = tensor_facts(
                map_aggregate(
                    (node.args, node.kwargs),
                    lambda a: self.facts[a] if isinstance(a, fx.Node) else fact(a),
                )
            )
            rule = effective_rule(node, amp, self.islands, self.facts)
            low = amp.low_dtype or self.low
            compute = compute_dtype_for(rule, facts, low) if amp.role is Role.OP else None
            amp.compute_dtype = compute
        captured = node.meta.get(VAL)
        if self.plan and captured is not None and self._as_captured(node, compute):
            out = captured
        else:
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            if compute is not None:
                args, kwargs = self._cast((args, kwargs), compute)
            out = self._evaluate(node, amp, args, kwargs)
            if self.plan:  # meta["val"] becomes this value: no longer the capture's
                node.meta.pop(CAPTURE_PLAN, None)
        if self.plan:
            track_islands(node, amp, facts, fact(out), self.islands, self.facts)
        return out

    def _as_captured(self, node: fx.Node, compute: torch.dtype | None) -> bool:
        """The capture computed the node's value with this compute dtype, on inputs it read
        at the dtypes this plan gives them (after the cast to ``compute``)."""
        record = node.meta.get(CAPTURE_PLAN)
        if record is None or record[0] is not node.target or record[1] != compute:
            return False  # another op: a pass changed it, or the name went to another node
        return record[2] == read_dtypes(tuple(self.facts[a] for a in node.all_input_nodes), compute)

    def _evaluate(self, node: fx.Node, amp: AmpInfo, args: tuple, kwargs: dict) -> Any:
        captured = node.meta.get(VAL)
        if _reuses_captured_value(node) and _same_dtypes_as(captured, (args, kwargs)):
            return captured
        try:
            with self.fake_mode:
                return getattr(self, node.op)(node.target, args, kwargs)
        except Exception as error:
            if amp.role is Role.OTHER:  # returns no tensor (aten.item on data): no dtype
                log.debug("no fake value for %s (%s): %s", node.name, node.target, error)
                return None
            raise FakeRunError(
                f"assign_dtypes: running node {node.name!r} ({node.target}) on fake values "
                f"failed, so its output dtype is unknown: {type(error).__name__}: {error}"
            ) from error

    def _cast(self, value: Any, dtype: torch.dtype) -> Any:
        """:func:`cast_value`, each (value, dtype) faked once: a value several consumers cast
        alike (q, k and v reading one layer norm) costs one fake cast."""

        def one(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return cast_value(v, dtype)
            key = (id(v), dtype)
            if key not in self.casts:
                # in the fake mode: DTensor propagates the sharding of a value with symbolic
                # sizes uncached only while it sees a fake mode (a SymInt is not hashable)
                with self.fake_mode:
                    cast = cast_value(v, dtype)
                self.casts[key] = (v, cast)  # v kept alive: ids stay unique
            return self.casts[key][1]

        return map_aggregate(value, one)

    # --- the op methods fx.Interpreter dispatches to ----------------------------------------

    def placeholder(self, target: Any, args: tuple, kwargs: dict) -> Any:
        node, amp = self._current_node(), self._amp
        assert amp is not None
        value = node.meta[VAL]
        entry_cast = self.plan and self.cast_inputs and amp.role is Role.INPUT  # not model state
        if entry_cast and node in self.written:
            amp.detail = (
                "a graph input the model writes in place: not cast at entry, so that the "
                "write reaches the caller's tensor (its consumers cast it)"
            )
        elif entry_cast and is_castable(fact(value)):
            amp.compute_dtype = self.low
            amp.detail = "a graph input, cast to low precision at entry (policy cast_inputs)"
            with self.fake_mode:  # (as in _cast)
                value = cast_value(value, self.low)
        return value

    def get_attr(self, target: Any, args: tuple, kwargs: dict) -> Any:
        attr = self.fetch_attr(target)
        if not isinstance(attr, torch.Tensor):
            return attr
        meta = self._current_node().meta
        read_as = meta.get(FSDP_GATHERED_DTYPE) or meta.get(STORED_DTYPE)
        return self.fake(attr, meta.get(VAL), read_as)

    def _current_node(self) -> fx.Node:
        assert self._node is not None
        return self._node


def _same_dtypes_as(captured: Any, inputs: Any) -> bool:
    """Every tensor input has the dtype of the captured value: a view, or a pointwise op of
    inputs all of one dtype, then computes that value again."""
    tensors = _tensors(inputs)
    return (
        isinstance(captured, torch.Tensor)
        and bool(tensors)
        and all(t.dtype == captured.dtype for t in tensors)
    )


def _tensors(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_aggregate(tree, lambda v: found.append(v) if isinstance(v, torch.Tensor) else v)
    return found


def _reuses_captured_value(node: fx.Node) -> bool:
    """Views, and pointwise ops that no autocast list names (so capture under autocast
    computed them as written): given inputs of their captured value's dtype, they compute
    that value again."""
    op = schema.overload(node)
    if op is None:
        return False
    if schema.is_view(node):
        return True
    return torch.Tag.pointwise in op.tags and base_name(op.__name__) not in _AUTOCAST_LISTED


def _scratch(node: fx.Node) -> AmpInfo:
    """A throwaway copy of the node's record, so that propagation never writes to the graph."""
    return copy.copy(node.meta[AMP])


def propagate_dtypes(gm: fx.GraphModule) -> dict[fx.Node, DtypeFact]:
    """Each node's output dtype when the graph runs as written (no plan applied).

    The verifier compares these with the plan's ``out_dtype``.
    """
    planner = _Planner(gm, torch.bfloat16, cast_inputs=False, plan=False)
    planner.plan_graph()
    return planner.facts


def assign_dtypes(
    gm: fx.GraphModule, low_dtype: torch.dtype, cast_inputs: bool = False
) -> PassResult:
    """Decide ``compute_dtype`` and ``out_dtype`` for every node (see the module docstring).

    >>> import torch, amp_graph
    >>> from amp_graph.capture import capture_module
    >>> from amp_graph.passes.classify import classify
    >>> model = torch.nn.Sequential(torch.nn.Softmax(-1))
    >>> gm = capture_module(model, (torch.randn(2, 3),), {}, device_type="cpu",
    ...                     autocast_dtype=torch.float16).graph_module
    >>> _ = classify(gm, amp_graph.Policy.preset("O1"))
    >>> _ = assign_dtypes(gm, torch.float16)
    >>> [n.meta["amp"].compute_dtype for n in gm.graph.nodes if n.name == "softmax"]
    [torch.float32]
    """
    if low_dtype not in LOW_PRECISION:
        raise ValueError(f"low_dtype is torch.float16 or torch.bfloat16, not {low_dtype}")
    _Planner(gm, low_dtype, cast_inputs).plan_graph()
    exact = all(n.meta[AMP].exact for n in gm.graph.nodes if n.op == "placeholder")
    return PassResult(gm, modified=False, stats={"exact_dtypes": int(exact)})


__all__ = [
    "FakeRunError",
    "assign_dtypes",
    "cast_value",
    "compute_dtype_for",
    "fact",
    "propagate_dtypes",
    "read_dtypes",
]
