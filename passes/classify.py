"""classify: give every node its policy rule and record what decided it.

Reads: the captured aten graph, ``node.meta["nn_module_stack"]`` (written by the
capture), the policy. Writes: ``node.meta["amp"]`` (an :class:`AmpInfo` with ``role``,
``op``, ``aten``, ``module_path``, ``rule``, ``source``, ``detail``).

Guarantees: every node has ``meta["amp"]``; every ``OP`` node has a rule; casts the model
wrote (``x.float()``) and in-place ops are marked so that no later pass casts them. The
graph itself is not changed.
"""

from __future__ import annotations

import functools
import logging
import operator
import re
import sys
import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from amp_graph.policy import Decision, OpFacts, Policy, Rule, op_key_name, python_ops

from . import schema
from .meta import (
    AMP,
    KEPT_FUNCTION,
    NO_MODULE,
    REGION,
    UNKNOWN,
    AmpInfo,
    DtypeFact,
    Role,
    is_castable,
    model_root,
    sets_a_dtype,
    tensor_facts,
)
from .regions import AutocastRegion
from .result import PassResult

log = logging.getLogger(__name__)

# Norms that update running statistics in place (a BatchNorm module is captured as
# aten.batch_norm): a cast would update a copy. Their kernels take low-precision
# input with float32 statistics, so "allow" casts nothing, as for the modules.
_STATEFUL_NORM_FUNCTIONS = frozenset({"batch_norm", "instance_norm"})


def module_stack(
    node: fx.Node, gm: nn.Module, known_types: dict[str, type] | None = None
) -> tuple[tuple[str, ...], tuple[type, ...]]:
    """Enclosing module paths (outermost first, the root as ``""``) and their types.

    ``known_types``: path -> type of the modules already looked up, for one walk over a
    graph (its nodes name the same modules again and again).
    """
    root = model_root(gm)
    known = {} if known_types is None else known_types
    paths, types = [""], [type(root)]
    for value in (node.meta.get("nn_module_stack") or {}).values():
        path, mtype = value[0], value[1]
        path = normalize_module_path(path)
        if not path:
            continue  # the root itself (export records it)
        if isinstance(mtype, str):  # export and some torch versions record the type's name
            if path not in known:
                known[path] = _submodule_type(root, path, mtype)
            mtype = known[path]
        paths.append(path)
        types.append(mtype)
    return tuple(paths), tuple(types)


@functools.lru_cache(maxsize=8192)  # a pure function of a string; graphs repeat their paths
def normalize_module_path(path: str) -> str:
    """Dynamo's ``L['self'].blocks[0].attn`` and ``L__self___blocks_0`` -> ``blocks.0.attn``.

    The root is whatever variable held the compiled module: ``L['self']``, ``L['fn']``
    (torch.nn containers compiled directly) or ``G['model']`` (a global a function uses).
    """
    path = re.sub(r"^[LG]\['[^']*'\]\.?", "", path)
    path = re.sub(r"^self\.?", "", path)
    path = re.sub(r"^_export_root(\.|$)", "", path)  # torch.export's tracing wrapper
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    path = re.sub(r"(^|\.)_modules\.", r"\1", path)
    return path.strip(".")


