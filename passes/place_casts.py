"""place_casts: where the policy leaves a choice, the plan with the fewest cast bytes.

Under O2 (and any policy whose default is low precision with float32 rules) most ops are
low only because of the default rule: no table, override or block of the model names them.
Such an op is *free*: computing it in float32 instead makes it more precise, never less, and
may save casts (a residual add between a low matmul and a float32 norm; the dropout and add
inside a float32 island; the gather of a float32 embedding table, instead of the cast of the
whole table). This pass labels every free op low or float32 so that the cast bytes of the
forward and of the backward (one gradient cast per forward cast of a value that has one)
are the least the policy's constraints allow, by an exact minimum cut
(:mod:`amp_graph.passes.cast_cut`), then plans the graph again.

What is free: an op (``Role.OP``) whose rule is the policy's default ``ALLOW`` (source
``"default"``, outside the model's own autocast blocks, not in an island), planned low
with every tensor output low, that no autocast list makes low (matmuls, convolutions and
attention stay low: they are what O2 is for), that writes nothing in place, takes no dtype
argument and whose dtype the model's Python never read. Views and ``getitem`` of a value
share its label. Everything else keeps its plan and reads what it reads: a read at another
dtype is a cast, shared per value and direction as ``simplify_casts`` shares them; a cast
the model wrote is its own conversion (free if its input already has its target); a value
read by anything whose dtype follows its inputs (PROMOTE and FOLLOW ops, the graph's
outputs, in-place writes) keeps its dtype. Under ``output_dtype=torch.float32``
(:mod:`cast_outputs`) the graph's output reads every value it returns in float32 instead,
so that the cast that returns an output is costed with the rest (and shared with a float32
op's cast of the same value, as :mod:`simplify_casts` shares it). Parameters and buffers
are read as the rules read them: a free op that reads one (through views) stays low, except
a gather of one (``GATHERS``: an embedding lookup), whose rows are the same bits cast before
or after it; a raised gather's readers then read its rows low (a free reader stays low, a
float32 reader keeps the gather low), so that only the table's cast, and its gradient's,
move.

Guarantees: no op computes in a lower precision than before; an op the cut raises computes
and returns float32 (rule ``DENY``, source ``"placement"``, ``detail`` saying what it
saved); every other op's compute dtype is unchanged, and so are the graph's output dtypes
(but for a raised op returned under ``output_dtype``: float32, which :mod:`cast_outputs`
would have returned); the model's float32 upcast of a raised value still starts its island
(:data:`~amp_graph.passes.meta.ISLAND_START`). Checked after the re-plan (a RuntimeError
otherwise).

One storage model at every entry point, so that the same policy plans the same graph
through each: a parameter is costed as a float32 master that every step reads through a
cast to the dtype it is read at, its gradient cast back. That is what ``compile`` and the
backend do in the graph, and what an O2 ``Graph`` does in its optimizer step (its low
copies, ``low_copies``, are refreshed from their masters by every step; one the placement
makes read only in float32 :mod:`widen_parameters` then stores in float32). An exported
program stores each tensor at the dtype every reader casts it to, and moves a cast after a
gather before it (:mod:`casts_before_views`: exact), so a raised embedding lookup costs it
no state. Runs after :mod:`assign_dtypes`, before :mod:`widen_parameters` and
:mod:`insert_casts`.
"""

from __future__ import annotations

import operator
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.autograd.graph import saved_tensors_hooks
from torch.fx.node import map_arg
from torch.utils import _pytree as pytree

from amp_graph.policy import Rule, autocast_tables, base_name

from . import schema
from .assign_dtypes import assign_dtypes
from .cast_cut import (
    FLOAT32,
    LOW,
    CastProblem,
    CastValue,
    Constant,
    Label,
    casts_of,
    savings,
    solve,
)
from .casts_before_views import GATHERS
from .meta import (
    AMP,
    DTYPE_READ,
    ISLAND_START,
    KEPT_FUNCTION,
    TRACED_NOOP_CAST,
    VAL,
    AmpInfo,
    Role,
    has_cast_role,
    sets_a_dtype,
    size_hint,
    tensor_facts,
)
from .result import PassResult
from .widen_parameters import low_copy_reads

# What autocast makes low on any device: the products O2 exists to run low.
_PRODUCTS: frozenset[str] = autocast_tables("cpu")[0] | autocast_tables("cuda")[0]


