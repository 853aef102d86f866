"""Capture under the policy: the model's Python sees the dtypes the policy will give.

Model code reads dtypes while it is captured: HF GPT-2's ``attn_weights.type(value.dtype)``,
Llama's RMSNorm ``hidden_states.to(input_dtype)``, T5's ``.to(self.wo.weight.dtype)``,
``torch.finfo(x.dtype).min`` masks. Whatever dtype such code sees is baked into the graph
as a constant. Captured under plain ``torch.autocast``, it sees autocast's dtypes, and then

* an fp32 pin (a module override, an autopolicy demotion) does not hold: the pinned
  attention still rounds its probabilities to the low dtype, because capture saw ``value``
  in the low dtype and recorded ``.type(bfloat16)``;
* O2 and O3 come out mostly float32: autocast leaves embeddings and residual adds in
  float32, so "cast back to the input dtype" is recorded as ``.to(float32)``, a float32
  island the model seems to have written, which O2/O3 then keep;
* ops that CUDA autocast reconciles (``dot`` of float16 and float32) cannot be captured
  on a CPU, whose autocast lists do not promote them.

:class:`PolicyDtypeMode` fixes all three. It is a ``TorchDispatchMode`` entered inside the
export trace, above the fake-tensor mode and below the pre-dispatch tracer: the tracer has
already recorded the op as the model wrote it (``aten.linear(x, w, b)``) when the mode
sees the kernels that compute its fake value. The mode reads that node, decides it the way
the passes will (:func:`amp_graph.passes.classify.classify_node`, then
:func:`amp_graph.passes.assign_dtypes.compute_dtype_for` on the planned dtypes of its
inputs, with O2's float32 islands), and casts the fake inputs of those kernels so the fake
value, which the model's Python sees, has the planned dtype. The casts are below the
tracer, so nothing of them is recorded: the graph holds the model's ops, as before, and
the passes insert the real casts. The capture still runs under ``torch.autocast`` so that
code asking ``torch.is_autocast_enabled()`` (HF's ``maybe_autocast``) takes its autocast
path; where autocast's own casts differ from the plan, the mode undoes them.

What the model's Python sees is then what the rewritten graph computes, node for node:
the test suite checks this by comparing the captured values' dtypes with the plan.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.node import map_aggregate
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from amp_graph.capture.casts import (
    CompositePromoteMode,
    newest_node,
    promoted,
    proxy_tracer,
    traced_nodes,
)
from amp_graph.passes.assign_dtypes import compute_dtype_for, fact, read_dtypes
from amp_graph.passes.classify import classify_node
from amp_graph.passes.float32_islands import Float32Islands, effective_rule, track_islands
from amp_graph.passes.meta import (
    CAPTURE_PLAN,
    CASTABLE,
    CHECKPOINT_REGION,
    NOT_TENSOR,
    UNKNOWN,
    AmpInfo,
    Role,
    is_castable,
    tensor_facts,
)
from amp_graph.passes.regions import AutocastRegion, autocast_marker
from amp_graph.policy import OpFacts, Policy, Rule, python_ops

log = logging.getLogger(__name__)

# Not recorded for reuse: under the capture's casts, torch 2.11's CPU kernels for these give
# LSTM's h and c an extra dimension in bf16 (2.13's do not); a fake run of the op is right.
_RECURRENT = frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu"})


class _Plan:
    """One node's decision at capture: cast every floating input to ``compute`` (an op the
    policy casts), or give each input its planned dtype back (``inputs``: an op that takes
    its inputs as they come, whose inputs autocast may have cast)."""

    __slots__ = ("amp", "compute", "faithful", "input_facts", "inputs", "same_op")

    def __init__(
        self,
        amp: AmpInfo,
        compute: torch.dtype | None,
        inputs: list[Any],
        same_op: Any,
        input_facts: tuple[Any, ...],
    ) -> None:
        self.amp, self.compute, self.inputs, self.same_op = amp, compute, inputs, same_op
        self.input_facts = input_facts  # node.all_input_nodes' planned facts, as read
        # The value is the op run on its planned inputs (cast to ``compute``), as the
        # rewritten graph runs it, unless an inner kernel's inputs were widened (batch_norm
        # of a bf16 input with float32 weights then computes in float32) or a cast ran after
        # the op's first computing kernel (a decomposition casting its result back). Only
        # a faithful plan is recorded for assign_dtypes to reuse the value.
        self.faithful = True

    def record(self) -> tuple[Any, torch.dtype | None, tuple[Any, ...]]:
        """(op, compute dtype, input facts): what meta[CAPTURE_PLAN] keeps of the plan."""
        return self.same_op, self.compute, self.input_facts


class PolicyDtypeMode(TorchDispatchMode):
    """Gives each op's fake value, during capture, the dtype the policy plans for it.

    Entered by :func:`capture_under_policy` when the model's forward starts under
    ``torch.export`` (the pre-dispatch tracer is then known), left when it returns.
    """

    def __init__(
        self,
        tracer: Any,
        model: nn.Module,
        policy: Policy,
        low: torch.dtype,
        user_inputs: set[fx.Node],
    ) -> None:
        super().__init__()
        self.tracer, self.model, self.policy, self.low = tracer, model, policy, low
        self.user_inputs = user_inputs  # the nodes of the tensors the model was called with
        self.islands = Float32Islands()  # O2's float32 islands, as assign_dtypes tracks them
        self.known_types: dict[str, type] = {}  # module path -> type (classify_node)
        self.planned: dict[fx.Node, Any] = {}  # planned dtype facts of nodes already seen
        self.plans: dict[fx.Node, _Plan | None] = {}
        # the plans the nodes' values were computed under (kernels adjusted to them, or a
        # model's cast, which no autocast list touches): node name -> _Plan.record()
        self.records: dict[str, tuple[Any, torch.dtype | None, tuple[Any, ...]]] = {}
        self.regions: list[AutocastRegion] = []
        self.seen: fx.Node | None = None  # the last node walked by _catch_up
        # activation checkpoints: node name -> region number, and whether a reentrant
        # checkpoint (whose block export records as run without gradients) was met
        self.checkpointed: dict[str, int] = {}
        self.checkpoint_frames: dict[int, int] = {}
        self.reentrant_checkpoint = False
        # a forward entered without gradients (an inference capture) has no reentrant
        # checkpoint to tell apart by its grad mode: no stack walk per node then
        self.grad_at_entry = torch.is_grad_enabled()

    # --- the walk over the tracer's graph -------------------------------------------------

    def _current(self) -> fx.Node | None:
        """The node whose value is being computed: the tracer's newest node, while it has
        no value yet (a kernel run for anything else finds a node with one)."""
        graph = self.tracer.graph
        node = newest_node(graph)
        if node is None or node.op != "call_function" or "val" in node.meta:
            return None
        return node

    def _catch_up(self, upto: fx.Node) -> None:
        """Walk the nodes recorded since the last call (their values are known now): note
        their planned dtypes, O2's pinned values, and the model's own autocast blocks."""
        start = self.seen.next if self.seen is not None else next(iter(self.tracer.graph.nodes))
        node = start
        while node is not upto and node.op != "root":
            self._note(node)
            self.seen = node
            node = node.next

    def _catch_up_to_end(self) -> None:
        """Note the nodes recorded after the last kernel that needed a plan."""
        last = newest_node(self.tracer.graph)
        if last is not None and last is not self.seen:
            self._catch_up(last)
            self._note(last)
            self.seen = last

    def _note(self, node: fx.Node) -> None:
        marker = autocast_marker(node)
        if marker == "exit":
            if self.regions:
                self.regions.pop()
            return
        if isinstance(marker, AutocastRegion):
            self.regions.append(marker)
            return
        value = node.meta.get("val")
        if node.op == "placeholder":
            self.planned[node] = self._entry_dtype(node, value)
            return
        self.planned[node] = fact(value) if "val" in node.meta else UNKNOWN
        if node.target is torch.ops.aten.type_as.default and len(node.args) > 1:
            # the graph's type_as reads its other input's dtype when it runs: the planned one
            other = self.planned.get(node.args[1], UNKNOWN)
            if is_castable(other) and is_castable(self.planned[node]):
                self.planned[node] = other
        plan = self.plans.get(node)
        if plan is not None:
            recurrent = getattr(node.target, "__name__", "").split(".")[0] in _RECURRENT
            faithful = plan.faithful and not recurrent
            if faithful and _computed_at(node.meta.get("val"), plan.compute):
                self.records[node.name] = plan.record()
        elif node.op == "call_function":
            # a node none of whose kernels needed a plan (a cast, a no-op .to()): its
            # record still counts for O2's float32 islands
            plan = self._decide_quietly(node)
            user_cast = plan is not None and plan.amp.role is Role.USER_CAST
            if user_cast and self._inputs_as_planned(node):
                self.records[node.name] = plan.record()
        if plan is not None:
            facts = tensor_facts(self._facts((node.args, node.kwargs)))
            track_islands(node, plan.amp, facts, self.planned[node], self.islands, self.planned)

    def planned_dtype(self, value: torch.Tensor) -> torch.dtype:
        """The dtype the plan gives a traced tensor: what ``value.dtype`` means in the graph.

        It differs from the captured value's own dtype where the capture cannot give the
        value its planned dtype: a graph input that O2 and O3 cast at entry is float32
        while traced. A value the tracer does not hold (a constant), or one the plan does
        not know, keeps its own."""
        nodes = traced_nodes([value], self.tracer)
        if len(nodes) != 1 or value.dtype not in CASTABLE:
            return value.dtype
        (node,) = nodes
        if node not in self.planned:
            self._catch_up_to_end()
        planned = self.planned.get(node, UNKNOWN)
        return planned if is_castable(planned) else value.dtype

    def _inputs_as_planned(self, node: fx.Node) -> bool:
        """Whether each input's captured value has its planned dtype, so that a kernel the mode
        does not adjust (a cast) computed the node's value as the graph will. A graph input
        that O2 casts at entry does not: capture sees it as the caller gave it
        (``h.type_as(x)`` is float32 there, the low dtype in the graph)."""
        return all(
            fact(a.meta.get("val")) == self.planned.get(a, UNKNOWN) for a in node.all_input_nodes
        )

    def _facts(self, tree: Any) -> Any:
        """The planned dtype facts of a node's arguments (NOT_TENSOR for constants)."""
        return map_aggregate(
            tree, lambda a: self.planned.get(a, UNKNOWN) if isinstance(a, fx.Node) else NOT_TENSOR
        )

    def _entry_dtype(self, node: fx.Node, value: Any) -> Any:
        """A graph input's planned dtype: the low dtype where the policy casts inputs at
        entry (O2, O3), else its own."""
        dtype = fact(value) if value is not None else UNKNOWN
        cast = self.policy.cast_inputs and node in self.user_inputs
        return self.low if cast and is_castable(dtype) else dtype

    # --- one node's decision --------------------------------------------------------------

    def _plan(self, node: fx.Node) -> _Plan | None:
        if node in self.plans:
            return self.plans[node]
        self._catch_up(node)
        self._note_checkpoint(node)
        self.plans[node] = self._decide_quietly(node)
        return self.plans[node]

    def _note_checkpoint(self, node: fx.Node) -> None:
        """Record the ``torch.utils.checkpoint`` region computing ``node``, if any.

        Export traces through a checkpoint: the block's ops are recorded as plain forward
        code. What marks them is the checkpoint's own saved-tensor hook, active while the
        block runs (non-reentrant form); its frame object tells one region from the next.
        The reentrant form runs its block under ``torch.no_grad()`` inside an
        ``autograd.Function``, which export records as a block without gradients.
        """
        frame = _checkpoint_frame()
        if frame is not None:
            region = self.checkpoint_frames.setdefault(id(frame), len(self.checkpoint_frames))
            self.checkpointed[node.name] = region
        elif self.grad_at_entry and not torch.is_grad_enabled() and _in_reentrant_checkpoint():
            self.reentrant_checkpoint = True

    def _decide_quietly(self, node: fx.Node) -> _Plan | None:
        try:
            return self._decide(node)
        except Exception as error:  # a node the passes will explain; capture goes on
            log.debug("no capture-time plan for %s: %s", node.name, error)
            return None

    def _decide(self, node: fx.Node) -> _Plan | None:
        region = self.regions[-1] if self.regions else None
        amp: AmpInfo = classify_node(
            node, self.model, self.policy, region, known_types=self.known_types
        )
        facts = tensor_facts(self._facts((node.args, node.kwargs)))
        compute = None
        if amp.role is Role.OP:
            rule = effective_rule(node, amp, self.islands, self.planned)
            compute = compute_dtype_for(rule, facts, amp.low_dtype or self.low)
        # each node argument's planned dtype, in argument order (map_arg visits them all)
        arg_dtypes: list[Any] = []
        fx.node.map_arg((node.args, node.kwargs), lambda a: arg_dtypes.append(self.planned.get(a)))
        input_facts = read_dtypes(
            tuple(self.planned.get(a, UNKNOWN) for a in node.all_input_nodes), compute
        )
        return _Plan(amp, compute, arg_dtypes, node.target, input_facts)

    # --- the kernels under it -------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if not _computes_tensors(func):
            # casts (their value is their dtype argument's; autocast's own casts of a weight
            # are undone at the kernel computing with it) and queries (prim.device, which
            # autograd asks while it holds the tensor's lock: casting it then deadlocks)
            if func is torch.ops.aten._to_copy.default:
                node = self._current()
                plan = self.plans.get(node) if node is not None else None
                if plan is not None:  # after a computing kernel of the node: not faithful
                    plan.faithful = False
            return func(*args, **kwargs)
        node = self._current()
        plan = self._plan(node) if node is not None else None
        if plan is not None:
            args, kwargs = _adjusted(func, args, kwargs, plan)
        return func(*args, **kwargs)


