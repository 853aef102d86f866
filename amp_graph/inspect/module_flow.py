"""``dataflow``: per module, how many ops run in each dtype and how many bytes are cast.

A *conversion* is a copy of a tensor into another dtype. The bytes of one are the bytes it
reads plus the bytes it writes: ``numel * (source itemsize + target itemsize)``. Counted:

forward
    every cast amp_graph inserted, every cast the model wrote (``x.float()``,
    ``h.type_as(x)``) that changes the dtype, and every cast absorbed into a softmax's or
    log_softmax's ``dtype=`` (``softmax(x, -1, torch.float32)`` runs that cast as an aten
    ``_to_copy`` of its own; CUDA's fp16 softmax reads the narrow input directly, with no
    copy, and is not counted). A reduction's ``dtype=`` (``sum``, ``mean``) converts
    inside its kernel: no cast call, not counted;
backward
    each of those casts whose input needs a gradient has a backward that casts the
    gradient back (``ToCopyBackward``; for a reduction, autograd's cast of its gradient to
    the input's dtype): same tensor size, the two dtypes swapped, so the same bytes; a
    cast several consumers share converts each consumer's gradient on its own instead
    (its ``cast_read`` s, one conversion each); and
    an op whose output is wider than one of its floating inputs (``x_fp32 + y_bf16``,
    type promotion) returns its gradient in its output's dtype, which autograd casts to
    each narrower input's dtype. An input *wider* than the output
    is not promoted: kernels that take mixed dtypes by design (``aten.batch_norm`` of
    bfloat16 activations with float32 weights and statistics) return each gradient in its
    input's own dtype, with no conversion.

Not counted: the casts backward makes again of the copies it did not keep
(``recompute_casts``: at most one per recomputed cast, where an op saved the
copy; :func:`amp_graph.report` totals them and their bytes).

An input needs a gradient when it depends on a parameter that requires one (or on a graph
input whose example value requires one); every floating output is assumed to reach the
loss. Modules are those of :func:`~amp_graph.inspect.modules.node_modules` (a weight's
cast counts in the module owning the weight). Shapes come from the example values the
graph was captured with; a graph with symbolic sizes (captured for several input sizes)
has unknown bytes (``None``). ``tests/test_inspect_dataflow.py`` checks the totals against
the ``_to_copy`` calls PyTorch really makes, forward and backward.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from html import escape
from typing import Any

import torch
import torch.fx as fx

from amp_graph.frontends.compiler import as_graph_module
from amp_graph.passes.absorb_casts import copies_input
from amp_graph.passes.meta import AMP, FLOAT8, VAL, Role, is_cast_read, short, tensor_facts

from .modules import module_types, node_modules
from .style import DTYPE_CLASSES, node_class
from .table_format import UNKNOWN_BYTES, badge, html_table, text_table
from .view import OP_ROLES, value_numel

TOP_LEVEL = "(top level)"


@dataclass(frozen=True)
class Conversion:
    """One dtype conversion the compiled graph runs per call (forward and/or backward)."""

    node: str  # the cast, the model's cast, or the op whose gradient is converted
    module: str
    # "cast" (amp_graph's), "model cast", "absorbed cast", "fp8 quantize", or "promotion"
    kind: str
    source: str  # dtype converted from, in the forward direction
    target: str
    numel: int | None
    forward_bytes: int | None
    backward_bytes: int | None  # 0 when no gradient flows through it


@dataclass
class ModuleFlow:
    """One row of the summary: a module (at the chosen depth) or the total."""

    module: str
    type: str
    ops: Counter = field(default_factory=Counter)  # dtype class -> ops computing in it
    forward_casts: int = 0
    forward_bytes: int | None = 0
    backward_casts: int = 0
    backward_bytes: int | None = 0

    def add(self, conversion: Conversion) -> None:
        if conversion.forward_bytes != 0:
            self.forward_casts += 1
            self.forward_bytes = _plus(self.forward_bytes, conversion.forward_bytes)
        if conversion.backward_bytes != 0:
            self.backward_casts += 1
            self.backward_bytes = _plus(self.backward_bytes, conversion.backward_bytes)


def _plus(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a + b


@dataclass
class DataFlow:
    """Per-module op counts by dtype and conversions, forward and backward.

    ``rows`` (one per module, in graph order), ``total``, and ``conversions`` (each one).
    """

    rows: list[ModuleFlow]
    total: ModuleFlow
    conversions: list[Conversion]

    def columns(self) -> list[str]:
        """The dtype classes with at least one op, fp32 and the low dtype first."""
        return [c for c in DTYPE_CLASSES if self.total.ops[c]]

    def table(self) -> tuple[list[str], list[list[Any]]]:
        classes = self.columns()
        headers = [
            "module",
            "type",
            *[f"ops {c}" for c in classes],
            "casts fwd",
            "bytes fwd",
            "casts bwd",
            "bytes bwd",
        ]
        rows = [
            [
                r.module,
                r.type,
                *[r.ops[c] for c in classes],
                r.forward_casts,
                r.forward_bytes,
                r.backward_casts,
                r.backward_bytes,
            ]
            for r in [*self.rows, self.total]
        ]
        return headers, rows

    def summary(self) -> str:
        kinds = Counter(c.kind for c in self.conversions if c.backward_bytes != 0)
        t = self.total
        return (
            f"forward: {t.forward_casts} conversions, {_bytes(t.forward_bytes)}; backward: "
            f"{t.backward_casts} conversions, {_bytes(t.backward_bytes)} ("
            + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
            + ")"
        )

    def __repr__(self) -> str:
        return f"<DataFlow of {len(self.rows)} modules: {self.summary()}>"

    def __str__(self) -> str:
        headers, rows = self.table()
        return text_table(headers, rows) + "\n\n" + self.summary()

    def _repr_html_(self) -> str:
        headers, rows = self.table()
        last = len(rows) - 1
        table = html_table(
            headers, rows, row_style=lambda i: "font-weight:600" if i == last else ""
        )
        for c in self.columns():  # dtype headers as coloured badges
            table = table.replace(f">ops {c}<", f">ops {badge(c, c)}<")
        return f"<div>{table}<p>{escape(self.summary())}</p></div>"


def _bytes(value: int | None) -> str:
    return f"bytes {UNKNOWN_BYTES}" if value is None else f"{value:,} bytes"


def _size(bytes_per: int | None, *dtypes: Any) -> int | None:
    if bytes_per is None or not all(isinstance(d, torch.dtype) for d in dtypes):
        return None
    return bytes_per * sum(d.itemsize for d in dtypes)


def _floating(fact: Any) -> bool:
    return any(isinstance(f, torch.dtype) and f.is_floating_point for f in tensor_facts(fact))


def needs_grad(gm: fx.GraphModule) -> dict[str, bool]:
    """Node name -> whether its value depends on something that requires a gradient."""
    flags: dict[str, bool] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            # dynamo's own value of a lifted parameter keeps requires_grad; the aten
            # retrace's meta["val"] does not
            val = node.meta.get("example_value", node.meta.get(VAL))
            flags[node.name] = isinstance(val, torch.Tensor) and val.requires_grad
            continue
        if node.op == "get_attr":
            value: Any = gm
            for part in node.target.split("."):
                value = getattr(value, part)
            flags[node.name] = isinstance(value, torch.Tensor) and value.requires_grad
            continue
        inputs = any(flags.get(a.name, False) for a in node.all_input_nodes)
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            inputs = inputs or any(p.requires_grad for p in module.parameters())
        flags[node.name] = inputs and node.op != "output" and _floating(node.meta[AMP].out_dtype)
    return flags


def _promoted(fact: Any, out: torch.dtype) -> bool:
    """Whether autograd converts the gradient for a floating input of dtype ``fact`` of an op
    returning ``out``: only when the input is narrower (type promotion widened it)."""
    if not isinstance(fact, torch.dtype) or fact in FLOAT8 or out in FLOAT8:
        return False  # float8 values come from quantize nodes, never from type promotion
    return fact.is_floating_point and fact != out and torch.promote_types(fact, out) == out


def _copy(
    node: fx.Node,
    source: fx.Node,
    target: Any,
    kind: str,
    modules: dict[str, str],
    *,
    forward: bool,
    backward: bool | None,
) -> Conversion:
    """``node`` 's copy of ``source`` into ``target``: its bytes where it runs forward, and
    backward where a gradient flows back through it."""
    src = source.meta[AMP].out_dtype
    moved = _size(value_numel(source), src, target)
    return Conversion(
        node.name,
        modules[node.name],
        kind,
        short(src),
        short(target),
        value_numel(source),
        moved if forward else 0,
        moved if backward else 0,
    )


def conversions(gm: fx.GraphModule) -> list[Conversion]:
    """Every dtype conversion of the compiled graph, forward and backward (module docstring)."""
    grad = needs_grad(gm)
    modules = node_modules(gm)
    found: list[Conversion] = []
    for node in gm.graph.nodes:
        amp = node.meta[AMP]
        if amp.role in (Role.CAST, Role.USER_CAST) and node.all_input_nodes:
            source = node.all_input_nodes[0]
            src = source.meta[AMP].out_dtype
            if amp.role is Role.USER_CAST and (src == amp.out_dtype or not _floating(src)):
                continue  # .float() of a float32 tensor returns it: no copy
            kind = "cast" if amp.role is Role.CAST else "model cast"
            backward = grad.get(source.name)
            # a shared cast's consumers each convert their own gradient (cast_read), and
            # none reaches the copy
            reads = [user for user in node.users if is_cast_read(user)]
            found.append(
                _copy(
                    node,
                    source,
                    amp.out_dtype,
                    kind,
                    modules,
                    forward=True,
                    backward=backward and not reads,
                )
            )
            for read in reads:
                found.append(
                    _copy(
                        read, source, amp.out_dtype, kind, modules, forward=False, backward=backward
                    )
                )
        elif amp.cast_absorbed:  # the op widens its input itself (its dtype=)
            source = node.args[0]
            found.append(
                _copy(
                    node,
                    source,
                    amp.compute_dtype,
                    "absorbed cast",
                    modules,
                    forward=copies_input(node.target, source.meta[VAL]),
                    backward=grad.get(source.name),
                )
            )
        elif amp.role is Role.OP and amp.op == "fp8 quantize":
            # the quantized operand is saved for backward; no gradient flows through it
            source = node.all_input_nodes[0]
            kind = "fp8 quantize"
            found.append(
                _copy(node, source, amp.out_dtype, kind, modules, forward=True, backward=False)
            )
        elif (
            amp.role in (Role.OP, Role.INPLACE)
            and amp.op != "fp8 scale"  # a scale carries no gradient back to its input
            and isinstance(amp.out_dtype, torch.dtype)
            and amp.out_dtype.is_floating_point
        ):
            for arg in dict.fromkeys(node.all_input_nodes):
                fact = arg.meta[AMP].out_dtype
                if _promoted(fact, amp.out_dtype) and grad.get(arg.name):
                    found.append(
                        Conversion(
                            node.name,
                            modules[node.name],
                            "promotion",
                            short(fact),
                            short(amp.out_dtype),
                            value_numel(arg),
                            0,
                            _size(value_numel(arg), fact, amp.out_dtype),
                        )
                    )
    return found


def _group(path: str, depth: int | None) -> str:
    if depth is not None and path:
        path = ".".join(path.split(".")[:depth])
    return path or TOP_LEVEL


def dataflow(compiled: fx.GraphModule, depth: int | None = None) -> DataFlow:
    """The data-flow summary of a compiled module, one row per module.

    Args:
        compiled: what :func:`amp_graph.compile` returned.
        depth: group modules this many levels deep (``1``: ``attn``, ``blocks``; ``2``:
            ``blocks.0``); by default every innermost module has its row.

    >>> import torch, amp_graph
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    >>> flow = amp_graph.inspect.dataflow(amp_graph.compile(m, example_inputs=(torch.randn(2, 4),)))
    >>> flow.total.forward_casts, flow.total.forward_bytes, flow.total.backward_bytes
    (3, 168, 120)
    """
    compiled = as_graph_module(compiled)
    types = module_types(compiled)
    rows: dict[str, ModuleFlow] = {}

    def row(path: str) -> ModuleFlow:
        name = _group(path, depth)
        if name not in rows:
            rows[name] = ModuleFlow(name, types.get(name, "") if name != TOP_LEVEL else "")
        return rows[name]

    modules = node_modules(compiled)
    for node in compiled.graph.nodes:
        amp = node.meta[AMP]
        if amp.role in OP_ROLES and tensor_facts(amp.out_dtype):
            row(modules[node.name]).ops[node_class(amp)] += 1
    found = conversions(compiled)
    total = ModuleFlow("total", "")
    for conversion in found:
        row(conversion.module).add(conversion)
        total.add(conversion)
    for r in rows.values():
        total.ops.update(r.ops)
    return DataFlow(list(rows.values()), total, found)


__all__ = ["Conversion", "DataFlow", "ModuleFlow", "conversions", "dataflow", "needs_grad"]
