"""``report`` and ``explain``: what the passes decided, per node, and why.

Inspection sits on top of the passes and the compiler: nothing below imports it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from html import escape
from typing import Any

import torch
import torch.fx as fx

from amp_graph.frontends.compiler import as_graph_module, compile_record
from amp_graph.frontends.front_door import CompileRecord
from amp_graph.monitoring.selection import is_default, is_quantization
from amp_graph.passes.classify import uncast_reads
from amp_graph.passes.meta import (
    AMP,
    FSDP_MIXED_PRECISION,
    FSDP_UNIT,
    AmpInfo,
    Role,
    inputs_behind_reads,
    short,
    users_through_reads,
)
from amp_graph.passes.recompute_casts import copy_dtype
from amp_graph.policy import Rule, nearest
from amp_graph.training.fsdp_plan import read_only_low

from .html import OPEN_ROWS, explanation_html
from .modules import node_modules
from .table_format import COLUMNS, badge, bytes_text, html_table
from .view import value_numel

RULE_MEANING = {
    Rule.ALLOW: "low precision",
    Rule.DENY: "float32",
    Rule.PROMOTE: "the widest floating input type",
    Rule.FOLLOW: "its inputs' dtypes (no casts)",
}


@dataclass
class NodeRow:
    """One node of the compiled graph, as the report shows it."""

    name: str
    op: str
    module: str
    role: str
    rule: str
    decided_by: str
    detail: str
    compute: str  # dtype inputs are cast to, "-" when none
    out: str  # output dtype ("?" when unproven without example inputs)
    casts_in: list[str] = field(default_factory=list)
    casts_out: list[str] = field(default_factory=list)

    def cells(self) -> tuple[str, ...]:
        """The row as the report's table shows it (columns: :data:`COLUMNS`)."""
        return (
            self.name,
            self.op,
            self.module or "-",
            self.rule,
            self.decided_by,
            self.compute,
            self.out,
            ", ".join(self.casts_in) or "-",
        )