def _computed_at(value: Any, compute: torch.dtype | None) -> bool:
    """Every floating tensor of a node's value has the compute dtype (when there is one)."""
    if compute is None:
        return True
    return all(
        leaf.dtype == compute
        for leaf in pytree.tree_leaves(value)
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
    )


def _checkpoint_frame() -> Any:
    """The running non-reentrant ``torch.utils.checkpoint``'s frame, or None: read from the
    saved-tensor hook it installs (torch's ``_checkpoint_hook``, whose pack hook closes over
    the frame). Relies on torch internals; tests/test_checkpointing.py pins it down."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if hooks is None:
        return None
    pack = hooks[0]
    if "_checkpoint_hook" not in getattr(pack, "__qualname__", ""):
        return None
    for cell in getattr(pack, "__closure__", None) or ():
        if type(cell.cell_contents).__name__ == "_CheckpointFrame":
            return cell.cell_contents
    return None


def _in_reentrant_checkpoint() -> bool:
    """Whether the Python stack runs a reentrant checkpoint's forward (CheckpointFunction)."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "forward" and code.co_filename.endswith("utils/checkpoint.py"):
            owner = frame.f_locals.get("ctx")
            if owner is not None and "CheckpointFunction" in type(owner).__name__:
                return True
        frame = frame.f_back
    return False