def lifted_source_name(node: fx.Node) -> str:
    """The name of the source dynamo lifted a placeholder from
    (``L['self']._modules['bn']._buffers['running_mean']``), or "" for none."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", "")
    name = name() if callable(name) else name
    return name if isinstance(name, str) else ""


def _is_lifted(node: fx.Node, *kinds: str) -> bool:
    value = node.meta.get("val", node.meta.get("example_value"))
    name = lifted_source_name(node)
    return isinstance(value, nn.Parameter) or any(f"._{kind}[" in name for kind in kinds)


def is_model_state(node: fx.Node) -> bool:
    """A placeholder holding a parameter or buffer: dynamo lifts module state to graph inputs.

    Known from the example value (an ``nn.Parameter``) or dynamo's ``meta["grapharg"]``
    source (``L['self']._modules['bn']._buffers['running_mean']``). Such inputs are never
    cast at entry (policy ``cast_inputs``): ops cast them as they cast ``get_attr`` state.
    """
    return _is_lifted(node, "parameters", "buffers")


def is_model_parameter(node: fx.Node) -> bool:
    """A placeholder holding a parameter (not a buffer) of the model (see is_model_state)."""
    return _is_lifted(node, "parameters")


def _submodule_type(root: nn.Module, path: str, recorded: str) -> type:
    """The type of the module at ``path``: the model's, else the class the graph recorded by
    name (``torch.nn.modules.linear.Linear``) where it is imported, else ``nn.Module`` with a
    WARNING, since a ``Policy(module_types=...)`` override then cannot match its ops."""
    if path == NO_MODULE:
        return nn.Module  # no module: torch 2.15's export marks a node it found outside any
    try:
        return type(root.get_submodule(path))
    except (AttributeError, TypeError):
        pass
    named = _imported_module_class(recorded)
    if named is not None:
        return named
    log.warning(
        "amp_graph: the graph names module %r of type %s, which neither the model nor an "
        "imported module has; a Policy(module_types=...) override does not reach its ops "
        "(a module path override does). amp_graph.explain(compiled) shows what each op got.",
        path,
        recorded,
    )
    return nn.Module


def _imported_module_class(name: str) -> type | None:
    """The nn.Module subclass ``name`` (``pkg.module.Class``, or ``<class '...'>``) names in a
    module already imported, or None: nothing is imported or run to find it."""
    name = re.sub(r"^<class '(.*)'>$", r"\1", name.strip())
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        found: Any = sys.modules.get(".".join(parts[:split]))
        if found is None:
            continue
        for attr in parts[split:]:
            found = getattr(found, attr, None)
        if isinstance(found, type) and issubclass(found, nn.Module):
            return found
    return None


def _function_facts(target: Any) -> tuple[str, tuple[Any, ...], tuple[str, ...]]:
    """(display, keys, aten candidates) for a call_function node.

    Captured graphs call aten ops; their other calls (``operator.getitem``, SymInt
    arithmetic, ``torch._C._set_grad_enabled``) compute no tensor the policy decides, and
    are matched by their own key only.
    """
    if not isinstance(target, torch._ops.OpOverload):
        return op_key_name(target), (target,), ()
    base = target._schema.name.split("::", 1)[-1]
    name = base if target._overloadname == "default" else f"{base}.{target._overloadname}"
    keys = (target, target.overloadpacket)
    return f"aten.{name}", keys, (name, *_builtin_candidates(base)[1:])


def _builtin_candidates(name: str) -> tuple[str, ...]:
    """An ATen builtin's own name, then the listed ops it aliases or runs."""
    candidates = (
        name,
        *python_ops.BUILTIN_ALIASES.get(name, ()),
        *python_ops.ATEN_COMPOSITES.get(name, ()),
    )
    if name.startswith(python_ops.SPECIAL_PREFIX):
        candidates += (name[len(python_ops.SPECIAL_PREFIX) :],)
    return candidates


_INPLACE_DETAIL = "writes into {written}: an in-place op is never cast, so the write reaches it"
_USER_CAST_DETAIL = "a cast written in the model: kept as written"
_VIEW_DETAIL = (
    "a view of {viewed}: never cast, so that a write through the view reaches the viewed value; "
    "its consumers cast it"
)
_GETITEM_DETAIL = "selects an element or a slice: never cast; its consumers cast it"
_FUNCTION_DETAIL = (
    "a custom autograd.Function ({name}), kept whole so that its own backward runs: its "
    "inputs as they come (torch.autocast casts none of a Function's inputs), its forward "
    "{autocast}, as the capture saw it"
)
# aten ops that are the model's own casts (x.float(), x.to(torch.bfloat16), x.type_as(y)).
_ATEN_CASTS = frozenset({"aten::to", "aten::_to_copy", "aten::type_as"})


