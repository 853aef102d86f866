"""Pass 3, assign_dtypes: decide what every node computes in and what it returns.

This is torch.autocast's per-op logic, run once over the graph instead of at every call:

* ``ALLOW``: floating inputs are cast to the low-precision dtype;
* ``DENY``: floating inputs are cast to float32;
* ``PROMOTE``: floating inputs are cast to the widest floating input dtype (autocast's
  ``prioritize``: float32 if any input is float32, else the low dtype);
* ``FOLLOW``: no casts; torch's type promotion decides.

float64, integer and bool tensors are never cast (autocast's eligibility rule). With
policies whose default is ``ALLOW`` (O2, O3), a value the model itself cast to float32
(``x.float()`` in an RMSNorm) stays float32 until the model casts it back: default rules
never undo the model's own casts.

Output dtypes come from FakeTensor propagation when every graph input has an example
value in ``meta["val"]`` (exact: torch computes them), and from the sound rule table in
:mod:`passes.dtype_rules` otherwise (``UNKNOWN`` where unproven).

Reads: ``meta["amp"]`` (role, rule, source), ``meta["val"]`` of placeholders. Writes:
``meta["amp"].compute_dtype``, ``.out_dtype``, ``.exact``, ``.detail`` (when the pinning
rule changes a decision), and ``meta["val"]`` (fake values under the plan) in exact mode.
The graph is not changed.
"""

from __future__ import annotations

import copy
import logging
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from amp_graph.policy import Rule