@dataclass
class _Builder:
    """The cast problem of one planned graph, node by node in graph order."""

    low: torch.dtype
    with_grad: set[fx.Node]
    masters: set[fx.Node] = field(default_factory=set)  # reads of low copies of masters
    saved: SavedInputs = field(default_factory=lambda: SavedInputs())
    label: dict[fx.Node, Label] = field(default_factory=dict)  # values the problem costs
    free: dict[str, fx.Node] = field(default_factory=dict)
    values: list[CastValue] = field(default_factory=list)
    pinned: list[tuple[Label, Label]] = field(default_factory=list)
    state_gathers: set[Label] = field(default_factory=set)  # free gathers of a parameter
    outputs_read_at: Label | None = None  # FLOAT32 under output_dtype: cast_outputs' read

    def constant(self, dtype: object) -> Label | None:
        """The label of a planned dtype fact; None for anything else (another dtype, a
        tuple of outputs, no tensor)."""
        if not isinstance(dtype, torch.dtype):
            return None
        return {self.low: LOW, torch.float32: FLOAT32}.get(dtype)

    def add_node(self, node: fx.Node) -> None:
        amp: AmpInfo | None = node.meta.get(AMP)
        if amp is None:
            return
        if self.is_free(node, amp):
            self.free[node.name] = node
            self.label[node] = node.name
            state = [a for a in node.all_input_nodes if _state_read(a)]
            if state and not (node.target in GATHERS and state == [node.args[0]]):
                self.pin(node.name)  # raised, it would read the state in float32
            elif state:
                self.state_gathers.add(node.name)
            return
        source = _alias_source(node, amp)
        if source is not None and source in self.label:
            self.label[node] = self.label[source]  # a view of it: the same dtype
            return
        entry_cast = node.op == "placeholder" and amp.compute_dtype is not None
        dtype = amp.compute_dtype if entry_cast else amp.out_dtype  # state lifted: as it is
        if node in self.masters:  # a low copy: costed as its float32 master (module docstring)
            dtype = torch.float32
        constant = self.constant(dtype)  # placeholders: after their entry cast
        if constant is not None:
            self.label[node] = constant
        entry = self.constant(amp.out_dtype) if entry_cast else None
        if constant is not None and entry is not None and entry is not constant:
            size = cast_bytes(node, self.low, self.with_grad)  # the entry cast: a given
            self.values.append(CastValue(node.name, entry, size, (constant,)))

    def is_free(self, node: fx.Node, amp: AmpInfo) -> bool:
        outs = tensor_facts(amp.out_dtype)
        return (
            amp.role is Role.OP
            and amp.rule is Rule.ALLOW
            and amp.source == "default"
            and amp.low_dtype is None
            and amp.compute_dtype == self.low
            and bool(outs)
            and all(out == self.low for out in outs)
            and base_name(amp.aten or "") not in _PRODUCTS
            and node.op == "call_function"
            and not schema.is_mutating(node)
            and not sets_a_dtype(node)
            and not node.meta.get(DTYPE_READ, False)
            and KEPT_FUNCTION not in node.meta
            # raised, its backward would hold these in float32
            and not self.saved.inputs(node)
            and not self.saved.result(node)
            and not self.saved.own_tensor(node)
        )

    def add_reads(self, value: fx.Node) -> None:
        """Who reads ``value`` at which label; a reader whose dtype follows it pins it."""
        own = self.label.get(value)
        if own is None:
            return
        if value.meta.get(DTYPE_READ, False):
            self.pin(own)
        readers: list[Label] = []
        for user in value.users:
            amp: AmpInfo | None = user.meta.get(AMP)
            if user in self.label and self.label[user] == own and _alias_source(user, amp) is value:
                continue  # its view: no cast between them
            if own in self.state_gathers and amp is not None:
                self.gathered_read(own, user, amp)
            if amp is not None and self.held_wide(value, user, amp):
                self.pin(own)  # raised, backward would hold it in float32, not low
            if amp is None:
                self.pin(own)
            elif user.name in self.free:
                readers.append(user.name)
            elif amp.role is Role.USER_CAST:
                target = self.constant(amp.out_dtype)
                if target is None:
                    self.pin(own)
                else:  # the model's own conversion: a cast unless it changes nothing
                    self.values.append(
                        CastValue(
                            user.name, own, cast_bytes(value, self.low, self.with_grad), (target,)
                        )
                    )
            elif amp.role is Role.OP and amp.compute_dtype is not None:
                reads_at = self.constant(amp.compute_dtype)
                if reads_at is not None:
                    readers.append(reads_at)
                # another compute dtype (a block of the model's own): a cast either way
            elif amp.role is Role.OUTPUT and self.outputs_read_at is not None:
                readers.append(self.outputs_read_at)  # returned in float32 (cast_outputs)
            else:  # follows its input's dtype, or returns it: keep it as planned
                self.pin(own)
        if readers and not isinstance(value.meta.get(VAL), (tuple, list)):
            self.values.append(
                CastValue(
                    value.name, own, cast_bytes(value, self.low, self.with_grad), tuple(readers)
                )
            )
        elif readers:  # a tuple read whole: keep it
            self.pin(own)

    def held_wide(self, value: fx.Node, user: fx.Node, amp: AmpInfo) -> bool:
        """``user`` reads ``value`` in float32 and its backward saves it (or, for the model's
        float32 cast of it, what reads that cast saves it): raised, ``value`` itself would be
        held in float32, where today backward may hold it low and widen it again."""
        upcast = amp.role is Role.USER_CAST and amp.out_dtype == torch.float32
        if upcast or _alias_source(user, amp) is value:  # what reads it reads ``value``
            return any(
                self.held_wide(user, reader, reader.meta[AMP])
                for reader in user.users
                if AMP in reader.meta
            )
        if amp.role is Role.USER_CAST:
            return False
        reads_wide = amp.role is Role.OP and amp.compute_dtype == torch.float32
        return reads_wide and value in self.saved.inputs(user)

    def gathered_read(self, gather: Label, user: fx.Node, amp: AmpInfo) -> None:
        """A raised gather of a parameter gives its readers the rows cast down, the values
        they read today (a cast commutes with a gather), and nothing else: a free reader
        stays low, and a float32 reader keeps the gather low (one storage for the state
        at every entry point; module docstring)."""
        if user.name in self.free:
            self.pin(user.name)
        else:  # the model's cast of it converts to what it names; an op reads its compute dtype
            reads_at = amp.out_dtype if amp.role is Role.USER_CAST else amp.compute_dtype
            if self.constant(reads_at) is not LOW:
                self.pin(gather)

    def pin(self, label: Label) -> None:
        if not isinstance(label, Constant):
            self.pinned.append((label, LOW))  # free labels start low: pinned, they stay so