def _names(nodes: list[fx.Node]) -> str:
    return ", ".join(repr(n.name) for n in nodes) or "its argument"


def _fixed_aten_role(node: fx.Node, op: torch._ops.OpOverload) -> tuple[Role, str, str] | None:
    """Roles an aten op's schema decides: casts, in-place writes, views, non-tensor results."""
    display = op_key_name(op)
    if op._schema.name in _ATEN_CASTS:
        return Role.USER_CAST, display, _USER_CAST_DETAIL
    if schema.is_mutating(node):
        detail = _INPLACE_DETAIL.format(written=_names(schema.written_inputs(node)))
        return Role.INPLACE, display, detail
    if not schema.returns_tensor(op):
        return Role.OTHER, display, "returns no tensor: not cast"
    if schema.is_view(node):
        return Role.OP, display, _VIEW_DETAIL.format(viewed=_names(schema.viewed_inputs(node)))
    return None


def _fixed_role(node: fx.Node) -> tuple[Role, str, str] | None:
    """(role, op, detail) for nodes no policy reclassifies, else None.

    In-place ops, views, element picks, the model's own casts and calls that return no
    tensor keep their inputs as they are, whatever the policy says. aten ops are read from
    their schema (:mod:`passes.schema`).
    """
    op = schema.overload(node)
    if op is not None:
        return _fixed_aten_role(node, op)
    if node.target is operator.getitem:
        return Role.OP, "getitem", _GETITEM_DETAIL
    if (kept := node.meta.get(KEPT_FUNCTION)) is not None:
        name, autocast = kept
        return Role.OP, f"{name}.apply", _FUNCTION_DETAIL.format(name=name, autocast=autocast)
    return None


def _op_facts(node: fx.Node, paths: tuple[str, ...], types: tuple[type, ...]) -> OpFacts:
    """What the policy looks up: the op's keys, aten candidates and enclosing modules."""
    display, keys, aten = _function_facts(node.target)
    return OpFacts(node.name, display, keys, aten, paths, types)


def enclosing_modules(
    node: fx.Node, gm: nn.Module, known_types: dict[str, type] | None = None
) -> tuple[tuple[str, ...], tuple[type, ...]]:
    """:func:`module_stack` with the modules that hold the called ones but were never called
    themselves (an ``nn.ModuleList`` or ``nn.ModuleDict``, a module whose children the
    parent calls directly), each just outside the module it holds.

    So a policy's ``modules={"blocks": ...}`` and ``module_types={nn.ModuleList: ...}``
    reach every op under ``blocks``, as the user means; innermost still wins (``blocks.0``
    over ``blocks``). Only paths the model has are added. FSDP placement asks
    :func:`module_stack` instead: a module never called runs no hooks."""
    paths, types = module_stack(node, gm, known_types)
    root = model_root(gm)
    known = {} if known_types is None else known_types
    called = set(paths)
    out_paths: list[str] = []
    out_types: list[type] = []
    for path, mtype in zip(paths, types, strict=True):
        for holder in _holders(path):
            if holder in called or holder in out_paths:
                continue
            holder_type = _held_module_type(root, holder, known)
            if holder_type is not None:
                out_paths.append(holder)
                out_types.append(holder_type)
        out_paths.append(path)
        out_types.append(mtype)
    return tuple(out_paths), tuple(out_types)


def _holders(path: str) -> list[str]:
    """``"blocks.0.attn"`` -> ``["blocks", "blocks.0"]``: the paths that contain it."""
    parts = path.split(".") if path else []
    return [".".join(parts[:end]) for end in range(1, len(parts))]


def _held_module_type(root: nn.Module, path: str, known: dict[str, type]) -> type | None:
    """The type of the model's module at ``path``, or None where the model has none."""
    if path not in known:
        try:
            known[path] = type(root.get_submodule(path))
        except (AttributeError, TypeError):
            return None  # a path recorded by export in a root without it: not cached
    return known[path]


