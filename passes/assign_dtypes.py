"""Pass 3, assign_dtypes: decide what every node computes in and what it returns.

This is torch.autocast's per-op logic, run once over the graph instead of at every call:

* ``ALLOW``: floating inputs are cast to the low-precision dtype;
* ``DENY``: floating inputs are cast to float32;
* ``PROMOTE``: floating inputs are cast to the widest floating input dtype (autocast's
  ``prioritize``: float32 if any input is float32, else the low dtype);
* ``FOLLOW``: no casts; torch's type promotion decides.

float64, integer and bool tensors are never cast (autocast's eligibility rule). With
policies whose default is ``ALLOW`` (O2, O3), a value the model itself cast to float32
(``x.float()`` in an RMSNorm) stays float32 until the model casts again: ops that read
it compute in float32, as they would in Apex O2 (see :func:`track_pinning`).

Output dtypes come from FakeTensor propagation: every node of the captured graph has an
example value in ``meta["val"]``, so torch computes them. A node whose fake run fails is an
error naming it (only a call that returns no tensor, ``aten.item`` on data, may fail: it has
no dtype to decide).

Reads: ``meta["amp"]`` (role, rule, source), ``meta["val"]`` of placeholders. Writes:
``meta["amp"].compute_dtype``, ``.out_dtype``, ``.exact``, ``.detail`` (when the pinning
rule changes a decision), and ``meta["val"]`` (fake values under the plan). The graph is
not changed.
"""

from __future__ import annotations

import copy
import logging
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from amp_graph.policy import Rule, autocast_tables, base_name