@dataclass
class Report:
    """Per-node decisions plus totals. ``print(report)`` for a table, or view it in Jupyter."""

    policy: str
    dtype: str
    exact: bool
    rows: list[NodeRow]
    casts_inserted: int
    casts_removed: int
    casts_kept: int
    cast_bytes: int | None  # bytes read + written by the kept casts per call; None: unknown
    ops_by_dtype: dict[str, int]
    casts_recomputed: int = 0  # casts backward makes again instead of keeping
    # per call, the bytes no longer held: their copies', less widened copies' kept sources
    recomputed_cast_bytes: int = 0
    # casts it could recompute and keeps, where that does not pay (recompute_casts="auto"
    # or a minimum size), and the device's figures it weighed ("": none measured)
    casts_recompute_declined: int = 0
    recompute_cost: str = ""
    casts_absorbed: int = 0  # widening casts folded into the op's dtype= (absorb_casts)
    outputs_cast: int = 0  # of casts_inserted, those returning outputs in float32
    absorbed_cast_bytes: int = 0  # the float32 copies those casts made, per call
    # the cast placement (passes.place_casts, O2): free ops it raised to float32, and the
    # cast bytes per call (forward and backward, as the cut costs them) before and after
    ops_moved_up: int = 0
    placed_cast_bytes_before: int = 0
    placed_cast_bytes_after: int = 0
    placed_casts_before: int = 0  # casts forward, as the cut counts them
    placed_casts_after: int = 0
    # FSDP2 units whose MixedPrecisionPolicy the graph honours: unit path -> its fields
    fsdp_mixed_precision: dict[str, str] = field(default_factory=dict)
    # FSDP2 units (no param_dtype yet) whose every parameter read is a cast to the low
    # dtype: param_dtype there halves their all-gathers and changes no value
    fsdp_read_low: list[str] = field(default_factory=list)
    # matrix products and convolutions: how many, those computing in float32 (or
    # float64), each with the reason its rule gives: node name -> detail, and how many
    # compute in each low dtype (an fp8 product in its operands' float8 format)
    products: int = 0
    wide_products: dict[str, str] = field(default_factory=dict)
    low_products: dict[str, int] = field(default_factory=dict)
    # products the policy cannot cast (float64, integers): name -> "<dtype>: why"; neither
    # float32 nor low, whatever their rule says
    uncast_products: dict[str, str] = field(default_factory=dict)
    # under an fp8 policy, each linear-like GEMM: node name -> why it is fp8 or not
    fp8_gemms: dict[str, str] = field(default_factory=dict)
    graph_module: fx.GraphModule | None = field(default=None, repr=False, compare=False)

    def row(self, name: str) -> NodeRow:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(
            f"no node {name!r} in the report.{nearest(name, [r.name for r in self.rows])}"
        )

    def totals(self) -> str:
        per_dtype = ", ".join(f"{k}: {v}" for k, v in sorted(self.ops_by_dtype.items()))
        return (
            f"policy {self.policy}, low dtype {self.dtype}; ops by output dtype: {per_dtype}\n"
            f"casts inserted {self.casts_inserted}{_outputs_text(self.outputs_cast)}, "
            f"removed by simplification {self.casts_removed}, absorbed into an op's dtype= "
            f"{self.casts_absorbed} "
            f"({bytes_text(self.absorbed_cast_bytes)}), kept {self.casts_kept}; bytes cast per "
            f"call: {bytes_text(self.cast_bytes)}\n"
            f"casts recomputed in backward instead of kept: {self.casts_recomputed} "
            f"({bytes_text(self.recomputed_cast_bytes)} not held from forward to backward)"
            + _declined_text(self.casts_recompute_declined, self.recompute_cost)
            + _placement_text(self)
            + _products_text(
                self.products, self.wide_products, self.low_products, self.uncast_products
            )
            + _fp8_text(self.fp8_gemms)
            + _fsdp_text(self.fsdp_mixed_precision)
            + _read_low_text(self.fsdp_read_low, self.dtype)
        )

    def __str__(self) -> str:
        headers = COLUMNS
        table = [headers] + [r.cells() for r in self.rows]
        widths = [max(len(str(line[i])) for line in table) for i in range(len(headers))]
        lines = [
            "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
            for line in table
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join([*lines, "", self.totals()])

    def __repr__(self) -> str:  # IPython's text form: short, as DataFlow's and Diff's
        return (
            f"<Report of {len(self.rows)} nodes: policy {self.policy}, {self.dtype}; casts "
            f"kept {self.casts_kept}>"
        )

    def _repr_html_(self) -> str:
        return report_html(self)

    # Views of the compiled module, from amp_graph.inspect (imported on first use).

    def _compiled(self) -> fx.GraphModule:
        if self.graph_module is None:
            raise ValueError("this Report holds no compiled module; use amp_graph.report(compiled)")
        return self.graph_module

    def diff(self, before: fx.GraphModule | None = None) -> Any:
        """What the passes added, removed and changed: an :class:`amp_graph.inspect.Diff`
        against ``before`` (by default the graph as captured, before the passes)."""
        from amp_graph.inspect import diff

        return diff(self._compiled()) if before is None else diff(before, self._compiled())

    def dataflow(self, depth: int | None = None) -> Any:
        """Per module: ops per dtype, bytes cast forward and backward
        (:func:`amp_graph.inspect.dataflow`)."""
        from amp_graph.inspect import dataflow

        return dataflow(self._compiled(), depth)

    def draw(self, **options: Any) -> Any:
        """The compiled graph as an SVG; options as :func:`amp_graph.inspect.draw`."""
        from amp_graph.inspect import draw

        return draw(self._compiled(), **options)


def _products_text(
    products: int, wide: dict[str, str], low: dict[str, int], uncast: dict[str, str]
) -> str:
    """One line, one more per float32 product and per product the policy cannot cast (the
    first few of each): where the GEMMs run, each in the dtype it computes in."""
    if not products:
        return ""
    if len(low) == 1:
        where = f"in {next(iter(low))}"
    elif not low:
        where = "low"
    else:  # e.g. fp8 with its first and last layers in bf16
        where = "low: " + ", ".join(f"{n} in {dtype}" for dtype, n in sorted(low.items()))
    text = f"\nmatrix products and convolutions: {sum(low.values())} of {products} {where}"
    text += _first_few(wide, "in float32:", "more (Report.wide_products)")
    return text + _first_few(uncast, "in", "more (Report.uncast_products)")


_WIDE_SHOWN = 5


def _first_few(reasons: dict[str, str], what: str, rest: str) -> str:
    """A line per node (the first :data:`_WIDE_SHOWN`), ``name what why``, and one for the
    rest: ``and N rest``."""
    shown = list(reasons.items())[:_WIDE_SHOWN]
    text = "".join(f"\n  {name} {what} {why}" for name, why in shown)
    if len(reasons) > len(shown):
        text += f"\n  and {len(reasons) - len(shown)} {rest}"
    return text


def fp8_gemms(gm: fx.GraphModule) -> dict[str, str]:
    """Each linear-like GEMM the fp8 pass decided: the fp8 linears with the decision's reason
    (``"fp8: ..."``), and the layers it kept with theirs (``"not fp8: ..."``)."""
    out = {}
    for node in gm.graph.nodes:
        amp = node.meta.get(AMP)
        if amp is None or node.op != "call_function":
            continue
        if str(node.target) == "amp_graph.fp8_linear.default":
            out[node.name] = amp.detail
        elif "not fp8: " in amp.detail:
            out[node.name] = amp.detail[amp.detail.index("not fp8: ") :]
    return out


def _fp8_text(gemms: dict[str, str]) -> str:
    """One line, and one more per GEMM kept in bf16 (the first few), with why."""
    if not gemms:
        return ""
    kept = {name: why for name, why in gemms.items() if why.startswith("not fp8")}
    text = f"\nfp8 GEMMs: {len(gemms) - len(kept)} of {len(gemms)} in float8 (Report.fp8_gemms)"
    return text + _first_few(kept, "kept:", "more kept")


def wide_products(
    gm: fx.GraphModule,
) -> tuple[int, dict[str, str], dict[str, int], dict[str, str]]:
    """The matrix products and convolutions of a compiled graph (as the monitor selects them
    by default, less its fp8 quantizations): how many; those computing in float32, with
    their rule's reason; how many compute in each low dtype (:func:`product_dtype`); and
    those reading nothing the policy casts (float64, integers), ``"<dtype>: why"``."""
    count, wide, low, uncast = 0, {}, Counter(), {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not is_default(node) or is_quantization(node):
            continue
        count += 1
        computes = product_dtype(node)
        amp: AmpInfo = node.meta[AMP]
        if computes == torch.float32:
            wide[node.name] = amp.detail or str(amp.rule)
        elif computes == torch.float64 or (
            isinstance(computes, torch.dtype) and not computes.is_floating_point
        ):
            reads = uncast_reads(node)
            why = _uncast_reason(reads) if reads is not None else amp.detail or str(amp.rule)
            uncast[node.name] = f"{short(computes)}: {why}"
        else:
            low[short(computes)] += 1
    return count, wide, dict(low), uncast


def _reads_text(reads: list) -> str:
    """What a node reads that no policy casts (:func:`uncast_reads`): ``"i64, fp64"``."""
    return ", ".join(dict.fromkeys(short(d) for d in reads)) or "no tensor"


def _uncast_reason(reads: list) -> str:
    """Why a node's rule casts nothing, in a phrase."""
    return f"not cast: it reads no floating-point value the policy casts ({_reads_text(reads)})"


def product_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype a matrix product or convolution computes in: its float8 operands' format
    (an fp8 linear, ``_scaled_mm``), else the dtype its rule gave it."""
    for arg in node.args:
        info = arg.meta.get(AMP) if isinstance(arg, fx.Node) else None
        dtype = info.out_dtype if info is not None else None
        if dtype is not None and dtype.is_floating_point and dtype.itemsize == 1:
            return dtype
    amp: AmpInfo = node.meta[AMP]
    return amp.compute_dtype or amp.out_dtype


def _fsdp_text(units: dict[str, str]) -> str:
    """What a user's FSDP2 ``MixedPrecisionPolicy`` means for the plan."""
    if not units:
        return ""
    listed = "; ".join(f"{unit}: {fields}" for unit, fields in units.items())
    return (
        f"\nFSDP2 MixedPrecisionPolicy honoured ({listed}). param_dtype: those units "
        "all-gather their parameters in it and the graph reads them so (ops the policy "
        "computes in float32 read them upcast, rounded to param_dtype); cast_forward_inputs "
        "and output_dtype: casts at the units' boundaries, in the graph as the capture "
        "recorded them; reduce_dtype: the gradients' reduce-scatter."
    )


def _read_low_text(units: list[str], dtype: str) -> str:
    if not units:
        return ""
    torch_dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype)
    return (
        f"\nFSDP2 units whose parameters every op reads in {dtype}: {', '.join(units)}. "
        f"fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.{torch_dtype}, "
        "reduce_dtype=torch.float32, cast_forward_inputs=False)) on them all-gathers half "
        "the bytes and changes no value; amp_graph.plan_fsdp(model, units, ...) gives each "
        "unit its policy before sharding."
    )


def fsdp_units_read_low(gm: fx.GraphModule, low: torch.dtype) -> list[str]:
    """FSDP2 units without a ``param_dtype`` whose every parameter read in ``gm`` is a cast
    to ``low``: all-gathering them in ``low`` computes every value as before."""
    honoured = gm.meta.get(FSDP_MIXED_PRECISION, {})
    reads: dict[str, list[bool]] = {}
    for node in gm.graph.nodes:
        unit = node.meta.get(FSDP_UNIT)
        if node.op != "get_attr" or unit is None:
            continue
        reads.setdefault(unit or "<root>", []).append(read_only_low(node, low))
    return [
        unit
        for unit, read_low in reads.items()
        if all(read_low) and "param_dtype" not in honoured.get(unit, "")
    ]


def cast_bytes(gm: fx.GraphModule) -> int | None:
    """Bytes read plus bytes written by the graph's casts per call, when shapes are known."""
    total = 0
    for node in gm.graph.nodes:
        amp: AmpInfo = node.meta[AMP]
        if amp.role is not Role.CAST:
            continue
        source = node.args[0]
        numel, dtypes = value_numel(source), (source.meta[AMP].out_dtype, amp.out_dtype)
        if numel is None or not all(isinstance(d, torch.dtype) for d in dtypes):
            return None
        total += numel * sum(d.itemsize for d in dtypes)
    return total


NOT_CAST = "not cast"  # a row's rule where the node reads nothing the policy casts


def _row(node: fx.Node, module: str) -> NodeRow:
    amp: AmpInfo = node.meta[AMP]
    casts_in = [a.name for a in inputs_behind_reads(node) if a.meta[AMP].role is Role.CAST]
    casts_out = [u.name for u in users_through_reads(node) if u.meta[AMP].role is Role.CAST]
    rule, decided_by, detail = str(amp.rule), amp.source, amp.detail
    if amp.role is not Role.OP:
        rule = str(amp.role)
    elif (reads := uncast_reads(node)) is not None:  # its rule applies to nothing it reads
        rule, decided_by = NOT_CAST, "input dtypes"
        detail = f"{_uncast_reason(reads)}; its {amp.rule} rule ({amp.source}) does not apply"
    return NodeRow(
        name=node.name,
        op=amp.op or node.op,
        module=module,
        role=str(amp.role),
        rule=rule,
        decided_by=decided_by,
        detail=detail,
        compute=short(amp.compute_dtype) if amp.compute_dtype else "-",
        out=short(amp.out_dtype),
        casts_in=casts_in,
        casts_out=casts_out,
    )


def _placement_text(report: Report) -> str:
    """The cast placement's line, where it ran (its counters are there)."""
    if not report.placed_cast_bytes_before:
        return ""
    return (
        f"\ncast placement (an exact minimum cut): {report.ops_moved_up} free ops raised to "
        f"float32; casts {report.placed_casts_before} -> {report.placed_casts_after}, bytes "
        f"per call, forward and backward: {bytes_text(report.placed_cast_bytes_before)} -> "
        f"{bytes_text(report.placed_cast_bytes_after)}"
    )


def report(compiled: Any) -> Report:
    """Per node: dtype, the rule and what decided it, casts in and out; plus totals.

    >>> import torch, amp_graph
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    >>> r = amp_graph.report(amp_graph.compile(m, example_inputs=(torch.randn(2, 4),)))
    >>> r.row("linear").out, r.casts_kept
    ('bf16', 3)
    """
    compiled = as_graph_module(compiled)
    record: CompileRecord = compile_record(compiled)
    modules = node_modules(compiled)
    rows = [_row(n, modules[n.name]) for n in compiled.graph.nodes]
    ops = Counter(
        r.out for r in rows if r.role in (str(Role.OP), str(Role.USER_CAST), str(Role.INPLACE))
    )
    products, wide, low, uncast = wide_products(compiled)
    return Report(
        policy=record.policy.name,
        dtype=short(record.dtype),
        exact=record.exact,
        rows=rows,
        casts_inserted=record.stats.get("casts_inserted", 0),
        casts_removed=record.stats.get("casts_removed", 0),
        casts_kept=sum(r.role == str(Role.CAST) for r in rows),
        cast_bytes=cast_bytes(compiled),
        ops_by_dtype=dict(ops),
        casts_recomputed=record.stats.get("casts_recomputed", 0),
        casts_absorbed=record.stats.get("casts_absorbed", 0),
        outputs_cast=record.stats.get("outputs_cast", 0),
        absorbed_cast_bytes=record.stats.get("absorbed_cast_bytes", 0),
        recomputed_cast_bytes=record.stats.get("recomputed_cast_bytes", 0),
        casts_recompute_declined=record.stats.get("casts_recompute_declined", 0),
        ops_moved_up=record.stats.get("ops_moved_up", 0),
        placed_cast_bytes_before=record.stats.get("placed_cast_bytes_before", 0),
        placed_cast_bytes_after=record.stats.get("placed_cast_bytes_after", 0),
        placed_casts_before=record.stats.get("placed_casts_before", 0),
        placed_casts_after=record.stats.get("placed_casts_after", 0),
        recompute_cost=record.recompute_cost.describe() if record.recompute_cost else "",
        fsdp_mixed_precision=dict(compiled.meta.get(FSDP_MIXED_PRECISION, {})),
        fsdp_read_low=fsdp_units_read_low(compiled, record.dtype),
        products=products,
        wide_products=wide,
        low_products=low,
        uncast_products=uncast,
        fp8_gemms=fp8_gemms(compiled) if record.policy.fp8 is not None else {},
        graph_module=compiled,
    )


def _find(compiled: fx.GraphModule, name: str, modules: dict[str, str]) -> fx.Node:
    """The node called ``name``; a KeyError that helps find the right one otherwise."""
    for node in compiled.graph.nodes:
        if node.name == name:
            return node
    ops = [
        n.name
        for n in compiled.graph.nodes
        if modules[n.name] == name and n.meta[AMP].role in (Role.OP, Role.USER_CAST, Role.INPLACE)
    ]
    if ops:  # a module path: nodes are aten ops named by export (linear, linear_1, ...)
        listed = ", ".join(repr(n) for n in ops[:8]) + (", ..." if len(ops) > 8 else "")
        raise KeyError(
            f"{name!r} is a module, not a node of the compiled graph; its ops are {listed}. "
            "Explain one of them (amp_graph.report lists every node with its module)."
        )
    names = [n.name for n in compiled.graph.nodes]
    raise KeyError(
        f"no node named {name!r} in the compiled graph.{nearest(name, names)} "
        "amp_graph.report(compiled) lists the nodes."
    )


class Explanation(str):
    """What :func:`explain` returns: a ``str``, one sentence per line; notebooks show it
    formatted, with dtype badges."""

    def _repr_html_(self) -> str:
        return explanation_html(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # IPython: the text, unquoted
        printer.text(str(self))


def _declined_text(declined: int, cost: str) -> str:
    """The casts backward could recompute and keeps, where that does not pay."""
    if not declined:
        return ""
    why = f" ({cost})" if cost else ""
    return f"; kept where recomputing does not pay: {declined}{why}"


def _recompute_sentence(cast: fx.Node, amp: AmpInfo) -> str:
    """What backward keeps of a cast (passes.recompute_casts decided it)."""
    source = cast.args[0]
    if amp.recompute_declined:
        return (
            f"\nBackward keeps this cast where an op saves it, though its source "
            f"'{source.name}' outlives the forward: {amp.recompute_declined}"
        )
    if not amp.recompute:
        return (
            f"\nBackward keeps this cast where an op saves it: its source '{source.name}' is "
            "not known to outlive the forward (or Policy(recompute_casts=False))."
        )
    numel, dtype = value_numel(source), copy_dtype(cast)
    size = f" ({bytes_text(numel * dtype.itemsize)})" if numel is not None else ""
    if amp.recompute == "smaller":
        return (
            f"\nIt is not kept for backward{size}: backward keeps its narrower source "
            f"'{source.name}' in its place and widens it again where it needs it (exact: "
            "the same bits), so the value is not held twice."
        )
    why = (
        "a parameter or buffer, which the module keeps"
        if amp.recompute == "module"
        else "a result its op's backward saves anyway"
    )
    return (
        f"\nIt is not kept for backward{size}: its source '{source.name}' is {why}, so "
        "backward casts it again where it needs it (the same bits)."
    )


def explain(compiled: Any, node_name: str) -> Explanation:
    """Why ``node_name`` has its dtype, one sentence per line.

    Node names are those of the graph (``print(compiled)``, :func:`report`): aten ops
    named by torch.export (``linear``, ``linear_1``, ``softmax``), parameters
    (``model_0_weight``) and casts (``linear_fp32``). A module path is not a node; the
    error for one lists the module's ops.

    >>> import torch, amp_graph
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
    >>> c = amp_graph.compile(m, example_inputs=(torch.randn(2, 4),))
    >>> print(amp_graph.explain(c, "softmax").splitlines()[0])
    'softmax' (aten.softmax.int in module '1') returns fp32.
    """
    compiled = as_graph_module(compiled)
    modules = node_modules(compiled)
    node = _find(compiled, node_name, modules)
    amp: AmpInfo = node.meta[AMP]
    module = modules[node.name]
    where = f" in module '{module}'" if module else ""
    out = short(amp.out_dtype)
    if amp.role is Role.CAST:
        source = node.args[0]
        return Explanation(
            f"'{node.name}' is a cast amp_graph inserted: it converts '{source.name}' "
            f"({short(source.meta[AMP].out_dtype)}) to {short(node.args[1])} for "
            f"{', '.join(repr(c) for c in amp.cast_for)}.\n{amp.detail}."
            + _recompute_sentence(node, amp)
        )
    if amp.role is Role.RUNTIME:
        return Explanation(
            f"'{node.name}' ({amp.op}) is a node of amp_graph's runtime (the training step, "
            f"a monitor's probe, a shared cast's read), not a precision decision: {amp.detail}."
        )
    text = [f"'{node.name}' ({amp.op}{where}) returns {out}."]
    casts_in = [a for a in inputs_behind_reads(node) if a.meta[AMP].role is Role.CAST]
    uncast = uncast_reads(node)
    decided = (
        amp.role is Role.OP and amp.rule is not None and amp.source != "fixed" and uncast is None
    )
    if uncast is not None:  # a rule that casts, on values no policy casts: it decides nothing
        text.append(_uncast_sentence(amp, uncast, out))
    elif amp.role is Role.OP and amp.source == "fixed":  # views, getitem: what the op is decides
        text.append(
            f"Its rule is {Rule.FOLLOW.value}, fixed by what it is: {amp.detail}. No policy "
            "or override reclassifies it; its consumers' rules decide the casts around it."
        )
    elif decided and amp.source == "placement":
        text.append(f"It computes in float32: {amp.detail}.")
    elif decided:
        text.append(
            f"Its rule is {amp.rule.value}: compute in {RULE_MEANING[amp.rule]}, decided "
            f"by {_decider(amp.source)}: {amp.detail}."
        )
        if amp.cast_absorbed:
            text.append(
                f"It widens its input to {short(amp.compute_dtype)} itself, by its dtype= "
                "argument: the cast amp_graph inserted is absorbed into the op (torch defines "
                "dtype= as that cast, applied first)."
            )
        elif amp.compute_dtype is not None:
            already = "" if casts_in else " (they already are: no cast needed)"
            text.append(f"Its floating inputs are cast to {short(amp.compute_dtype)}{already}.")
    else:
        text.append(f"It is not reclassified: {amp.detail}.")
    if amp.recompute:  # the model's own cast, or an fp8 quantization, of a kept value
        text.append(_recompute_sentence(node, amp).strip())
    if casts_in:
        text.append(
            "Casts feeding it: "
            + ", ".join(
                f"'{c.name}' ({short(c.args[0].meta[AMP].out_dtype)} -> {short(c.args[1])})"
                for c in casts_in
            )
            + "."
        )
    casts_out = [u for u in users_through_reads(node) if u.meta[AMP].role is Role.CAST]
    if casts_out:
        text.append(
            "Its output is cast by "
            + ", ".join(f"'{c.name}' (to {short(c.args[1])})" for c in casts_out)
            + "."
        )
    if amp.source == "fp8" and amp.role is Role.OP and "fp8" in node.name:
        linear = node.name.removesuffix("_fp8")
        text.append(
            "To keep this layer in bf16: Policy.preset('fp8').with_fp8(module_filter=...) "
            f"returning False for module '{amp.module_path}', or an fp32 override of the layer "
            f"(Policy.override(nodes={{'{linear}': 'fp32'}}) or its module path), which "
            "outranks fp8."
        )
    elif decided and amp.source == "placement":
        text.append(
            f"To keep it low: Policy.override(nodes={{'{node.name}': 'low'}}) (an explicit rule "
            "is a constraint the placement keeps), or Policy(place_casts=False) for none."
        )
    elif decided:
        other = "low" if amp.rule is Rule.DENY else "fp32"
        text.append(
            f"To change it: Policy.override(nodes={{'{node.name}': '{other}'}}) or an op, "
            "module type or module path override (priority: default < op tables < op "
            "< module type < module path < node)."
        )
    return Explanation("\n".join(text))


def _decider(source: str) -> str:
    """What decided a rule, in words: the model's own autocast block, or a policy level."""
    if source == "autocast region":
        return "the model's own torch.autocast block"
    return f"the {source} level"


def _uncast_sentence(amp: AmpInfo, reads: list, out: str) -> str:
    """The truth about a casting rule on a node that reads nothing a policy casts."""
    return (
        f"Not cast: it reads no floating-point value the policy casts (it reads "
        f"{_reads_text(reads)}; only float16, bfloat16 and float32 are cast, as by "
        "torch.autocast), so its "
        f"{amp.rule.value} rule, from {_decider(amp.source)} ({amp.detail}), does not apply: "
        f"torch computes it in {out} as the model wrote it. No override changes that; "
        + ("a cast of its inputs in the model does." if reads else "its dtype= argument does.")
    )


def _outputs_text(outputs_cast: int) -> str:
    """The inserted casts that return outputs in float32 (``Policy.output_dtype``)."""
    return f" ({outputs_cast} returning outputs in fp32: output_dtype)" if outputs_cast else ""


def report_summary_html(report: Report) -> str:
    """The report's totals: policy, ops per output dtype, casts and bytes."""
    per_dtype = " ".join(f"{badge(k, k)}&nbsp;{v}" for k, v in sorted(report.ops_by_dtype.items()))
    proven = "" if report.exact else " (dtypes not proven)"
    return (
        '<div style="font-family:sans-serif;font-size:13px;margin-bottom:4px">'
        f"<b>amp_graph report</b>: policy <b>{escape(report.policy)}</b>, low dtype "
        f"{badge(report.dtype, report.dtype)}{proven}<br>ops by output dtype: {per_dtype}<br>"
        f"casts inserted {report.casts_inserted}{_outputs_text(report.outputs_cast)}, "
        f"removed by simplification {report.casts_removed}, absorbed into an op's dtype= "
        f"{report.casts_absorbed} "
        f"({bytes_text(report.absorbed_cast_bytes)}), kept "
        f"<b>{report.casts_kept}</b>; bytes cast per call: "
        f"{bytes_text(report.cast_bytes)}</div>"
    )


def report_html(report: Report) -> str:
    """The report as a notebook shows it: totals, then the per-node table (folded when
    long); dtypes as badges, inserted casts on a gold background."""
    headers = COLUMNS
    rows = [r.cells() for r in report.rows]

    def render(column: int, value: object) -> str:
        text = str(value)
        return badge(text, text) if column in (5, 6) else escape(text)

    def row_style(index: int) -> str:
        return "background:#fff8db" if report.rows[index].role == "cast" else ""

    table = html_table(headers, rows, render, row_style)
    state = " open" if len(rows) <= OPEN_ROWS else ""
    return (
        f"<div>{report_summary_html(report)}<details{state}><summary>per-node table "
        f"({len(rows)} nodes)</summary>{table}</details></div>"
    )