def op_facts(node: fx.Node, gm: nn.Module, known_types: dict[str, type] | None = None) -> OpFacts:
    """What a policy looks up for the call ``node``: its keys, aten candidates and enclosing
    modules (relative to ``gm``, as for :func:`enclosing_modules`). Anything that matches
    nodes the way a policy does (the monitor's selection) asks this."""
    paths, types = enclosing_modules(node, gm, known_types)
    return _op_facts(node, paths, types)


def _refine(decision: Decision, node: fx.Node, facts: OpFacts) -> Decision:
    """The few cases where the table's answer would be wrong for this particular call."""
    aten = facts.aten[0] if facts.aten else None
    if decision.source == "table" and decision.rule is Rule.DENY and sets_a_dtype(node):
        return Decision(
            Rule.FOLLOW,
            "fixed",
            "the call sets dtype= itself; autocast leaves such calls alone, and so does amp_graph",
        )
    if decision.rule is Rule.ALLOW and aten in _STATEFUL_NORM_FUNCTIONS:
        return Decision(
            Rule.FOLLOW,
            "fixed",
            f"{decision.detail}; but {aten} updates running "
            "statistics in place and takes low-precision input with float32 "
            "statistics, so amp_graph casts none of its inputs",
        )
    return decision


def _in_region(
    decision: Decision, facts: OpFacts, region: AutocastRegion, policy: Policy
) -> Decision:
    """The model's own ``torch.autocast`` block replaces the table level: nothing is cast
    inside ``enabled=False``; inside an enabled block the policy's tables apply (those of
    torch.autocast for the block's device when the policy casts nothing, as O0), in the
    block's dtype.

    Guarantees: every table or default decision inside a block has source
    ``"autocast region"``, so that explain names the block, and no later rule (O2's float32
    islands) undoes what the block decided, as torch.autocast's own block would not.
    Overrides the user wrote still win."""
    if decision.source not in ("table", "default"):
        return decision
    if not region.enabled:
        return Decision(
            Rule.FOLLOW,
            "autocast region",
            f"inside {region} in the model's code: torch.autocast casts nothing there, and "
            "neither does amp_graph",
        )
    if policy.casts_nothing:
        decision = Policy.preset("autocast", region.device_type).decide(facts)
    return Decision(
        decision.rule,
        "autocast region",
        f"inside {region} in the model's code, in its dtype: {decision.detail}",
    )


_FROM_META: Any = object()


def classify_node(
    node: fx.Node,
    gm: nn.Module,
    policy: Policy,
    region: AutocastRegion | None = _FROM_META,
    known_types: dict[str, type] | None = None,
) -> AmpInfo:
    """The record of one computing node: its role, and for ops the policy's rule.

    ``gm`` is the module the node's module paths are relative to (the captured
    GraphModule, or the user's model while it is being captured); ``region`` the model's
    own autocast block around the node (default: ``meta["amp_graph.autocast_region"]``);
    ``known_types`` as for :func:`module_stack`.
    """
    if node.op != "call_function":
        raise TypeError(
            f"classify takes the captured aten IR (call_function nodes); {node.name!r} is a "
            f"{node.op}: capture the model with amp_graph first"
        )
    paths, types = enclosing_modules(node, gm, known_types)
    fixed = _fixed_role(node)
    if fixed is not None:
        role, op, detail = fixed
        return AmpInfo.fixed(role, op, detail, module_path=paths[-1])
    facts = _op_facts(node, paths, types)
    decision = _refine(policy.decide(facts), node, facts)
    if region is _FROM_META:
        region = node.meta.get(REGION)
    if region is not None:
        decision = _in_region(decision, facts, region, policy)
    return AmpInfo(
        role=Role.OP,
        op=facts.display,
        aten=facts.aten[0] if facts.aten else None,
        module_path=facts.module_paths[-1],
        rule=decision.rule,
        source=decision.source,
        detail=decision.detail,
        low_dtype=region.dtype if region is not None and region.enabled else None,
    )


