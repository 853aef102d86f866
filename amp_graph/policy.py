"""Precision policies: which ops compute in low precision, which in float32.

A :class:`Policy` is data. Its op tables hold aten op names (the names torch.autocast's
lists use); every graph node is mapped to the aten op autocast would see
(:mod:`amp_graph.tables.python_ops`) and looked up. On top of the tables come overrides,
in one priority order, lowest first::

    default rule  <  op tables  <  op overrides  <  module type  <  module path  <  node name

Within the module levels the innermost enclosing module wins. Each node records the rule
that decided it in ``node.meta["amp"]`` so that :func:`amp_graph.explain` can say why.

Example::

    >>> import torch.nn as nn, amp_graph
    >>> policy = amp_graph.Policy.preset("O1").override(modules={"head": "fp32"})
    >>> policy.name
    'O1+overrides'
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import torch
import torch.nn as nn

from amp_graph.tables import autocast_lists as lists
from amp_graph.tables import python_ops


class Rule(str, Enum):
    """How a node computes. The four categories of torch.autocast and TF's AMP pass."""

    ALLOW = "allow"  # low precision: floating inputs are cast to the policy dtype
    DENY = "deny"  # float32: floating inputs are cast to float32
    PROMOTE = "promote"  # floating inputs are cast to the widest floating input dtype
    FOLLOW = "follow"  # no casts: inputs as they come, torch's own type promotion

    def __str__(self) -> str:
        return self.value


KEEP_FP32 = Rule.DENY
"""The explicit way to say "keep this in float32" in an override."""

_RULE_ALIASES = {"low": Rule.ALLOW, "fp32": Rule.DENY, "float32": Rule.DENY}
PRESETS = ("O0", "O1", "O2", "O3", "autocast")

OpKey = str | Callable | type
"""An op in a policy table: an aten op name (``"softmax"``), a torch callable
(``torch.nn.functional.softmax``, ``torch.Tensor.softmax``) or a module type (``nn.LSTM``)."""


def base_name(aten_name: str) -> str:
    """``"softmax.int"`` -> ``"softmax"``: tables are keyed by op, not by overload."""
    return aten_name.split(".", 1)[0]


def _bases(names: Iterable[str]) -> frozenset[str]:
    return frozenset(base_name(n) for n in names)


def autocast_tables(device_type: str) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """torch.autocast's (lower precision, fp32, promote) lists for a device, by op name."""
    if device_type == "cpu":
        return (
            _bases(lists.CPU_LOWER_PRECISION),
            _bases(lists.CPU_FP32),
            _bases(lists.CPU_PROMOTE),
        )
    if device_type == "cuda":
        fp32 = lists.CUDA_FP32 | lists.CUDA_FP32_SET_OPT_DTYPE | lists.CUDA_BANNED
        return (
            _bases(lists.CUDA_LOWER_PRECISION | lists.CUDA_LOWER_PRECISION_EXTRA),
            _bases(fp32),
            _bases(lists.CUDA_PROMOTE),
        )
    raise ValueError(
        f"amp_graph knows torch.autocast's lists for 'cpu' and 'cuda', not {device_type!r}"
    )


def known_op_names() -> frozenset[str]:
    """Every aten op name the tables know, for validating string op keys."""
    names: set[str] = set()
    for device in ("cpu", "cuda"):
        for table in autocast_tables(device):
            names |= table
    for table in (python_ops.FUNCTIONS, python_ops.OPERATORS, python_ops.MODULES):
        for candidates in table.values():
            names |= _bases(candidates)
    return frozenset(names) | python_ops.NORMALIZATION_OPS