from .dtype_rules import rule_out_dtype
from .meta import (
    AMP,
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


class Abstract:
    """A value known only by its dtype fact (rule mode)."""

    __slots__ = ("fact",)

    def __init__(self, fact: DtypeFact) -> None:
        self.fact = fact

    def __repr__(self) -> str:
        return f"Abstract({self.fact!r})"


def fact(value: Any) -> DtypeFact:
    """The dtype fact of an environment value (fake tensor, Abstract, or Python value)."""
    if isinstance(value, Abstract):
        return value.fact
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
    """autocast's ``prioritize``: float32 wins over low precision; float64 is ignored."""
    castable = [f for f in facts if is_castable(f)]
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
    if isinstance(value, Abstract):
        if is_castable(value.fact):
            return Abstract(dtype)
        return value  # UNKNOWN stays unknown: the run-time cast decides
    if isinstance(value, (tuple, list)):
        return type(value)(cast_value(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_value(v, dtype) for k, v in value.items()}
    return value


def _is_abstract(value: Any) -> bool:
    found = False

    def visit(v: Any) -> Any:
        nonlocal found
        found = found or isinstance(v, Abstract)
        return v

    map_aggregate(value, visit)
    return found


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

    def _fake_mode(self) -> Any:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        if any(VAL not in n.meta for n in placeholders):
            return None
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

        if isinstance(tensor, FakeTensor) or self.fake_mode is None:
            return tensor
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
            if node.op == "placeholder":  # its own dtype; an entry cast carries the planned one
                amp.out_dtype = fact(node.meta[VAL]) if VAL in node.meta else UNKNOWN
                amp.exact = VAL in node.meta
                continue
            amp.out_dtype = fact(value)
            amp.exact = not _is_abstract(value)
            if amp.exact and node.op != "output":
                node.meta[VAL] = value
            changed += 1
        return changed

    def _visit(self, node: fx.Node, amp: AmpInfo) -> Any:
        if node.op == "placeholder":
            return self._placeholder(node, amp)
        if node.op == "get_attr":
            attr = operator.attrgetter(node.target)(self.gm)
            return (
                self.fake(attr)
                if isinstance(attr, torch.Tensor) and self.fake_mode
                else (Abstract(attr.dtype) if isinstance(attr, torch.Tensor) else attr)
            )
        if amp.role is Role.STEP:  # backward, loss scaling, optimizer steps: nothing to plan
            return None
        args = map_aggregate(node.args, lambda a: self.env[a] if isinstance(a, fx.Node) else a)
        kwargs = map_aggregate(node.kwargs, lambda a: self.env[a] if isinstance(a, fx.Node) else a)
        if node.op == "output":
            return args[0]
        if not self.plan:
            return self._evaluate(node, amp, args, kwargs)
        facts = tensor_facts(fact((args, kwargs)))
        rule = self._effective_rule(node, amp)
        amp.compute_dtype = (
            compute_dtype_for(rule, facts, self.low) if amp.role is Role.OP else None
        )
        if amp.compute_dtype is not None:
            args, kwargs = (
                cast_value(args, amp.compute_dtype),
                cast_value(kwargs, amp.compute_dtype),
            )
        out = self._evaluate(node, amp, args, kwargs)
        self._track_pinning(node, amp, rule, fact(out))
        return out

    def _evaluate(self, node: fx.Node, amp: AmpInfo, args: tuple, kwargs: dict) -> Any:
        if self.fake_mode is not None and not _is_abstract((args, kwargs)):
            try:
                return self._run_fake(node, args, kwargs)
            except Exception as error:  # e.g. data-dependent output shapes
                log.debug("fake propagation failed at %s: %s; using dtype rules", node.name, error)
        out = rule_out_dtype(node, amp, fact((args, kwargs)))
        return Abstract(out) if out is not NOT_TENSOR else None

    def _placeholder(self, node: fx.Node, amp: AmpInfo) -> Any:
        value = node.meta[VAL] if VAL in node.meta else Abstract(UNKNOWN)
        entry_cast = self.plan and self.cast_inputs and amp.role is Role.INPUT  # not model state
        if entry_cast and (is_castable(fact(value)) or fact(value) is UNKNOWN):
            amp.compute_dtype = self.low
            amp.detail = "a graph input, cast to low precision at entry (policy cast_inputs)"
            value = cast_value(value, self.low)
        return value

    def _effective_rule(self, node: fx.Node, amp: AmpInfo) -> Rule:
        rule = amp.rule or Rule.FOLLOW
        pinned_inputs = [a for a in node.all_input_nodes if a in self.pinned]
        if rule is Rule.ALLOW and amp.source == "default" and pinned_inputs:
            amp.detail = (
                f"{amp.detail}; but input {pinned_inputs[0].name!r} descends from a "
                "float32 cast written in the model, which default rules never undo"
            )
            return Rule.FOLLOW
        return rule

    def _track_pinning(self, node: fx.Node, amp: AmpInfo, rule: Rule, out: DtypeFact) -> None:
        # Pinned: float32 (or wider) values that descend from a float32 cast the model wrote.
        wide = out in (torch.float32, torch.float64)
        from_user = amp.role is Role.USER_CAST
        if wide and (from_user or any(a in self.pinned for a in node.all_input_nodes)):
            self.pinned.add(node)

    def _run_fake(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        with self.fake_mode:
            if node.op == "call_function":
                if node.target is torch.func.functional_call:
                    module, params, inner_args, inner_kwargs = args
                    state = {**self._fake_state(module), **params}
                    return torch.func.functional_call(module, state, inner_args, inner_kwargs)
                return node.target(*args, **kwargs)
            if node.op == "call_method":
                self_obj, *rest = args
                return getattr(self_obj, node.target)(*rest, **kwargs)
            module = self.gm.get_submodule(node.target)
            return torch.func.functional_call(module, self._fake_state(module), args, kwargs)

    def _fake_state(self, module: torch.nn.Module) -> dict[str, Any]:
        named = [*module.named_parameters(), *module.named_buffers()]
        return {name: self.fake(t) for name, t in named}


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

    >>> import torch, torch.fx as fx, amp_graph
    >>> from amp_graph.passes import classify
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Softmax(-1)))
    >>> _ = classify(gm, amp_graph.Policy.preset("O1"))
    >>> _ = assign_dtypes(gm, torch.float16)
    >>> gm.graph.find_nodes(op="call_module")[0].meta["amp"].compute_dtype
    torch.float32
    """
    if low_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"low_dtype is torch.float16 or torch.bfloat16, not {low_dtype}")
    _Planner(gm, low_dtype, cast_inputs).run()
    exact = all(n.meta[AMP].exact for n in gm.graph.nodes if n.op == "placeholder")
    return PassResult(gm, modified=False, stats={"exact_dtypes": int(exact)})


__all__ = ["assign_dtypes", "cast_value", "compute_dtype_for", "fact", "propagate_dtypes"]