RESULT = -1  # among a probe's saved positions: the op's own result
OWN = -2  # among them: a floating tensor the op made for backward (dropout's noise on the CPU)


def _floating_inputs(node: fx.Node) -> list[fx.Node]:
    return [
        a
        for a in node.all_input_nodes
        if isinstance(a.meta.get(VAL), torch.Tensor) and a.meta[VAL].is_floating_point()
    ]


class SavedInputs:
    """Which inputs of an op its backward saves (and whether its result, or a floating tensor
    of its own), asked of autograd on the op's own fake values (every floating input
    requiring a gradient) under saved-tensor hooks; one probe per op and argument pattern.
    An op that cannot be probed saves them all (the safe answer: nothing it reads is
    raised)."""

    def __init__(self) -> None:
        self._cache: dict[tuple, frozenset[int]] = {}

    def inputs(self, node: fx.Node) -> set[fx.Node]:
        """The floating inputs its backward saves."""
        floating = _floating_inputs(node)
        positions = self._positions(node, floating)
        return {a for i, a in enumerate(floating) if i in positions}

    def result(self, node: fx.Node) -> bool:
        """Its backward saves its own result (relu, tanh, exp, softmax)."""
        return RESULT in self._positions(node, _floating_inputs(node))

    def own_tensor(self, node: fx.Node) -> bool:
        """Its backward saves a floating tensor it made, neither an input nor its result
        (the CPU's dropout multiplies by a noise tensor of its input's dtype and saves it)."""
        return OWN in self._positions(node, _floating_inputs(node))

    def _positions(self, node: fx.Node, floating: list[fx.Node]) -> frozenset[int]:
        if node.op != "call_function" or not callable(node.target) or not floating:
            return frozenset()
        key = (node.target, tuple(node.all_input_nodes.index(a) for a in floating))
        if key not in self._cache:
            self._cache[key] = self._probe(node, floating)
        return self._cache[key]

    @staticmethod
    def _probe(node: fx.Node, floating: list[fx.Node]) -> frozenset[int]:
        every = frozenset(range(len(floating)))
        fake_mode = getattr(floating[0].meta[VAL], "fake_mode", None)
        if fake_mode is None:
            return every
        try:
            with fake_mode:
                leaves = {
                    a: torch.empty_strided(
                        a.meta[VAL].shape, a.meta[VAL].stride(), dtype=a.meta[VAL].dtype
                    ).requires_grad_()
                    for a in floating
                }
            saved: list[torch.Tensor] = []

            def pack(t: torch.Tensor) -> torch.Tensor:
                saved.append(t)
                return t

            args = map_arg(node.args, lambda a: leaves.get(a, a.meta.get(VAL)))
            kwargs = map_arg(node.kwargs, lambda a: leaves.get(a, a.meta.get(VAL)))
            with fake_mode, torch.enable_grad(), saved_tensors_hooks(pack, lambda t: t):
                out = node.target(*args, **kwargs)
        except Exception:
            return every
        positions = {
            i
            for i, a in enumerate(floating)
            if any(t is leaves[a] or torch._C._is_alias_of(t, leaves[a]) for t in saved)
        }
        outputs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        if any(t is o or torch._C._is_alias_of(t, o) for t in saved for o in outputs):
            positions.add(RESULT)
        known = [*leaves.values(), *outputs]
        if any(
            t.is_floating_point() and not any(t is k or torch._C._is_alias_of(t, k) for k in known)
            for t in saved
        ):
            positions.add(OWN)
        return frozenset(positions)


