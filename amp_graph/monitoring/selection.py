"""Which nodes the monitor measures: a default set, or selectors with a policy's meaning.

The default is what Transformer Engine's debug tools watch, for every op rather than TE's
own layers: each matrix product and convolution, and each fp8 quantization. A user's
``nodes=`` names nodes the way a :class:`~amp_graph.Policy`'s overrides do (op names or
callables, module path globs, module types, node names), and means exactly what they mean
there: the selection is a policy whose overrides are those selectors, and a node is
measured where an override, not a table, decides it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.fx as fx

from amp_graph.ops.recompute_ops import recomputed_quantize
from amp_graph.passes.classify import op_facts
from amp_graph.passes.instrument import region_graphs
from amp_graph.passes.meta import AMP, Role, model_root
from amp_graph.policy import Policy, Rule, nearest, op_key_name

# schema names of the ops measured by default
DEFAULT_OPS: frozenset[str] = frozenset(
    {
        "aten::linear",
        "aten::matmul",
        "aten::mm",
        "aten::bmm",
        "aten::addmm",
        "aten::baddbmm",
        "aten::addbmm",
        "aten::einsum",
        "aten::conv1d",
        "aten::conv2d",
        "aten::conv3d",
        "aten::convolution",
        "aten::conv_transpose1d",
        "aten::conv_transpose2d",
        "aten::conv_transpose3d",
        "aten::_scaled_mm",
        "amp_graph::fp8_linear",
        "amp_graph::fp8_quantize",
    }
)
# the Policy fields a selection may name, each an iterable of selectors
SELECTOR_FIELDS = ("ops", "modules", "module_types", "nodes")


def _schema_name(node: fx.Node) -> str:
    target = node.target
    return target._schema.name if isinstance(target, torch._ops.OpOverload) else ""


def is_default(node: fx.Node) -> bool:
    """A matrix product, convolution or fp8 quantization (a weight's included)."""
    return _schema_name(node) in DEFAULT_OPS or node.target is recomputed_quantize


def is_quantization(node: fx.Node) -> bool:
    """An fp8 quantization (measured by default, but no matrix product)."""
    return _schema_name(node) == "amp_graph::fp8_quantize" or node.target is recomputed_quantize


class NodeSelection:
    """``nodes=None``: :func:`is_default`. Otherwise a mapping from :data:`SELECTOR_FIELDS`
    to iterables of selectors, as the Policy fields of the same names take them::

        {"ops": ["matmul", torch.nn.functional.linear], "modules": ["blocks.*.mlp"],
         "module_types": [torch.nn.Conv2d], "nodes": ["linear_3"]}

    A node is measured where any selector matches it.
    """

    def __init__(self, nodes: Mapping[str, Iterable[Any]] | None) -> None:
        self.policy: Policy | None = None
        if nodes is None:
            return
        if not isinstance(nodes, Mapping):
            raise TypeError(
                "monitor nodes= is None (every matrix product, convolution and fp8 "
                "quantization) or a mapping of selectors, e.g. "
                f"{{'modules': ['blocks.*.mlp'], 'ops': ['matmul']}}; got {nodes!r}"
            )
        fields: dict[str, dict[Any, Rule]] = {}
        for key, selectors in nodes.items():
            if key not in SELECTOR_FIELDS:
                raise ValueError(
                    f"monitor nodes= has no selector {key!r}; it takes "
                    f"{', '.join(SELECTOR_FIELDS)}.{nearest(str(key), SELECTOR_FIELDS)}"
                )
            if isinstance(selectors, str) or not isinstance(selectors, Iterable):
                raise TypeError(
                    f"monitor nodes[{key!r}] is a list of selectors, e.g. [{selectors!r}]; "
                    f"got {selectors!r}"
                )
            fields[key] = dict.fromkeys(selectors, Rule.ALLOW)
        if not any(fields.values()):
            raise ValueError("monitor nodes= selects nothing: give at least one selector")
        self.policy = Policy(name="monitor selection", **fields)

    def validate(self, gm: fx.GraphModule) -> None:
        """A ValueError for a selector that selects no node of ``gm`` (or of a region it
        calls), naming the nearest: module globs and node names as a policy checks them,
        each op and module type by asking :meth:`predicate` with that selector alone."""
        policy = self.policy
        if policy is None:
            return
        graphs = [gm, *(getattr(gm, name) for name in region_graphs(gm))]
        nodes = [node for graph in graphs for node in graph.graph.nodes]
        policy.validate_modules([path for path, _ in model_root(gm).named_modules()])
        policy.validate_nodes([node.name for node in nodes])
        ops = [node for node in nodes if _is_op(node)]
        known = {
            "ops": sorted({node.meta[AMP].op for node in ops if node.meta[AMP].op}),
            "module_types": sorted({op_key_name(type(m)) for m in model_root(gm).modules()}),
        }
        for field in ("ops", "module_types"):
            for key in getattr(policy, field):
                alone = NodeSelection({field: [key]}).predicate(gm)
                if not any(alone(node) for node in ops):
                    name = repr(key) if isinstance(key, str) else op_key_name(key)
                    raise ValueError(
                        f"monitor nodes={{{field!r}: [{name}]}} selects no op of this graph."
                        f"{nearest(name, known[field])} Its {_KNOWN[field]}: "
                        f"{', '.join(known[field])}"
                    )

    def predicate(self, gm: fx.GraphModule) -> Callable[[fx.Node], bool]:
        """Whether to measure a node of ``gm`` (or of a region ``gm`` calls)."""
        policy = self.policy
        if policy is None:
            return is_default
        known: dict[str, type] = {}

        def selected(node: fx.Node) -> bool:
            if not _is_op(node):
                return False
            facts = op_facts(node, gm, known)
            return policy.decide(facts).source != "default"

        return selected


_KNOWN = {"ops": "ops", "module_types": "modules' types (exact: a subclass is its own type)"}


def _is_op(node: fx.Node) -> bool:
    """A node a selection may measure: an op of the graph, not a cast or a parameter."""
    amp = node.meta.get(AMP)
    return node.op == "call_function" and amp is not None and amp.role is Role.OP