@functools.lru_cache(maxsize=2048)
def _computes_tensors(func: Any) -> bool:
    """An aten kernel that returns tensors and is not a cast."""
    op_schema = getattr(func, "_schema", None)
    if op_schema is None or not op_schema.name.startswith("aten::"):
        return False
    if op_schema.name in ("aten::_to_copy", "aten::to", "aten::copy_"):
        return False
    return any(isinstance(r.type, torch.TensorType) for r in op_schema.returns) or any(
        "Tensor" in str(r.type) for r in op_schema.returns
    )


def mark_capture_plans(
    gm: fx.GraphModule, records: dict[str, tuple[Any, torch.dtype | None, tuple[Any, ...]]]
) -> None:
    """Write the plan each node's value was captured under to ``meta[CAPTURE_PLAN]`` (by
    name; assign_dtypes uses a record only for the op it names), so that assign_dtypes
    reuses the value where it plans the same."""
    for node in gm.graph.nodes:
        record = records.get(node.name)
        if record is not None and node.op == "call_function":
            node.meta[CAPTURE_PLAN] = record


def mark_checkpoint_regions(gm: fx.GraphModule, regions: dict[str, int]) -> None:
    """Write each checkpointed node's region to ``meta[CHECKPOINT_REGION]`` (by name:
    the exported graph keeps the tracer's node names).

    A call recorded between a region's first and last marked node ran inside that
    checkpoint (export records in execution order) and is marked too: some calls run no
    kernel the capture could see, so nothing marked them (on torch 2.15, a dropout with
    ``p=0`` returns its input as is). Calls inside the spans of two regions (nested
    checkpoints) are left as they are.
    """
    if not regions:
        return
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    spans: dict[int, list[int]] = {}
    for index, node in enumerate(calls):
        if node.name in regions:
            node.meta[CHECKPOINT_REGION] = regions[node.name]
            spans.setdefault(regions[node.name], [index, index])[1] = index
    for index, node in enumerate(calls):
        if CHECKPOINT_REGION in node.meta:
            continue
        around = [r for r, (first, last) in spans.items() if first < index < last]
        if len(around) == 1:
            node.meta[CHECKPOINT_REGION] = around[0]