_CASTING_RULES = (Rule.ALLOW, Rule.DENY, Rule.PROMOTE)


def uncast_reads(node: fx.Node) -> list[DtypeFact] | None:
    """The dtypes a planned op reads when its rule would cast (allow, deny, promote) but
    nothing it reads can be: no float16, bfloat16 or float32 tensor among its inputs
    (integers, bool, float64; ``[]`` for a factory such as ``torch.ones``), each input's
    dtype proven. Such a rule changes nothing (a policy casts only those three dtypes, as
    torch.autocast does) and torch decides the dtype. None for every other node.

    Reads ``meta["amp"]`` of the node (role, rule, source, compute dtype) and the
    ``out_dtype`` of its inputs: ask after assign_dtypes. ``explain`` and ``report`` ask
    it, and the front door, for node overrides that can change nothing."""
    amp = node.meta.get(AMP)
    if (
        amp is None
        or amp.role is not Role.OP
        or amp.rule not in _CASTING_RULES
        or amp.source in ("fixed", "fp8")  # an fp8 GEMM's operands are its own quantizations
        or amp.compute_dtype is not None
    ):
        return None
    reads = [f for a in node.all_input_nodes for f in tensor_facts(_out_dtype(a))]
    if any(not isinstance(f, torch.dtype) or is_castable(f) for f in reads):
        return None  # castable, or not proven not to be
    return reads


def _out_dtype(node: fx.Node) -> DtypeFact:
    amp = node.meta.get(AMP)
    return amp.out_dtype if amp is not None else UNKNOWN


# Nodes that compute nothing: graph inputs, model state, the output. (role, op, detail)
_STRUCTURAL: dict[str, tuple[Role, str, str]] = {
    "state": (Role.PARAM, "input", "a parameter or buffer of the model, passed as a graph input"),
    "placeholder": (Role.INPUT, "input", "a graph input"),
    "get_attr": (Role.PARAM, "get_attr", "a parameter, buffer or constant of the model"),
    "output": (Role.OUTPUT, "output", "the graph's output"),
}


def classify(gm: fx.GraphModule, policy: Policy) -> PassResult:
    """Record each node's rule under ``meta["amp"]``; the graph is not changed.

    >>> import torch, amp_graph
    >>> from amp_graph.capture import capture_module
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Softmax(-1))
    >>> gm = capture_module(model, (torch.randn(1, 2),), {}, device_type="cpu",
    ...                     autocast_dtype=torch.bfloat16).graph_module
    >>> _ = classify(gm, amp_graph.Policy.preset("O1"))
    >>> [(n.name, str(n.meta["amp"].rule)) for n in gm.graph.nodes if n.op == "call_function"]
    [('linear', 'allow'), ('softmax', 'deny')]
    """
    counts: dict[str, int] = {}
    known_types: dict[str, type] = {}
    kept_float32: list[str] = []
    for node in gm.graph.nodes:
        kind = "state" if node.op == "placeholder" and is_model_state(node) else node.op
        if kind in _STRUCTURAL:
            role, op, detail = _STRUCTURAL[kind]
            amp = AmpInfo.fixed(role, op, detail)
        else:
            amp = classify_node(node, gm, policy, known_types=known_types)
            if amp.source == "cpu":
                kept_float32.append(f"{node.name} ({amp.aten})")
        node.meta[AMP] = amp
        key = f"rule_{amp.rule}"
        counts[key] = counts.get(key, 0) + 1
    if kept_float32:
        # the model would otherwise crash at its first step on this CPU: say so, once
        warnings.warn(
            f"amp_graph: this CPU has no low-precision kernel for {', '.join(kept_float32)}; "
            "they compute in float32 instead (amp_graph.explain(compiled, node) says why)",
            stacklevel=2,
        )
        counts["cpu_float32_fallbacks"] = len(kept_float32)
    return PassResult(gm, modified=False, stats=counts)