def nearest(word: str, options: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for an error message, or an empty string."""
    match = difflib.get_close_matches(word, list(options), n=1, cutoff=0.5)
    return f" Did you mean {match[0]!r}?" if match else ""


def as_rule(value: Rule | str) -> Rule:
    """Parse an override value; unknown strings raise ValueError naming the nearest one."""
    if isinstance(value, Rule):
        return value
    if isinstance(value, str):
        key = value.lower()
        if key in _RULE_ALIASES:
            return _RULE_ALIASES[key]
        try:
            return Rule(key)
        except ValueError:
            valid = [r.value for r in Rule] + list(_RULE_ALIASES)
            raise ValueError(
                f"unknown precision rule {value!r}; use one of {valid}.{nearest(key, valid)}"
            ) from None
    raise TypeError(
        f"a precision rule is a amp_graph.Rule or one of 'allow', 'deny', 'promote', "
        f"'follow', 'fp32', 'low'; got {value!r} of type {type(value).__name__}"
    )


def op_key_name(key: OpKey) -> str:
    """A readable name for an op key: ``F.softmax``, ``torch.cat``, ``Tensor.mm``, ``nn.LSTM``."""
    if isinstance(key, str):
        return key
    if isinstance(key, torch._ops.OpOverload):
        return f"aten.{key._schema.name.split('::')[-1]}.{key._overloadname}"
    if isinstance(key, torch._ops.OpOverloadPacket):
        return f"aten.{key._qualified_op_name.split('::')[-1]}"
    if isinstance(key, type):
        prefix = "nn" if key.__module__.startswith("torch.nn") else key.__module__
        return f"{prefix}.{key.__name__}"
    module = getattr(key, "__module__", None) or ""
    name = getattr(key, "__name__", None) or repr(key)
    qualname = getattr(key, "__qualname__", None) or name
    if qualname.startswith(("TensorBase.", "Tensor.")):
        return f"Tensor.{name}"
    short = {
        "torch.nn.functional": "F",
        "torch._C._nn": "F",
        "_operator": "operator",
        "torch.functional": "torch",
        "torch._C._linalg": "torch.linalg",
        "torch._C._fft": "torch.fft",
        "torch._C._special": "torch.special",
    }
    if module in short or module == "torch":
        return f"{short.get(module, module)}.{name}"
    return f"{module}.{qualname}" if module else qualname


def _check_op_key(key: OpKey) -> None:
    if isinstance(key, str):
        names = known_op_names()
        if base_name(key) not in names:
            raise ValueError(
                f"unknown op name {key!r} in a policy table; op names are aten op names such "
                f"as 'softmax' or 'linear'.{nearest(key, names)} To name a Python callable "
                "or module type, pass the object itself (e.g. torch.nn.functional.softmax)."
            )
    elif not (callable(key) or isinstance(key, type)):
        raise TypeError(
            f"a policy op key is an aten op name, a callable or a module type; got {key!r}"
        )


def _frozen(mapping: Mapping | None) -> Mapping:
    # A plain dict (picklable); Policy exposes no way to mutate it and override() copies.
    return dict(mapping or {})


@dataclass(frozen=True)
class Decision:
    """The rule for one node and what decided it (written to ``node.meta["amp"]``)."""

    rule: Rule
    source: str  # "table", "default", "op override", "module type", "module path", "node"
    detail: str  # e.g. "aten::softmax is in O1's fp32 table"


@dataclass(frozen=True)
class OpFacts:
    """What the classify pass knows about a node, as the policy's lookup input."""

    node_name: str
    display: str  # e.g. "F.softmax", "Tensor.matmul", "nn.Linear"
    keys: tuple[Any, ...]  # Python-level keys: the callable, or the module type
    aten: tuple[str, ...]  # candidate aten op names, first match in a table wins
    module_paths: tuple[str, ...]  # enclosing module paths, outermost first ("" is the root)
    module_types: tuple[type, ...]  # their types, aligned with module_paths


@dataclass(frozen=True)
class Policy:
    """Op tables plus overrides. Build one with :meth:`preset`, refine with :meth:`override`.

    Attributes:
        name: for reports.
        allow, deny, promote: aten op names computing in low precision, in float32, and at
            the widest floating input type. Every other op gets ``default``.
        default: the rule for ops in no table: FOLLOW (O0, O1, autocast) or ALLOW (O2, O3).
        cast_inputs: cast floating graph inputs to low precision at entry (Apex O2/O3).
        ops: op-level overrides keyed by aten name, callable or module type.
        module_types: overrides for every node inside a module of that type.
        modules: overrides for every node inside a module whose path matches the glob
            (``"blocks.*.attn"``: ``*`` matches one path segment, ``**`` any number).
        nodes: overrides by FX node name.
    """

    name: str
    allow: frozenset[str] = frozenset()
    deny: frozenset[str] = frozenset()
    promote: frozenset[str] = frozenset()
    default: Rule = Rule.FOLLOW
    cast_inputs: bool = False
    ops: Mapping[OpKey, Rule] = field(default_factory=lambda: _frozen(None))
    module_types: Mapping[type, Rule] = field(default_factory=lambda: _frozen(None))
    modules: Mapping[str, Rule] = field(default_factory=lambda: _frozen(None))
    nodes: Mapping[str, Rule] = field(default_factory=lambda: _frozen(None))

    @staticmethod
    def preset(name: str, device_type: str = "cpu") -> Policy:
        """One of ``O0``, ``O1``, ``O2``, ``O3``, ``autocast``.

        ``device_type`` only matters for ``autocast``, which uses torch.autocast's lists
        for that device; ``O1`` uses the CUDA lists on every device.
        """
        if not isinstance(name, str) or name not in PRESETS:
            raise ValueError(
                f"unknown policy preset {name!r}; presets are {list(PRESETS)}."
                f"{nearest(str(name), PRESETS)}"
            )
        if name == "O0":
            return Policy("O0")
        if name in ("O1", "autocast"):
            allow, deny, promote = autocast_tables("cuda" if name == "O1" else device_type)
            label = name if name == "O1" else f"autocast[{device_type}]"
            return Policy(label, allow=allow, deny=deny, promote=promote)
        if name == "O2":
            _, fp32, _ = autocast_tables("cuda")
            return Policy(
                "O2", deny=fp32 | python_ops.NORMALIZATION_OPS, default=Rule.ALLOW, cast_inputs=True
            )
        return Policy("O3", default=Rule.ALLOW, cast_inputs=True)

    def override(
        self,
        *,
        ops: Mapping[OpKey, Rule | str] | None = None,
        module_types: Mapping[type, Rule | str] | None = None,
        modules: Mapping[str, Rule | str] | None = None,
        nodes: Mapping[str, Rule | str] | None = None,
    ) -> Policy:
        """A copy with more overrides; later calls win over earlier ones for the same key."""
        for key in ops or {}:
            _check_op_key(key)
        for key in module_types or {}:
            if not (isinstance(key, type) and issubclass(key, nn.Module)):
                raise TypeError(f"module_types keys are nn.Module subclasses; got {key!r}")
        for key in list(modules or {}) + list(nodes or {}):
            if not isinstance(key, str):
                raise TypeError(
                    f"module path and node name overrides are keyed by str; got {key!r}"
                )

        def merged(old: Mapping, new: Mapping | None) -> Mapping:
            return _frozen({**old, **{k: as_rule(v) for k, v in (new or {}).items()}})

        name = self.name if self.name.endswith("+overrides") else f"{self.name}+overrides"
        return replace(
            self,
            name=name,
            ops=merged(self.ops, ops),
            module_types=merged(self.module_types, module_types),
            modules=merged(self.modules, modules),
            nodes=merged(self.nodes, nodes),
        )

    # ---- lookup ---------------------------------------------------------------------

    def decide(self, facts: OpFacts) -> Decision:
        """The rule for one node, following the documented priority order."""
        if facts.node_name in self.nodes:
            rule = self.nodes[facts.node_name]
            return Decision(rule, "node", f"node override {facts.node_name!r} -> {rule}")
        for path in reversed(facts.module_paths):
            hits = {g: r for g, r in self.modules.items() if _glob_match(g, path)}
            if len(set(hits.values())) > 1:
                raise ValueError(
                    f"module path overrides {sorted(hits)} all match module {path!r} with "
                    "different rules; make the globs disjoint or add a more specific node "
                    "override"
                )
            if hits:
                glob, rule = next(iter(hits.items()))
                where = path or "<root>"
                return Decision(
                    rule,
                    "module path",
                    f"module path override {glob!r} matches {where!r} -> {rule}",
                )
        for path, mtype in zip(
            reversed(facts.module_paths), reversed(facts.module_types), strict=True
        ):
            for cls in mtype.__mro__:
                if cls in self.module_types:
                    rule = self.module_types[cls]
                    return Decision(
                        rule,
                        "module type",
                        f"module type override {op_key_name(cls)} "
                        f"(module {path or '<root>'!r}) -> {rule}",
                    )
        for key in facts.keys:
            if key in self.ops:
                rule = self.ops[key]
                return Decision(rule, "op override", f"op override {op_key_name(key)} -> {rule}")
        for aten in facts.aten:
            if aten in self.ops or base_name(aten) in self.ops:
                rule = self.ops.get(aten, self.ops.get(base_name(aten)))
                return Decision(rule, "op override", f"op override {aten!r} -> {rule}")
        for aten in facts.aten:
            op = base_name(aten)
            for table, rule in (
                (self.allow, Rule.ALLOW),
                (self.deny, Rule.DENY),
                (self.promote, Rule.PROMOTE),
            ):
                if op in table:
                    return Decision(rule, "table", f"aten::{op} is in {self.name}'s {rule} table")
        what = f"aten::{base_name(facts.aten[0])}" if facts.aten else facts.display
        return Decision(
            self.default, "default", f"{what} is in no {self.name} table; default {self.default}"
        )

    def validate_for(self, module_paths: Iterable[str], node_names: Iterable[str]) -> None:
        """Raise ValueError for module path globs or node names the captured graph lacks."""
        paths = [p for p in module_paths if p]
        for glob in self.modules:
            if not any(_glob_match(glob, p) for p in paths):
                raise ValueError(
                    f"module path override {glob!r} matches no module of the model."
                    f"{nearest(glob, paths)} Module paths are those of model.named_modules()."
                )
        for path in paths:
            rules = {g: r for g, r in self.modules.items() if _glob_match(g, path)}
            if len(set(rules.values())) > 1:
                raise ValueError(
                    f"module path overrides {sorted(rules)} all match module {path!r} with "
                    "different rules; make the globs disjoint or add a node override"
                )
        names = list(node_names)
        for name in self.nodes:
            if name not in names:
                raise ValueError(
                    f"node override {name!r} names no node of the captured graph."
                    f"{nearest(name, names)} See print(compiled.graph) or amp_graph.report()."
                )


@functools.lru_cache(maxsize=256)
def _glob_regex(glob: str) -> re.Pattern[str]:
    out = []
    for token in re.split(r"(\*\*|\*|\?)", glob):
        out.append({"**": ".*", "*": "[^.]*", "?": "[^.]"}.get(token, re.escape(token)))
    return re.compile("".join(out))


def _glob_match(glob: str, path: str) -> bool:
    """Module path globs: ``*`` matches within one path segment, ``**`` across segments."""
    return bool(path) and _glob_regex(glob).fullmatch(path) is not None


def resolve_policy(policy: Policy | str, device_type: str) -> Policy:
    """A Policy object from a preset name or a Policy (returned as is)."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        return Policy.preset(policy, device_type)
    raise TypeError(
        f"policy is a preset name {list(PRESETS)} or an amp_graph.Policy; got {policy!r}"
    )