from . import schema
from .meta import (
    AMP,
    LOW_PRECISION,
    NOT_TENSOR,
    UNKNOWN,
    VAL,
    AmpInfo,
    DtypeFact,
    Role,
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


class _Planner:
    """Walks the graph once, deciding dtypes and propagating values under the plan."""

    def __init__(
        self, gm: fx.GraphModule, low: torch.dtype, cast_inputs: bool, plan: bool = True
    ) -> None:
        # plan=False only propagates: no decisions, no casts, nothing written to the graph.
        self.gm, self.low, self.cast_inputs, self.plan = gm, low, cast_inputs, plan
        self.facts: dict[fx.Node, DtypeFact] = {}
        self.env: dict[fx.Node, Any] = {}
        self.pinned: set[fx.Node] = set()
        self.fake_mode = self._fake_mode()
        # The values capture gave to views, element picks and unlisted pointwise ops: when
        # their inputs keep their captured dtypes, so does their value (no need to run it).
        self.captured = {
            node: node.meta[VAL]
            for node in gm.graph.nodes
            if VAL in node.meta and _reuses_captured_value(node)
        }
        self.casts: dict[tuple[int, torch.dtype], tuple[Any, Any]] = {}
        # Inputs written in place (directly or through a view) are never cast at entry: the
        # write must reach the caller's tensor, not a copy.
        self.written = schema.written_storage(gm.graph) if plan and cast_inputs else set()

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

    def fake(self, tensor: torch.Tensor) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(tensor, FakeTensor):
            return tensor
        if _is_dtensor(tensor):  # an FSDP2 shard: the graph reads it gathered (fsdp_hooks)
            with self.fake_mode:
                return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        return self.fake_mode.from_tensor(tensor, static_shapes=True)

    def run(self) -> int:
        changed = 0
        for node in self.gm.graph.nodes:
            amp: AmpInfo = node.meta[AMP] if self.plan else _scratch(node)
            value = self._visit(node, amp)
            self.env[node] = value
            self.facts[node] = fact(value)
            if not self.plan:
                continue
            amp.exact = True
            if node.op == "placeholder":  # its own dtype; an entry cast carries the planned one
                amp.out_dtype = fact(node.meta[VAL])
                continue
            amp.out_dtype = fact(value)
            if node.op != "output":
                node.meta[VAL] = value
            changed += 1
        return changed

    def _visit(self, node: fx.Node, amp: AmpInfo) -> Any:
        if node.op == "placeholder":
            return self._placeholder(node, amp)
        if node.op == "get_attr":
            attr = operator.attrgetter(node.target)(self.gm)
            return self.fake(attr) if isinstance(attr, torch.Tensor) else attr
        if amp.role is Role.RUNTIME:  # added after the passes: nothing to plan
            return None
        args = map_aggregate(node.args, lambda a: self.env[a] if isinstance(a, fx.Node) else a)
        kwargs = map_aggregate(node.kwargs, lambda a: self.env[a] if isinstance(a, fx.Node) else a)
        if node.op == "output":
            return args[0]
        if not self.plan:
            return self._evaluate(node, amp, args, kwargs)
        facts = tensor_facts(fact((args, kwargs)))
        rule = effective_rule(node, amp, self.pinned)
        low = amp.low_dtype or self.low
        amp.compute_dtype = compute_dtype_for(rule, facts, low) if amp.role is Role.OP else None
        if amp.compute_dtype is not None:
            args, kwargs = self._cast((args, kwargs), amp.compute_dtype)
        out = self._evaluate(node, amp, args, kwargs)
        track_pinning(node, amp, facts, fact(out), self.pinned)
        return out

    def _evaluate(self, node: fx.Node, amp: AmpInfo, args: tuple, kwargs: dict) -> Any:
        captured = self.captured.get(node)
        if captured is not None and self._same_as_captured(node, args, kwargs):
            return captured
        try:
            return self._run_fake(node, args, kwargs)
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
                self.casts[key] = (v, cast_value(v, dtype))  # v kept alive: ids stay unique
            return self.casts[key][1]

        return map_aggregate(value, one)

    def _same_as_captured(self, node: fx.Node, args: tuple, kwargs: dict) -> bool:
        """Every tensor input now has the dtype of the node's captured value: a view, or a
        pointwise op of inputs all of one dtype, then computes that value again."""
        captured = self.captured[node]
        tensors = _tensors((args, kwargs))
        return (
            isinstance(captured, torch.Tensor)
            and bool(tensors)
            and all(t.dtype == captured.dtype for t in tensors)
        )

    def _placeholder(self, node: fx.Node, amp: AmpInfo) -> Any:
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
            value = cast_value(value, self.low)
        return value

    def _run_fake(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        """The node on fake values: an aten op (or a Python call the capture recorded), or
        a cast insert_casts made (``x.to(dtype)``, the one ``call_method``)."""
        with self.fake_mode:
            if node.op == "call_method":
                self_obj, *rest = args
                return getattr(self_obj, node.target)(*rest, **kwargs)
            return node.target(*args, **kwargs)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def effective_rule(node: fx.Node, amp: AmpInfo, pinned: set[fx.Node]) -> Rule:
    """The node's rule, after the pinning rule of :func:`track_pinning`: a default ALLOW
    reading a pinned float32 value computes in float32."""
    rule = amp.rule or Rule.FOLLOW
    pinned_inputs = [a for a in node.all_input_nodes if a in pinned]
    if rule is Rule.ALLOW and amp.source == "default" and pinned_inputs:
        # float32, not "follow": its other inputs may be low, and an op such as
        # scaled_dot_product_attention needs one dtype
        amp.detail = (
            f"{amp.detail}; but input {pinned_inputs[0].name!r} descends from a "
            "float32 cast written in the model, which default rules never undo: "
            "computes in float32"
        )
        return Rule.DENY
    return rule


def track_pinning(
    node: fx.Node,
    amp: AmpInfo,
    input_facts: list[DtypeFact],
    out: DtypeFact,
    pinned: set[fx.Node],
) -> None:
    """Add ``node`` to ``pinned`` when it holds a float32 value the model upcast itself.

    Only a cast written in the model that changes a low-precision (or unproven) value to
    float32 starts a pinned region (``h = x.float()`` in an RMSNorm); what is computed
    from it stays pinned while wide. Any other cast the model wrote ends the region:
    the cast back (``h.type_as(x)``, ``h.to(input_dtype)``), ``.to(device)``,
    ``.to(memory_format=)``, a ``.float()`` of what already is float32, integer-to-float
    conversions (``arange(T).float()``). So O2 and O3 keep exactly the model's float32
    islands in float32, and nothing after them.
    """
    if amp.role is Role.USER_CAST:
        source = input_facts[0] if input_facts else UNKNOWN
        upcast = out == torch.float32 and (source is UNKNOWN or source in LOW_PRECISION)
        if upcast:
            pinned.add(node)
        return
    wide = out in (torch.float32, torch.float64)
    if wide and any(a in pinned for a in node.all_input_nodes):
        pinned.add(node)


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
    planner.run()
    return planner.facts


def assign_dtypes(
    gm: fx.GraphModule, low_dtype: torch.dtype, cast_inputs: bool = False
) -> PassResult:
    """Decide ``compute_dtype`` and ``out_dtype`` for every node (see the module docstring).

    >>> import torch, amp_graph
    >>> from amp_graph.capture import capture_module
    >>> from amp_graph.passes import classify
    >>> model = torch.nn.Sequential(torch.nn.Softmax(-1))
    >>> gm = capture_module(model, (torch.randn(2, 3),), {}, device_type="cpu",
    ...                     autocast_dtype=torch.float16).graph_module
    >>> _ = classify(gm, amp_graph.Policy.preset("O1"))
    >>> _ = assign_dtypes(gm, torch.float16)
    >>> [n.meta["amp"].compute_dtype for n in gm.graph.nodes if n.name == "softmax"]
    [torch.float32]
    """
    if low_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"low_dtype is torch.float16 or torch.bfloat16, not {low_dtype}")
    _Planner(gm, low_dtype, cast_inputs).run()
    exact = all(n.meta[AMP].exact for n in gm.graph.nodes if n.op == "placeholder")
    return PassResult(gm, modified=False, stats={"exact_dtypes": int(exact)})


__all__ = [
    "FakeRunError",
    "assign_dtypes",
    "cast_value",
    "compute_dtype_for",
    "effective_rule",
    "fact",
    "propagate_dtypes",
    "track_pinning",
]
