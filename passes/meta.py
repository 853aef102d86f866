"""What the passes record on nodes, and the dtype facts they reason with.

Every pass communicates through one key, ``node.meta["amp"]``, holding an :class:`AmpInfo`.
Example values, where known, live under torch's own key ``node.meta["val"]`` (a
FakeTensor, or a pytree of them), as dynamo and export write it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
import torch.fx as fx

from amp_graph.ops.cast_reads import cast_read
from amp_graph.ops.recompute_ops import recomputed_cast
from amp_graph.policy import Rule

AMP = "amp"
VAL = "val"

# Every meta key amp_graph writes is defined here and named "amp_graph.*" (``meta["amp"]``,
# the passes' own, and torch's ``meta["val"]`` aside). Most are written by the capture
# (amp_graph.capture) and read by the passes: the IR's contract lives here, so that neither
# side imports the other for a name.
COMPILE_META = "amp_graph"
"""``gm.meta`` key: the :class:`~amp_graph.frontends.front_door.CompileRecord`, what the
passes did to the graph (written by the front door's ``rewrite``)."""
EXPORT_FACTS = "amp_graph.export_facts"
"""``gm.meta`` key: what torch.export said of the captured program beyond its graph (its shape
symbols' ranges, its call signature, its verifier), for amp_graph.deploy to make an
ExportedProgram of the rewritten graph without tracing it again."""
FSDP_MIXED_PRECISION = "amp_graph.fsdp_mixed_precision"
"""``gm.meta`` key: each FSDP2 unit's ``MixedPrecisionPolicy``, in words, where any unit has
one (:func:`amp_graph.capture.fsdp_units.mixed_precision`)."""
REGION = "amp_graph.autocast_region"
"""``node.meta`` key: the model's own ``torch.autocast`` / ``no_grad`` block a node ran in
(:class:`~amp_graph.passes.regions.AutocastRegion`), written by ``inline_regions``."""
MODEL_ROOT = "amp_graph.model_root"
"""``gm.meta`` key: the attribute of a captured GraphModule that holds the user's model (module
paths in ``nn_module_stack`` are relative to it)."""
NO_MODULE = "_empty_nn_module_stack_from_metadata_hook"
"""torch.export's stack entry for nodes created outside any module (``torch._export``)."""

CHECKPOINT_REGION = "amp_graph.checkpoint_region"
"""``node.meta`` key: the number of the ``torch.utils.checkpoint`` call computing the node."""

DTYPE_READ = "amp_graph.dtype_read"
"""``node.meta`` key, True: the model's Python read this value's low dtype while it was
captured (``x.dtype``, ``torch.finfo(x.dtype).min``, ``.to(x.dtype)``), so the graph may hold
constants and casts derived from it that no pass can tell from the model's own
(amp_graph.capture.planned_dtypes)."""

TRACED_NOOP_CAST = "amp_graph.traced_noop_cast"
"""``node.meta`` key, True: a cast the model wrote that changed no dtype where it was traced
with the model's own dtypes (the ``torch.compile`` backend: dynamo traces float32 where the
plan is low). Its target may be a dtype the model read from a tensor (``x.to(y.dtype)``),
which dynamo bakes in as a constant, so it never starts a float32 island
(:mod:`amp_graph.passes.float32_islands`)."""

ISLAND_START = "amp_graph.island_start"
"""``node.meta`` key, True: a float32 cast the model wrote of a value the plan made low, whose
input :mod:`amp_graph.passes.place_casts` raised to float32. The cast now changes nothing,
and it still starts the model's float32 island (:mod:`amp_graph.passes.float32_islands`)."""

CAPTURE_PLAN = "amp_graph.capture_plan"
"""``node.meta`` key: ``(op, compute dtype, dtype facts of node.all_input_nodes as the op
reads them, after the cast to the compute dtype)``, the decision under which the capture
computed the node's ``meta["val"]`` (amp_graph.capture.planned_dtypes). A pass that reaches the same
decision for the same op has its value already (assign_dtypes). assign_dtypes removes it
where it writes a value of its own, so that a re-plan (widen_parameters', place_casts')
never takes one plan's value for the capture's."""

FSDP_UNITS = "amp_graph.fsdp_units"
"""``gm.meta`` key: the module paths of the model's FSDP2 units (relative to the module the
graph's module paths name), outermost first. Written by the capture."""

FSDP_GATHERED_DTYPE = "amp_graph.fsdp_gathered_dtype"
"""``node.meta`` key on a parameter read: the dtype its FSDP2 unit all-gathers it in, where
the unit's ``MixedPrecisionPolicy`` sets ``param_dtype`` (the model holds it sharded in its
own dtype). Written by the capture."""

STORED_DTYPE = "amp_graph.stored_dtype"
"""``node.meta`` key on a parameter read: the dtype the parameter is stored in when the graph
runs, where the plan chose it and the module still holds another (O2's low copy of a float32
master that the plan reads only in float32: :mod:`amp_graph.passes.widen_parameters`)."""

WIDENED_PARAMETERS = "amp_graph.widened_parameters"
"""``gm.meta`` key: the targets of the parameters the plan stores in float32 instead of their
low copies (:mod:`amp_graph.passes.widen_parameters`); whoever holds the copies stores them so
before the graph runs."""

FSDP_PLANNED = "amp_graph.fsdp_planned"
"""``node.meta`` key on a parameter read with :data:`FSDP_GATHERED_DTYPE`: the policy and dtype
``amp_graph.plan_fsdp`` planned that all-gather for (``"O1, bf16"``), where it did. Written by
the capture."""

FSDP_UNIT = "amp_graph.fsdp_unit"
"""``node.meta`` key on a parameter read: the path of the FSDP2 unit that shards it."""

FP8_OF = "amp_graph.fp8_of"
"""``node.meta`` key on an fp8 linear (``amp_graph.fp8_linear``): the name of the captured
node it stands for, the one node overrides name (``linear``, where the graph says
``linear_fp8``). Written by :mod:`passes.fp8_linears`."""

KEPT_FUNCTION = "amp_graph.kept_function"
"""``node.meta`` key on a node that calls a custom ``torch.autograd.Function`` kept whole
(:mod:`amp_graph.capture.autograd_functions`): the Function's ``"module.QualName"`` and the
autocast state its ``apply`` runs under, in words. Written by the capture."""


def model_root(gm: torch.nn.Module) -> torch.nn.Module:
    """The module the graph's module paths name: the user's model for captured graphs."""
    attr = getattr(gm, "meta", {}).get(MODEL_ROOT) if isinstance(gm, fx.GraphModule) else None
    return gm.get_submodule(attr) if attr else gm


class Role(str, Enum):
    """What a node is, from the passes' point of view."""

    INPUT = "input"  # placeholder
    PARAM = "param"  # get_attr of a parameter or buffer
    OP = "op"  # a computation the policy classifies
    CAST = "cast"  # a cast amp_graph inserted
    USER_CAST = "user_cast"  # a cast the model's code wrote: kept as written
    INPLACE = "inplace"  # writes into its first argument: never cast
    OTHER = "other"  # returns no tensor: aten.sym_size, aten.item, aten._assert_scalar
    RUNTIME = "runtime"  # a call added after the passes (the training step's stages): never planned
    OUTPUT = "output"

    def __str__(self) -> str:
        return self.value


class Marker:
    """A sentinel known only by its name, equal to itself alone (compared by identity)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


UNKNOWN: Any = Marker("UNKNOWN")
"""A dtype not known yet: ``out_dtype`` before assign_dtypes ran, or, during capture, a
value whose planned dtype the capture has not seen."""

NOT_TENSOR: Any = Marker("NOT_TENSOR")
"""A value that is not a tensor (a size, a dtype, a Python number)."""

DtypeFact = Any  # torch.dtype | UNKNOWN | NOT_TENSOR | tuple/list of DtypeFact

# The one definition of the low-precision pair and of what amp_graph casts between: the
# capture, the passes and the front door all read these.
LOW_PRECISION = (torch.float16, torch.bfloat16)
CASTABLE = (*LOW_PRECISION, torch.float32)
"""torch.autocast casts floating tensors except float64; integers and bools never."""


@dataclass
class AmpInfo:
    """The record each pass reads and extends, under ``node.meta["amp"]``.

    Written by classify: ``role``, ``op``, ``aten``, ``module_path``, ``rule``, ``source``,
    ``detail``, ``low_dtype`` (inside the model's own autocast block). Written by
    assign_dtypes: ``compute_dtype``, ``out_dtype``, ``exact``. Cast
    nodes written by insert_casts carry ``role=CAST``, ``cast_for`` and ``out_dtype``;
    recompute_casts sets ``recompute`` on those backward casts again instead of keeping
    (``recompute_declined`` on those it could and keeps, saying why);
    absorb_casts sets ``cast_absorbed`` on ops that widen their input by their ``dtype=``.
    """

    role: Role
    op: str = ""  # readable op: "aten.softmax.int", "getitem"
    aten: str | None = None  # the aten op name the policy looked up
    module_path: str = ""  # innermost enclosing module at capture time
    rule: Rule | None = None
    source: str = ""  # what decided the rule: "table", "default", "node", ...
    detail: str = ""  # one sentence on why
    compute_dtype: torch.dtype | None = None  # floating inputs are cast to this; None: none
    out_dtype: DtypeFact = UNKNOWN
    exact: bool = False  # out_dtype comes from example values (FakeTensor propagation)
    cast_for: tuple[str, ...] = field(default_factory=tuple)  # CAST: the consumers it feeds
    low_dtype: torch.dtype | None = None  # the model's autocast block's dtype; None: policy's
    recompute: str = ""  # CAST recast in backward, not kept: who keeps its source ("module")
    recompute_declined: str = ""  # a cast recompute_casts could recast and keeps: why
    cast_absorbed: bool = False  # OP widens its input itself, by its dtype= (absorb_casts)

    @classmethod
    def fixed(cls, role: Role, op: str, detail: str = "", **fields: Any) -> AmpInfo:
        """A node no policy reclassifies: rule FOLLOW, decided by its kind ("fixed")."""
        return cls(role=role, op=op, rule=Rule.FOLLOW, source="fixed", detail=detail, **fields)

    @classmethod
    def inserted_cast(cls, detail: str, consumer: str, **fields: Any) -> AmpInfo:
        """A cast amp_graph inserted for ``consumer``: takes its input as it is (FOLLOW)."""
        return cls(
            role=Role.CAST,
            op="cast",
            rule=Rule.FOLLOW,
            source="inserted",
            detail=detail,
            cast_for=(consumer,),
            **fields,
        )


def has_cast_role(node: fx.Node) -> bool:
    """A node the plan made a cast (``Role.CAST``), in any form: ``x.to(dtype)``, a
    recomputed cast or quantize, or the aten copy an export lowers it to."""
    amp = node.meta.get(AMP)
    return amp is not None and amp.role is Role.CAST


def is_dtype_cast(node: fx.Node) -> bool:
    """A cast amp_graph inserted to a dtype, as the pipeline writes it: ``x.to(dtype)`` or
    :func:`~amp_graph.ops.recompute_ops.recomputed_cast` (not a quantize, not aten's copy)."""
    return has_cast_role(node) and (node.op, node.target) in (
        ("call_method", "to"),
        ("call_function", recomputed_cast),
    )


def is_cast_read(node: fx.Node) -> bool:
    """A consumer's read of a shared cast (:func:`~amp_graph.ops.cast_reads.cast_read`):
    the cast's values, a route for the consumer's gradient; the tools that show the plan
    look through it."""
    return node.op == "call_function" and node.target is cast_read


def behind_reads(node: fx.Node) -> fx.Node:
    """``node``, or the cast behind it where it is a :func:`is_cast_read`."""
    while is_cast_read(node):
        node = node.args[1]  # type: ignore[assignment]
    return node


def inputs_behind_reads(node: fx.Node) -> list[fx.Node]:
    """``node``'s input nodes, each read of a shared cast as that cast."""
    return list(dict.fromkeys(behind_reads(a) for a in node.all_input_nodes))


def users_through_reads(node: fx.Node) -> list[fx.Node]:
    """``node``'s users, each read of a shared cast as the consumers it serves."""
    found: list[fx.Node] = []
    for user in node.users:
        found.extend(users_through_reads(user) if is_cast_read(user) else [user])
    return list(dict.fromkeys(found))


def info(node: fx.Node) -> AmpInfo:
    """The node's AmpInfo; a clear error if classify has not run on this graph."""
    try:
        return node.meta[AMP]
    except KeyError:
        raise RuntimeError(
            f"node {node.name!r} has no meta['amp']: run passes.classify before this pass"
        ) from None


FLOAT8 = frozenset(getattr(torch, n) for n in dir(torch) if n.startswith("float8_"))
"""Every float8 format this torch has (e4m3fn, e5m2, and the fnuz variants)."""

LOW_FLOATS = frozenset(LOW_PRECISION) | FLOAT8
"""The floating dtypes narrower than float32: float16, bfloat16 and every float8."""


def is_castable(dtype: DtypeFact) -> bool:
    return isinstance(dtype, torch.dtype) and dtype in CASTABLE


def short(dtype: DtypeFact) -> str:
    """``torch.bfloat16`` -> ``bf16``; pytrees and markers readable too."""
    names = {
        torch.float32: "fp32",
        torch.float16: "fp16",
        torch.bfloat16: "bf16",
        torch.float64: "fp64",
        torch.int64: "i64",
        torch.int32: "i32",
        torch.bool: "bool",
        torch.float8_e4m3fn: "e4m3",
        torch.float8_e5m2: "e5m2",
    }
    if isinstance(dtype, torch.dtype):
        return names.get(dtype, str(dtype).replace("torch.", ""))
    if isinstance(dtype, (tuple, list)):
        return "(" + ", ".join(short(d) for d in dtype) + ")"
    if dtype is UNKNOWN:
        return "?"
    return "-"


def tensor_facts(fact: DtypeFact) -> list[DtypeFact]:
    """The leaves of a fact pytree (tuples, lists, dicts) that may be tensors."""
    if isinstance(fact, dict):
        fact = list(fact.values())
    if isinstance(fact, (tuple, list)):
        return [leaf for f in fact for leaf in tensor_facts(f)]
    return [] if fact is NOT_TENSOR else [fact]


def cast_fact(fact: DtypeFact, dtype: torch.dtype) -> DtypeFact:
    """The dtype fact after autocast's cast to ``dtype``: castable tensors become ``dtype``,
    others stay; element by element in tuples, lists and dicts; unknown stays unknown."""
    if isinstance(fact, (tuple, list)):
        return type(fact)(cast_fact(f, dtype) for f in fact)
    if isinstance(fact, dict):
        return {k: cast_fact(f, dtype) for k, f in fact.items()}
    return dtype if is_castable(fact) else fact


# Which casts lose nothing: every value of `src` is exactly representable in `dst`.
LOSSLESS: frozenset[tuple[torch.dtype, torch.dtype]] = frozenset(
    {
        (torch.float16, torch.float32),  # fp16 -> fp32: exact
        (torch.bfloat16, torch.float32),  # bf16 -> fp32: exact
        (torch.float16, torch.float64),
        (torch.bfloat16, torch.float64),
        (torch.float32, torch.float64),
    }
)


def sets_a_dtype(node: fx.Node) -> bool:
    """The call names a dtype itself, positionally or by keyword (``softmax(x, 1,
    torch.float16)``, ``sum(x, dtype=torch.float32)``, ``_scaled_mm(..., out_dtype=...)``):
    its result's dtype is the argument's, not its inputs'. torch.autocast leaves such calls
    alone, and no pass may treat their dtype as following their inputs'."""
    args = [*node.args, *node.kwargs.values()]
    return any(isinstance(arg, torch.dtype) for arg in args)


def size_hint(size: int | torch.SymInt) -> int | None:
    """A size as an int: a symbolic one at its hint (the size its example was captured with),
    None where it has none."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return hint if isinstance(hint, int) else None
    return int(size)


def is_lossless(src: torch.dtype, dst: torch.dtype) -> bool:
    return src == dst or (src, dst) in LOSSLESS
