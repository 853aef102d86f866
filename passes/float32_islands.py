"""The float32 islands of policies whose default is low (O2, O3): which values stay float32
although no table names their ops.

Two kinds, each tracked node by node in graph order (by assign_dtypes, and by the capture
under the policy, which must decide alike):

* **The model's own upcast.** A cast the model wrote to a fixed float32 target of a low (or
  unproven) value (``h = x.float()`` in an RMSNorm) starts an island; what is computed from
  it stays in it while wide, and a default ``ALLOW`` op reading it computes in float32, as
  in Apex O2. Any other cast the model wrote ends it (``h.to(input_dtype)``). A cast whose
  target the model read from another tensor (``x.to(y.dtype)``, ``x.type_as(y)``) is
  captured with the dtype ``y`` has in the plan (:mod:`amp_graph.capture.planned_dtypes`), so it
  means "match ``y``", never a float32 the model chose. The ``torch.compile`` backend
  cannot do this (dynamo bakes ``y.dtype`` in as the dtype it traced, float32), so there a
  cast that changed nothing in dynamo's trace starts no island
  (:data:`~amp_graph.passes.meta.TRACED_NOOP_CAST`): ``x.float()`` of a value that the plan
  makes low but dynamo traced as float32 does not keep what follows in float32.
* **Values the forward makes from integers.** A float32 value the forward builds with no
  floating input (``torch.arange(n, dtype=torch.float32)``, ``timesteps.float()`` of
  integer timesteps, ``torch.full(...)``, a literal ``torch.tensor(10000.0)``) and everything
  computed from such values alone
  (a sinusoidal timestep or position encoding: ``exp``, ``mul``, ``sin``, ``cos``, ``cat``)
  stays float32: Apex O2 casts parameters and inputs, never values the forward creates.
  Arguments of ``sin`` reach 1e3 there, where bfloat16's neighbours are 4 apart. The island
  ends where such a value meets a parameter or an input (the time embedding's ``linear``),
  or where the model casts it (diffusers' ``t_emb.to(dtype=sample.dtype)``).

Both rules change only a *default* ``ALLOW``: a table, an override or the model's own
autocast block decides as written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from amp_graph.policy import Rule

from .meta import (
    ISLAND_START,
    LOW_PRECISION,
    NOT_TENSOR,
    TRACED_NOOP_CAST,
    UNKNOWN,
    AmpInfo,
    DtypeFact,
    Role,
)

_WIDE = (torch.float32, torch.float64)


@dataclass
class Float32Islands:
    """The nodes seen so far that hold a value of either island (see the module's doc)."""

    upcast: set[fx.Node] = field(default_factory=set)  # the model's own float32 upcasts
    from_integers: set[fx.Node] = field(default_factory=set)  # made in float32 from integers


def effective_rule(
    node: fx.Node, amp: AmpInfo, islands: Float32Islands, facts: Mapping[fx.Node, DtypeFact]
) -> Rule:
    """The node's rule once the islands are applied: a default ALLOW reading a value of the
    model's own upcast, or reading only values made from integers, computes in float32
    (``amp.detail`` says which). ``facts``: the planned dtype facts of the nodes seen.
    Only the default rule is changed: inside the model's own enabled autocast block classify
    records source ``"autocast region"``, and the block's dtype stands, as under
    torch.autocast."""
    rule = amp.rule or Rule.FOLLOW
    if rule is not Rule.ALLOW or amp.source != "default":
        return rule
    upcast = [a for a in node.all_input_nodes if a in islands.upcast]
    if upcast:
        # float32, not "follow": its other inputs may be low, and an op such as
        # scaled_dot_product_attention needs one dtype
        _add_detail(
            amp,
            f"; but input {upcast[0].name!r} descends from a float32 cast written in the "
            "model, which default rules never undo: computes in float32",
        )
        return Rule.DENY
    made = _reads_only_made_from_integers(node, islands, facts)
    if made:
        _add_detail(
            amp,
            f"; but its floating inputs ({', '.join(repr(a.name) for a in made)}) were made "
            "by the forward in float32 from integers or constants (arange, positions, "
            "timesteps), which the policy never rounds (Apex O2 casts only parameters and "
            "inputs): computes in float32",
        )
        return Rule.DENY
    return rule


def _add_detail(amp: AmpInfo, clause: str) -> None:
    """Append ``clause`` once: a graph planned again (widen_parameters, place_casts) says it
    once."""
    if clause not in amp.detail:
        amp.detail += clause


def _reads_only_made_from_integers(
    node: fx.Node, islands: Float32Islands, facts: Mapping[fx.Node, DtypeFact]
) -> list[fx.Node]:
    """The node's floating inputs when every one of them was made from integers (and there
    is one), else []. An input of unknown dtype may be floating: it ends the island. A
    tensor literal's copy reads a constant of the graph: that constant."""
    literal = _literal(node)
    if literal:
        return literal
    made = []
    for arg in node.all_input_nodes:
        if arg in islands.from_integers:
            made.append(arg)
        elif not _never_floating(facts.get(arg, UNKNOWN)):
            return []
    return made


# the op torch records for a tensor literal in the forward (``torch.tensor(1e4)``): its input
# is a constant of the graph, which O2 would otherwise round as it rounds parameters
_LITERALS = frozenset({"aten::lift_fresh_copy", "aten::lift_fresh"})


def _literal(node: fx.Node) -> list[fx.Node]:
    """The constant a tensor literal copies, as a one-item list; [] for any other node."""
    op = getattr(node.target, "_schema", None)
    return list(node.all_input_nodes[:1]) if op is not None and op.name in _LITERALS else []


def _never_floating(fact: DtypeFact) -> bool:
    """A fact (or every leaf of one) that is surely no floating tensor."""
    if isinstance(fact, (tuple, list)):
        return all(_never_floating(f) for f in fact)
    if fact is NOT_TENSOR:
        return True
    return isinstance(fact, torch.dtype) and not fact.is_floating_point


def track_islands(
    node: fx.Node,
    amp: AmpInfo,
    input_facts: list[DtypeFact],
    out: DtypeFact,
    islands: Float32Islands,
    facts: Mapping[fx.Node, DtypeFact],
) -> None:
    """Add ``node`` to the island its value belongs to, if any (after its dtype is decided).

    The model's upcast: only a cast written in the model that changes a low-precision (or
    unproven) value to float32 starts one; what is computed from it stays in it while wide.
    Any other cast the model wrote ends it: the cast back (``h.type_as(x)``,
    ``h.to(input_dtype)``), ``.to(device)``, ``.to(memory_format=)``, a ``.float()`` of
    what already is float32, integer-to-float conversions (``arange(T).float()``, which
    start the other island). So O2 and O3 keep exactly the model's float32 islands in
    float32, and nothing after them.
    """
    if out == torch.float32 and (
        all(_never_floating(facts.get(a, UNKNOWN)) for a in node.all_input_nodes)
        or _reads_only_made_from_integers(node, islands, facts)
    ):
        islands.from_integers.add(node)
        return
    if amp.role is Role.USER_CAST:
        source = input_facts[0] if input_facts else UNKNOWN
        baked = node.meta.get(TRACED_NOOP_CAST, False)  # maybe x.to(y.dtype), as dynamo saw it
        was_low = source is UNKNOWN or source in LOW_PRECISION or node.meta.get(ISLAND_START)
        if out == torch.float32 and not baked and was_low:
            islands.upcast.add(node)
        return
    if out in _WIDE and any(a in islands.upcast for a in node.all_input_nodes):
        islands.upcast.add(node)


__all__ = ["Float32Islands", "effective_rule", "track_islands"]