def _flat_tensors(args: tuple, kwargs: dict) -> dict[int, torch.Tensor] | None:
    """The kernel's tensor arguments by their position among pytree's leaves of ``(args,
    kwargs)``, found without a pytree walk (an aten kernel takes tensors, flat lists of them
    and scalars); None for any other structure."""
    found: dict[int, torch.Tensor] = {}
    index = 0
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, (list, tuple, dict)):
                    return None
                if isinstance(item, torch.Tensor):
                    found[index] = item
                index += 1
        elif isinstance(value, dict):
            return None
        else:
            if isinstance(value, torch.Tensor):
                found[index] = value
            index += 1
    return found


def _adjusted(func: Any, args: tuple, kwargs: dict, plan: _Plan) -> tuple[tuple, dict]:
    """The kernel's arguments with the plan's dtypes (written-to arguments never cast)."""
    written = _written_positions(func)
    flat = _flat_tensors(args, kwargs)
    if flat is not None and not _casts(flat, _targets(func, list(flat), plan)[0], written):
        return args, kwargs  # the common case: every input has its planned dtype already
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    targets, widening = _targets(func, tensors, plan)
    to_cast = _casts(leaves, targets, written)
    if not to_cast:
        return args, kwargs
    for i in to_cast:
        leaves[i] = _cast(leaves[i], targets[i])
    if widening:
        plan.faithful = False
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    if func in _HALF_TO_FLOAT and len(args) > 2 and args[2] is True:
        args = (*args[:2], False, *args[3:])  # the input has the plan's dtype now
    return args, kwargs