def _state_read(node: fx.Node) -> bool:
    """``node`` is a parameter or buffer of the model (read, or lifted as an input), or a
    view of one."""
    amp: AmpInfo | None = node.meta.get(AMP)
    if amp is None:
        return False
    if amp.role is Role.PARAM:
        return True
    source = _alias_source(node, amp)
    return source is not None and _state_read(source)


def _alias_source(node: fx.Node, amp: AmpInfo | None) -> fx.Node | None:
    """The value a view or ``getitem`` aliases, where its dtype is that value's."""
    if amp is None or amp.role is not Role.OP or amp.rule is not Rule.FOLLOW:
        return None
    is_alias = node.target is operator.getitem or schema.is_view(node)
    first = node.args[0] if node.args else None
    return first if is_alias and isinstance(first, fx.Node) else None


def _numel(value: object) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    n = size_hint(value.numel())
    return n if n is not None else 1


def gradient_values(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose value has a gradient in backward: parameters and inputs that require
    one, and every floating value computed from them, but for a ``detach`` and what is
    computed from it alone. (Example values do not say it: a capture may record them
    without autograd.)"""
    with_grad: set[fx.Node] = set()
    trained = {name for name, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            if node.target in trained:
                with_grad.add(node)
        elif node.op == "placeholder":
            val = node.meta.get(VAL)
            if isinstance(val, torch.Tensor) and val.requires_grad:
                with_grad.add(node)
        elif (
            node.op in ("call_function", "call_method")  # aten ops, and the casts inserted
            and node.target is not torch.ops.aten.detach.default  # cut off from autograd
            and any(a in with_grad for a in node.all_input_nodes)
            and any(isinstance(f, torch.dtype) and f.is_floating_point for f in _facts(node))
        ):
            with_grad.add(node)
    return with_grad


def _facts(node: fx.Node) -> list:
    amp: AmpInfo | None = node.meta.get(AMP)
    return tensor_facts(amp.out_dtype) if amp is not None else []


def cast_bytes(value: fx.Node, low: torch.dtype, with_grad: set[fx.Node]) -> int:
    """The bytes one cast of ``value`` moves per call: read in one dtype, written in the
    other; a value with a gradient has the gradient's cast back in backward too."""
    return _numel(value.meta.get(VAL)) * (low.itemsize + 4) * (2 if value in with_grad else 1)


def converted_bytes(gm: fx.GraphModule, low: torch.dtype) -> int:
    """The bytes the rewritten graph's conversions between ``low`` and float32 move per call,
    as :func:`cast_bytes` costs one: amp_graph's casts and those the model wrote that change
    a dtype. What the placement's figures are checked against."""
    with_grad = gradient_values(gm)
    total = 0
    for node in gm.graph.nodes:
        amp: AmpInfo | None = node.meta.get(AMP)
        converts = amp is not None and (has_cast_role(node) or amp.role is Role.USER_CAST)
        if not converts or not node.all_input_nodes:
            continue
        source = node.all_input_nodes[0]
        dtypes = (source.meta[AMP].out_dtype, amp.out_dtype)
        if dtypes in ((low, torch.float32), (torch.float32, low)):
            total += cast_bytes(source, low, with_grad)
    return total


def _master_reads(gm: fx.GraphModule, low_copies: Collection[torch.Tensor]) -> set[fx.Node]:
    return {node for nodes in low_copy_reads(gm, low_copies).values() for node in nodes}


def cast_problem(
    gm: fx.GraphModule,
    low: torch.dtype,
    low_copies: Collection[torch.Tensor] = (),
    output_dtype: torch.dtype | None = None,
) -> tuple[CastProblem, dict[str, fx.Node]]:
    """The planned graph's placement problem, and its free ops by label (``low_copies``:
    parameters stored low as copies of float32 masters, costed as the masters;
    ``output_dtype``: ``Policy.output_dtype``, float32 where :mod:`cast_outputs` returns the
    low outputs in float32, so that the graph's output reads them in float32)."""
    builder = _Builder(low, gradient_values(gm), masters=_master_reads(gm, low_copies))
    builder.outputs_read_at = builder.constant(output_dtype)
    for node in gm.graph.nodes:
        builder.add_node(node)
    if not builder.free:  # O1, autocast, O0: nothing to place (and no probes to run)
        return CastProblem((), (), ()), {}
    for node in gm.graph.nodes:
        builder.add_reads(node)
    problem = CastProblem(tuple(builder.free), tuple(builder.values), tuple(builder.pinned))
    return problem, builder.free


def place_casts(
    gm: fx.GraphModule,
    low_dtype: torch.dtype,
    cast_inputs: bool = False,
    low_copies: Collection[torch.Tensor] = (),
    output_dtype: torch.dtype | None = None,
) -> PassResult:
    """Raise the free ops the cut chooses to float32 and plan again (module docstring;
    ``low_copies``: the parameters an O2 ``Graph`` stores low, copies of float32 masters;
    ``output_dtype``: ``Policy.output_dtype``, the dtype :mod:`cast_outputs` returns the low
    outputs in, which the cut counts as the output's read)."""
    problem, free = cast_problem(gm, low_dtype, low_copies, output_dtype)
    placement = solve(problem)
    stats = {
        "ops_moved_up": len(placement.raised),
        "placed_cast_bytes_before": placement.cost_before,
        "placed_cast_bytes_after": placement.cost,
        "placed_casts_before": casts_of(problem, ()),
        "placed_casts_after": casts_of(problem, placement.raised),
    }
    if not placement.raised:
        return PassResult(gm, False, stats)
    before = {n: n.meta[AMP].compute_dtype for n in gm.graph.nodes if AMP in n.meta}
    raised = [free[name] for name in placement.raised]
    own = savings(problem, placement.raised)
    saving = placement.cost_before - placement.cost
    for node in raised:
        amp: AmpInfo = node.meta[AMP]
        amp.rule, amp.source = Rule.DENY, "placement"
        amp.detail = (
            "only the policy's default rule made it low, so the cast placement (an exact "
            f"minimum cut of the cast bytes) raised it to float32: {own.get(node.name, 0)} "
            f"bytes of casts per call (forward and backward) would come back with it low; "
            f"the {len(raised)} ops it raised save {saving} in all"
        )
        for user in node.users:  # the model's upcast of it still starts its island
            _keep_island(user)
    assign_dtypes(gm, low_dtype, cast_inputs)
    _check_replanned(gm, set(raised), before)
    return PassResult(gm, False, stats)


def _keep_island(user: fx.Node) -> None:
    amp: AmpInfo | None = user.meta.get(AMP)
    if amp is None:
        return
    if amp.role is Role.USER_CAST and amp.out_dtype == torch.float32:
        if not user.meta.get(TRACED_NOOP_CAST, False):
            user.meta[ISLAND_START] = True
    elif _alias_source(user, amp) is not None:
        for next_user in user.users:
            _keep_island(next_user)


def _check_replanned(
    gm: fx.GraphModule, raised: set[fx.Node], before: dict[fx.Node, torch.dtype | None]
) -> None:
    """The re-plan did what the cut chose and nothing else (a RuntimeError naming the node)."""
    for node in gm.graph.nodes:
        amp: AmpInfo | None = node.meta.get(AMP)
        if amp is None or node not in before:
            continue
        if node in raised:
            outs = tensor_facts(amp.out_dtype)
            if amp.compute_dtype != torch.float32 or any(o != torch.float32 for o in outs):
                raise RuntimeError(
                    f"place_casts: the cut raised node {node.name!r} to float32, but after "
                    f"the re-plan it computes in {amp.compute_dtype} and returns {amp.out_dtype}"
                )
        elif amp.compute_dtype != before[node]:
            raise RuntimeError(
                f"place_casts: after the re-plan node {node.name!r} computes in "
                f"{amp.compute_dtype} (before: {before[node]}), which the cut did not choose"
            )


__all__ = ["cast_bytes", "cast_problem", "converted_bytes", "gradient_values", "place_casts"]