def _targets(func: Any, tensors: list[int], plan: _Plan) -> tuple[dict[int, Any], bool]:
    """The dtype each tensor argument (by leaf position) should have under ``plan``, and
    whether that widens an inner kernel's inputs (the value is then not the plan's own)."""
    if plan.compute is not None:
        return dict.fromkeys(tensors, plan.compute), False
    if func is plan.same_op and len(tensors) == len(plan.inputs):
        # the node's own kernel: each input gets its planned dtype back (autocast's casts,
        # where the policy makes none, undone)
        return dict(zip(tensors, plan.inputs, strict=True)), False
    wide = promoted([d for d in plan.inputs if isinstance(d, torch.dtype)])
    return (dict.fromkeys(tensors, wide) if wide is not None else {}), True


def _casts(
    leaves: Mapping[int, Any] | list[Any], targets: dict[int, Any], written: set[int]
) -> list[int]:
    """The leaf positions whose tensor must be cast to its target dtype (``leaves`` indexed
    by position: the flat scan's tensors, or pytree's leaves)."""
    return [
        i
        for i, dtype in targets.items()
        if isinstance(dtype, torch.dtype)
        and dtype in CASTABLE
        and leaves[i].dtype in CASTABLE
        and leaves[i].dtype != dtype
        and i not in written
    ]


# CUDA runs softmax(fp16 x, dtype=float32), as CUDA autocast calls it, as one kernel,
# _softmax(x, dim, half_to_float=True), which takes only a 16-bit input: once the plan casts
# x, the kernel is the plain one, computing in x's dtype
_HALF_TO_FLOAT = frozenset({torch.ops.aten._softmax.default, torch.ops.aten._log_softmax.default})


def _cast(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A cast under the fake-tensor mode, below every tracer: the aten kernel itself, with
    torch-function modes (the tracer's own among them) out of the way."""
    with torch._C.DisableTorchFunction(), torch._C._AutoDispatchBelowAutograd():
        return torch.ops.aten._to_copy.default(value, dtype=dtype)


def _written_positions(func: Any) -> set[int]:
    """Flat argument positions a kernel writes in place (``self`` of ``add_``)."""
    op_schema = getattr(func, "_schema", None)
    if op_schema is None or not op_schema.is_mutable:
        return set()
    return {
        i
        for i, argument in enumerate(op_schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    }


class capture_under_policy:
    """While active, a forward of ``model`` under ``torch.export`` runs in a
    :class:`PolicyDtypeMode` and a :class:`CompositePromoteMode`, entered when the forward
    starts (the pre-dispatch tracer is known then) and left when it returns or raises.

    The forward is wrapped through an instance attribute, removed on exit: module hooks
    cannot do this, since torch skips ``always_call`` forward hooks on an exception while
    export traces, and a mode left on the stack would unbalance export's own modes. Where
    no pre-dispatch tracer is found (another tracer, another torch), the forward runs as
    before and the log says so.
    """

    def __init__(self, model: nn.Module, policy: Policy, low: torch.dtype) -> None:
        self.model, self.policy, self.low = model, policy, low
        self.widening_casts: set[str] = set()
        self.dtype_reads: set[str] = set()  # node names (CompositePromoteMode)
        self.aliases: set[str] = set()  # node names of aliases before no-op casts (same)
        self.checkpointed: dict[str, int] = {}  # node name -> checkpoint region
        self.plan_records: dict[str, tuple[Any, torch.dtype | None, tuple[Any, ...]]] = {}
        self.reentrant_checkpoint = False
        self._had_forward = False
        self._own_forward: Any = None

    def _forward(self, forward: Any, *args: Any, **kwargs: Any) -> Any:
        tracer = proxy_tracer()
        if tracer is None:
            log.warning(
                "amp_graph: no pre-dispatch tracer found; the model's Python sees "
                "torch.autocast's dtypes during capture, not the policy's"
            )
            return forward(*args, **kwargs)
        user_inputs = traced_nodes(pytree.tree_leaves((args, kwargs)), tracer)
        dtypes = PolicyDtypeMode(tracer, self.model, self.policy, self.low, user_inputs)
        try:
            with (
                dtypes,
                CompositePromoteMode(
                    tracer,
                    self.policy,
                    self.widening_casts,
                    self.dtype_reads,
                    self.aliases,
                    dtypes.planned_dtype,
                ),
            ):
                return forward(*args, **kwargs)
        finally:
            if dtypes.seen is not None:  # the nodes after the last kernel that asked
                dtypes._catch_up_to_end()
            self.plan_records.update(dtypes.records)
            self.checkpointed.update(dtypes.checkpointed)
            self.reentrant_checkpoint |= dtypes.reentrant_checkpoint

    def __enter__(self) -> capture_under_policy:
        self._had_forward = "forward" in self.model.__dict__
        self._own_forward = self.model.__dict__.get("forward")
        forward = self.model.forward
        self.model.forward = functools.wraps(forward)(functools.partial(self._forward, forward))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._had_forward:
            self.model.forward = self._own_forward
        else:
            del self.model.forward


class half_model_view:
    """Apex O2/O3's "the model is half", for the capture only: while active, each float32
    parameter the policy stores in the low dtype is replaced, in its module, by a low-dtype
    parameter of the same shape (uninitialized: capture reads only its dtype and shape).

    So model code that reads a parameter's dtype (T5's ``.to(self.wo.weight.dtype)``, its
    layer norm's ``if self.weight.dtype in (float16, bfloat16)``, HF's ``self.dtype``) takes
    the branch it takes on a half model. Kept float32, as Apex keeps them: parameters of
    modules the policy computes in float32 (norms in O2's tables, fp32 module overrides).
    Buffers are not touched. Tied parameters stay tied. Everything is put back on exit;
    the captured graph reads the real parameters by name, so nothing of the stand-ins
    survives the capture (their memory, half the model's float32 parameters, is freed).
    """

    def __init__(self, model: nn.Module, policy: Policy, low: torch.dtype) -> None:
        self.model, self.policy, self.low = model, policy, low
        self.swapped: list[tuple[nn.Module, str, nn.Parameter]] = []

    def _stores_low(self, path: str, module: nn.Module) -> bool:
        paths, types = [""], [type(self.model)]
        parts = path.split(".") if path else []
        for i in range(len(parts)):
            prefix = ".".join(parts[: i + 1])
            paths.append(prefix)
            types.append(type(self.model.get_submodule(prefix)))
        op = python_ops.aten_name_of(type(module))
        facts = OpFacts(
            "", type(module).__name__, (), (op,) if op else (), tuple(paths), tuple(types)
        )
        return self.policy.decide(facts).rule is Rule.ALLOW

    def __enter__(self) -> half_model_view:
        stand_ins: dict[int, nn.Parameter] = {}
        for path, module in self.model.named_modules():
            for name, param in list(module._parameters.items()):
                if param is None or param.dtype != torch.float32:
                    continue
                if id(param) not in stand_ins:
                    if not self._stores_low(path, module):
                        continue
                    stand_ins[id(param)] = nn.Parameter(
                        torch.empty_like(param, dtype=self.low),
                        requires_grad=param.requires_grad,
                    )
                module._parameters[name] = stand_ins[id(param)]
                self.swapped.append((module, name, param))
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, name, param in reversed(self.swapped):
            module._parameters[name] = param
        self.swapped = []


__all__ = [
    "PolicyDtypeMode",
    "capture_under_policy",
    "half_model_view",
    "mark_capture_plans",
    "mark_checkpoint_regions",
]
