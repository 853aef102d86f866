"""Precision policies: which ops compute in low precision, which in float32.

A :class:`Policy` is data. Its op tables hold aten op names (the names torch.autocast's
lists use); every graph node is mapped to the aten op autocast would see
(:mod:`amp_graph.policy.python_ops`) and looked up. On top of the tables come overrides,
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

from . import autocast_lists as lists
from . import python_ops
from .fp8_recipe import Fp8Config


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
PRESETS = ("O0", "O1", "O2", "O3", "autocast", "fp8")

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
        fp32 = (
            lists.CUDA_FP32
            | lists.CUDA_FP32_EXTRA
            | lists.CUDA_FP32_SET_OPT_DTYPE
            | lists.CUDA_BANNED
        )
        return (
            _bases(lists.CUDA_LOWER_PRECISION | lists.CUDA_LOWER_PRECISION_EXTRA),
            _bases(fp32),
            _bases(lists.CUDA_PROMOTE),
        )
    raise ValueError(
        f"amp_graph knows torch.autocast's lists for 'cpu' and 'cuda', not {device_type!r}"
    )


FFT_OPS: frozenset[str] = frozenset(
    {n for n in _bases(lists.CPU_FP32) if n.startswith("fft_")}
    | {"_fft_r2c", "_fft_c2c", "_fft_c2r", "stft", "istft"}
)
"""Fourier transforms: no device has a bfloat16 kernel for them (torch raises "Unsupported
dtype BFloat16"), and cuFFT's float16 takes power-of-two sizes only. torch.autocast's CPU
list keeps them float32; its CUDA list does not name them, so a bf16 input fails there
(HF's FNet under CUDA autocast). O1, O2 and O3 keep them float32; ``"autocast"`` is the
device's lists as they are."""


@functools.lru_cache(maxsize=1)
def known_op_names() -> frozenset[str]:
    """Every aten op name: those torch registers, and those the tables know (CUDA-only ops
    included), for validating string op keys."""
    names: set[str] = {
        base_name(name.split("::", 1)[1])
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::")
    }
    for device in ("cpu", "cuda"):
        for table in autocast_tables(device):
            names |= table
    for table in (python_ops.FUNCTIONS, python_ops.OPERATORS, python_ops.MODULES):
        for candidates in table.values():
            names |= _bases(candidates)
    return frozenset(names) | python_ops.NORMALIZATION_OPS


def _op_names(field_name: str, names: Any) -> frozenset[str]:
    """A table of aten op names from any iterable of strings, each one checked."""
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise TypeError(
            f"Policy {field_name} is a collection of aten op names, e.g. "
            f"{field_name}=['softmax', 'layer_norm']; got {names!r}"
        )
    names = frozenset(names)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"Policy {field_name} holds aten op names (str); got {name!r}")
        if base_name(name) not in known_op_names():
            raise ValueError(
                f"unknown op name {name!r} in Policy {field_name}; op names are aten op names "
                f"such as 'softmax' or 'linear'.{nearest(name, known_op_names())}"
            )
    return names


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
        overload = "" if key._overloadname == "default" else f".{key._overloadname}"
        return f"aten.{key._schema.name.split('::')[-1]}{overload}"
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


def _checked_ops(ops: Any) -> dict[OpKey, Rule]:
    if not isinstance(ops, Mapping):
        raise TypeError(f"Policy ops is a mapping of op -> rule; got {ops!r}")
    for key in ops:
        _check_op_key(key)
    return {key: as_rule(rule) for key, rule in ops.items()}


def _checked_module_types(types: Any) -> dict[type, Rule]:
    if not isinstance(types, Mapping):
        raise TypeError(
            f"Policy module_types is a mapping of nn.Module type -> rule; got {types!r}"
        )
    for key in types:
        if not (isinstance(key, type) and issubclass(key, nn.Module)):
            raise TypeError(f"module_types keys are nn.Module subclasses; got {key!r}")
    return {key: as_rule(rule) for key, rule in types.items()}


def _checked_names(what: str, overrides: Any) -> dict[str, Rule]:
    if not isinstance(overrides, Mapping):
        raise TypeError(f"{what} overrides are a mapping of str -> rule; got {overrides!r}")
    for key in overrides:
        if not isinstance(key, str):
            raise TypeError(f"module path and node name overrides are keyed by str; got {key!r}")
    return {key: as_rule(rule) for key, rule in overrides.items()}


def _check_recompute_casts(value: Any) -> None:
    """``recompute_casts`` is ``"auto"``, True, False or a byte count >= 0."""
    valid = value == "auto" if isinstance(value, str) else isinstance(value, int)
    if not valid or (isinstance(value, int) and not isinstance(value, bool) and value < 0):
        raise ValueError(
            f"Policy recompute_casts is 'auto' (recompute the casts that pay on the device), "
            f"True (all), False (none) or a minimum copy size in bytes (an int >= 0); got "
            f"{value!r}"
        )


def check_output_dtype(value: Any, where: str = "Policy output_dtype") -> None:
    """``output_dtype`` is None (outputs as computed) or ``torch.float32``; a ValueError
    naming ``where`` else."""
    if value is not None and value != torch.float32:
        hint = " (pass the torch dtype object)" if isinstance(value, str) else ""
        raise ValueError(
            f"{where} is torch.float32 (the graph returns its float16, bfloat16 "
            "and float8 outputs in float32, as the float32 model returns them) or None (as "
            f"the plan computes them); got {value!r}{hint}"
        )


def _checked_notes(notes: Any, nodes: Mapping[str, Rule]) -> dict[str, str]:
    if not isinstance(notes, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in notes.items()
    ):
        raise TypeError(f"Policy notes are a mapping of node name -> str; got {notes!r}")
    orphans = sorted(set(notes) - set(nodes))
    if orphans:
        raise ValueError(
            f"Policy notes for nodes without a node override: {orphans}; a note explains a "
            "node override, so add one (Policy.override(nodes=..., notes=...))"
        )
    return dict(notes)


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
            the widest floating input type.
        follow: aten op names that take their inputs as they come (no casts), whatever
            ``default`` says. Every op in no table gets ``default``.
        default: the rule for ops in no table: FOLLOW (O0, O1, autocast) or ALLOW (O2, O3).
        cast_inputs: cast floating graph inputs to low precision at entry (Apex O2/O3).
        master_weights: in a training :class:`amp_graph.Graph`, store the float32
            parameters in the low dtype (normalization layers excepted) and step float32
            master copies (Apex O2). Requires ``cast_inputs``. ``compile`` and the backend
            never change how parameters are stored.
        ops: op-level overrides keyed by aten name, callable or module type.
        module_types: overrides for every node inside a module of that type.
        modules: overrides for every node inside a module whose path matches the glob
            (``"blocks.*.attn"``: ``*`` matches one path segment, ``**`` any number).
        nodes: overrides by FX node name.
        notes: why a node override exists, by node name (``amp_graph.autopolicy`` records
            the evidence for each demotion here); :func:`amp_graph.explain` quotes it.
        fp8: run linear layers as float8 scaled matmuls (:mod:`amp_graph.ops.fp8_ops`) with this
            configuration; everything else follows the tables. None: no fp8.
        recompute_casts: which low-precision copies whose source outlives the forward
            anyway (weights, softmax's float32 output) backward casts again instead of
            keeping: the same gradients, bit for bit, without holding the copies from
            forward to backward (``passes.recompute_casts``). ``"auto"`` (the default):
            those where it pays on the model's device, by a cost measured there once
            (:mod:`amp_graph.ops.recompute_cost`: host time per cast and per saved tensor
            against the copy's bytes; where AOTAutograd compiles the graph, none: its
            partitioner decides, as for torch.compile under autocast; every FSDP2
            unit's). ``True``: every one. An int: those whose copy has at least that many
            bytes. ``False``: none, as torch.autocast.
        place_casts: label the ops only the default rule makes low (O2's free ops) low or
            float32 by an exact minimum cut of the cast bytes, forward and backward
            (``passes.place_casts``): it only ever raises ops to float32, never grows what
            backward holds, and plans the same graph at every entry point. True (the
            default): on; it has ops to place only where the default rule is ``ALLOW``
            (O2 and policies made from it), so O1, ``autocast`` and fp8 keep
            torch.autocast's per-op dtypes. ``Policy.preset("O3")`` sets False ("everything
            low"); False: the rules' plan.
        cast_gradients_per_consumer: where several ops read one cast of an activation (the
            Q, K and V projections of one norm's output), each converts its gradient to the
            source's dtype on its own and the gradients sum there, as under torch.autocast,
            which casts once per op (``passes.shared_cast_gradients``: a small copy is cast
            per consumer, as autocast does, where its bytes cost less than a read's Python
            on the device; a larger one is read by each consumer and kept once). False:
            they sum at the shared copy, in the low dtype, and are converted once: other
            bits than autocast's, a gradient error equal to three digits on an HF Llama,
            and on the CPU's eager graph a few percent less step time (BENCHMARKS.md).
            True in ``Policy.preset("autocast")``, whose contract is autocast's
            arithmetic; False in the others.
        output_dtype: ``torch.float32``: every floating-point output the graph computes
            narrower (float16, bfloat16, float8) is returned in float32, by a cast before the
            output (``passes.cast_outputs``; one an op of the graph makes of the value to
            float32 serves, where there is one); the cast is exact, and its
            gradient is cast back to the low dtype, as torch.autocast casts a loss's low
            input. A loss computed on the outputs outside the graph (``loss_fn(fast(x),
            y)``, outside any autocast) then runs in float32, as it does under
            torch.autocast, which puts ``cross_entropy``, ``mse_loss`` and the other losses
            on its float32 list: the loss and the gradients are autocast's bit for bit. As
            FSDP2's ``MixedPrecisionPolicy(output_dtype=...)`` and Apex's
            ``cast_model_outputs``; ``Policy.preset("O2")`` and ``"O3"`` set it, as Apex's
            O2 and O3 cast a model's outputs to float32. None (the default, and O1's,
            ``"autocast"`` 's and fp8's): outputs in the dtype the plan computes them, as
            torch.autocast returns them. The backend applies it only with ``cast_inputs``
            (dynamo's graphs return intermediate values too, which the next graph's entry
            cast then brings back exactly) and refuses it otherwise; decode graphs return
            their caches and logits as computed.
        missing_kernels: aten op name -> why the CPU the model runs on has no kernel for
            it in the low dtype (:mod:`amp_graph.frontends.cpu_low_kernels`, filled in by the entry
            points for CPU models). Such an op computes in float32 whatever else the policy says.
    """

    name: str
    allow: frozenset[str] = frozenset()
    deny: frozenset[str] = frozenset()
    promote: frozenset[str] = frozenset()
    follow: frozenset[str] = frozenset()
    default: Rule = Rule.FOLLOW
    cast_inputs: bool = False
    master_weights: bool = False
    ops: Mapping[OpKey, Rule] = field(default_factory=lambda: _frozen(None))
    module_types: Mapping[type, Rule] = field(default_factory=lambda: _frozen(None))
    modules: Mapping[str, Rule] = field(default_factory=lambda: _frozen(None))
    nodes: Mapping[str, Rule] = field(default_factory=lambda: _frozen(None))
    fp8: Fp8Config | None = None
    notes: Mapping[str, str] = field(default_factory=lambda: _frozen(None))
    recompute_casts: bool | str | int = "auto"
    missing_kernels: Mapping[str, str] = field(default_factory=lambda: _frozen(None))
    place_casts: bool = True
    cast_gradients_per_consumer: bool = False
    output_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        """Validate and normalize every field, however the Policy was built (the
        constructor, :meth:`preset`, :meth:`override`, ``dataclasses.replace``)."""
        if not isinstance(self.name, str):
            raise TypeError(f"Policy name is a str; got {self.name!r}")
        for table in ("allow", "deny", "promote"):
            object.__setattr__(self, table, _op_names(table, getattr(self, table)))
        clash = (self.allow & self.deny) | (self.allow & self.promote) | (self.deny & self.promote)
        if clash:
            raise ValueError(f"op names in more than one Policy table: {sorted(clash)}")
        for flag in ("cast_inputs", "master_weights", "cast_gradients_per_consumer"):
            value = getattr(self, flag)
            if not isinstance(value, bool):
                raise ValueError(f"Policy {flag} is True or False; got {value!r}")
        _check_recompute_casts(self.recompute_casts)
        check_output_dtype(self.output_dtype)
        if not isinstance(self.place_casts, bool):
            raise ValueError(
                f"Policy place_casts is True (place O2's casts by a minimum cut, the default) "
                f"or False (the rules' plan); got {self.place_casts!r}"
            )
        object.__setattr__(self, "default", as_rule(self.default))
        object.__setattr__(self, "ops", _checked_ops(self.ops))
        object.__setattr__(self, "module_types", _checked_module_types(self.module_types))
        object.__setattr__(self, "modules", _checked_names("module path", self.modules))
        object.__setattr__(self, "nodes", _checked_names("node name", self.nodes))
        object.__setattr__(self, "notes", _checked_notes(self.notes, self.nodes))
        object.__setattr__(self, "missing_kernels", _frozen(dict(self.missing_kernels)))
        if self.master_weights and not self.cast_inputs:
            raise ValueError(
                "Policy(master_weights=True) keeps float32 masters of parameters stored in the "
                "low dtype, which a policy does only with cast_inputs=True (O2's storage); set "
                "cast_inputs=True, or start from Policy.preset('O2')"
            )
        if self.fp8 is not None and not isinstance(self.fp8, Fp8Config):
            raise TypeError(
                f"Policy fp8 is an amp_graph.policy.Fp8Config or None; got {self.fp8!r}"
            )

    @staticmethod
    def preset(name: str, device_type: str = "cpu") -> Policy:
        """One of ``O0``, ``O1``, ``O2``, ``O3``, ``autocast``, ``fp8``.

        ``device_type`` only matters for ``autocast``, which uses torch.autocast's lists
        for that device; ``O1`` uses the CUDA lists on every device. ``fp8`` is O1 with
        linear layers as float8 scaled matmuls (tensorwise dynamic scaling; see
        :meth:`with_fp8` for other recipes and layer filters).
        """
        if not isinstance(name, str) or name not in PRESETS:
            said = dtype_given_as_preset(name) if isinstance(name, str) else None
            raise ValueError(
                said
                or f"unknown policy preset {name!r}; presets are {list(PRESETS)}."
                f"{nearest(str(name), PRESETS)}"
            )
        if name == "O0":
            return Policy("O0")
        if name == "fp8":
            return replace(Policy.preset("O1"), name="fp8", fp8=Fp8Config())
        if name in ("O1", "autocast"):
            allow, deny, promote = autocast_tables("cuda" if name == "O1" else device_type)
            if name == "O1":  # where CUDA autocast would run them low and fail
                return Policy(name, allow=allow, deny=deny | FFT_OPS, promote=promote)
            return Policy(
                f"autocast[{device_type}]",
                allow=allow,
                deny=deny,
                promote=promote,
                cast_gradients_per_consumer=True,  # autocast's arithmetic, backward too
            )
        if name == "O2":
            _, fp32, _ = autocast_tables("cuda")
            mixed = python_ops.MIXED_PRECISION_NORM_OPS
            return Policy(
                "O2",
                deny=fp32 | FFT_OPS | (python_ops.NORMALIZATION_OPS - mixed),
                follow=mixed,
                default=Rule.ALLOW,
                cast_inputs=True,
                master_weights=True,
                output_dtype=torch.float32,  # Apex O2's output caster: the loss in float32
            )
        # O3 is "everything low": the placement's raises would contradict it (an option)
        return Policy(
            "O3",
            deny=FFT_OPS,
            default=Rule.ALLOW,
            cast_inputs=True,
            place_casts=False,
            output_dtype=torch.float32,  # as Apex O3's
        )

    def with_fp8(self, config: Fp8Config | None = None, **options: Any) -> Policy:
        """A copy whose linear layers run in fp8: ``config``, or ``Fp8Config(**options)``
        (``recipe="rowwise"``, ``module_filter=lambda module, path: path != "head"``,
        ``auto_filter=True``)."""
        if config is not None and options:
            raise TypeError("pass an Fp8Config or its options (recipe=..., ...), not both")
        config = config if config is not None else Fp8Config(**options)
        name = self.name if self.name.startswith("fp8") else f"{self.name}+fp8"
        return replace(self, name=name, fp8=config)

    def override(
        self,
        *,
        ops: Mapping[OpKey, Rule | str] | None = None,
        module_types: Mapping[type, Rule | str] | None = None,
        modules: Mapping[str, Rule | str] | None = None,
        nodes: Mapping[str, Rule | str] | None = None,
        notes: Mapping[str, str] | None = None,
    ) -> Policy:
        """A copy with more overrides; later calls win over earlier ones for the same key.
        ``notes`` says why a node override exists (``explain`` quotes it)."""

        def merged(old: Mapping, new: Mapping | None) -> Mapping:
            if new is not None and not isinstance(new, Mapping):
                raise TypeError(f"overrides are a mapping of key -> rule; got {new!r}")
            return _frozen({**old, **(new or {})})

        name = self.name if self.name.endswith("+overrides") else f"{self.name}+overrides"
        return replace(
            self,
            name=name,
            ops=merged(self.ops, ops),
            module_types=merged(self.module_types, module_types),
            modules=merged(self.modules, modules),
            nodes=merged(self.nodes, nodes),
            notes=merged(self.notes, notes),
        )

    @functools.cached_property
    def _ops_by_aten_name(self) -> dict[str, OpKey]:
        """Callable and module-type op keys by the aten op they run (``F.gelu`` -> ``gelu``),
        so that they also match the aten-level nodes of captured graphs."""
        found: dict[str, OpKey] = {}
        for key in self.ops:
            if not isinstance(key, str):
                name = python_ops.aten_name_of(key)
                if name is not None:
                    found.setdefault(name, key)
        return found

    @property
    def casts_nothing(self) -> bool:
        """No table and a FOLLOW default (O0): nothing is ever cast but by overrides."""
        return not (self.allow or self.deny or self.promote) and self.default is Rule.FOLLOW

    @property
    def changes_nothing(self) -> bool:
        """:attr:`casts_nothing`, and no override or fp8 that would: every op computes in the
        dtypes the model gives it (O0 as preset)."""
        overridden = self.ops or self.module_types or self.modules or self.nodes
        return self.casts_nothing and not overridden and self.fp8 is None

    # ---- lookup ---------------------------------------------------------------------

    def decide(self, facts: OpFacts) -> Decision:
        """The rule for one node, following the documented priority order; an op the CPU
        has no low-precision kernel for (``missing_kernels``) computes in float32."""
        decision = self._decide_by_priority(facts)
        missing = next(
            (base_name(a) for a in facts.aten if base_name(a) in self.missing_kernels), None
        )
        if missing is None or decision.rule is not Rule.ALLOW:
            return decision
        return Decision(
            Rule.DENY,
            "cpu",
            f"{decision.detail}; but this CPU has no low-precision kernel for aten::{missing} "
            f"({self.missing_kernels[missing]}), so it computes in float32",
        )

    def _decide_by_priority(self, facts: OpFacts) -> Decision:
        if facts.node_name in self.nodes:
            rule = self.nodes[facts.node_name]
            note = self.notes.get(facts.node_name)
            why = f" ({note})" if note else ""
            return Decision(rule, "node", f"node override {facts.node_name!r} -> {rule}{why}")
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
        for aten in facts.aten[:1]:  # an aten-level node: a callable key names its aten op
            key = self._ops_by_aten_name.get(base_name(aten))
            if key is not None:
                rule = self.ops[key]
                return Decision(
                    rule, "op override", f"op override {op_key_name(key)} (aten::{aten}) -> {rule}"
                )
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
                (self.follow, Rule.FOLLOW),
            ):
                if op in table:
                    return Decision(rule, "table", f"aten::{op} is in {self.name}'s {rule} table")
        what = f"aten::{base_name(facts.aten[0])}" if facts.aten else facts.display
        if self.default is Rule.FOLLOW and any(
            base_name(a) in python_ops.ONE_DTYPE_OPS for a in facts.aten
        ):
            return Decision(
                Rule.PROMOTE,
                "default",
                f"{what} is in no {self.name} table and its kernel takes one floating dtype: "
                "promote (the widest of its inputs)",
            )
        return Decision(
            self.default, "default", f"{what} is in no {self.name} table; default {self.default}"
        )

    def validate_for(self, module_paths: Iterable[str], node_names: Iterable[str]) -> None:
        """Raise ValueError for module path globs or node names the captured graph lacks."""
        self.validate_modules(module_paths)
        self.validate_nodes(node_names)

    def validate_modules(self, module_paths: Iterable[str], *, where: str = "model") -> None:
        """Raise ValueError for module path globs that match no module, or conflict.
        ``where``: ``"model"`` (paths of ``model.named_modules()``) or ``"graph"`` (paths
        of an ``amp_graph.Graph``, which start at its registered modules)."""
        paths = [p for p in module_paths if p]
        for glob in self.modules:
            if not any(_glob_match(glob, p) for p in paths):
                raise ValueError(
                    f"module path override {glob!r} matches no module of the {where}."
                    f"{nearest(glob, paths)} {_PATHS_START[where]}"
                )
        for path in paths:
            rules = {g: r for g, r in self.modules.items() if _glob_match(g, path)}
            if len(set(rules.values())) > 1:
                raise ValueError(
                    f"module path overrides {sorted(rules)} all match module {path!r} with "
                    "different rules; make the globs disjoint or add a node override"
                )

    def validate_nodes(self, node_names: Iterable[str]) -> None:
        """Raise ValueError for node overrides that name no node of the captured graph."""
        names = list(node_names)
        for name in self.nodes:
            if name in names:
                continue
            captured = name.removesuffix("_fp8")
            if captured != name and captured in names:  # the fp8 pass's name for the linear
                raise ValueError(
                    f"node override {name!r} names the fp8 linear the fp8 pass makes of node "
                    f"{captured!r}; overrides name the captured graph's nodes, before any "
                    f"pass: use nodes={{{captured!r}: ...}}."
                )
            raise ValueError(
                f"node override {name!r} names no node of the captured graph."
                f"{nearest(name, names)} See print(compiled.graph) or amp_graph.report()."
            )


_PATHS_START = {
    "model": "Module paths are those of model.named_modules().",
    "graph": (
        "In an amp_graph.Graph, module paths start at the Graph: the name a module is "
        "registered under comes first ('model.head' for self.model = model), as in "
        "graph-level OneFlow; a policy written for amp_graph.compile(model) needs that prefix."
    ),
}


@functools.lru_cache(maxsize=256)
def _glob_regex(glob: str) -> re.Pattern[str]:
    out = []
    for token in re.split(r"(\*\*|\*|\?)", glob):
        out.append({"**": ".*", "*": "[^.]*", "?": "[^.]"}.get(token, re.escape(token)))
    return re.compile("".join(out))


# dtype names people pass as the policy: the dtype is compile's next argument
_DTYPE_NAMES = {
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
}
_FLOAT32_NAMES = frozenset({"fp32", "float32", "float"})


def dtype_given_as_preset(name: str) -> str | None:
    """What to say where a dtype's name is given as a preset (``"fp16"``, which the nearest
    preset name would answer with ``'fp8'``): the dtype is an argument of its own. None for
    other names."""
    lowered = name.lower()
    if lowered in _DTYPE_NAMES:
        return (
            f"policy {name!r} names a dtype, not a preset; the dtype is a separate "
            f"argument: amp_graph.compile(model, 'O1', torch.{_DTYPE_NAMES[lowered]}). "
            f"Presets are {list(PRESETS)}."
        )
    if lowered in _FLOAT32_NAMES:
        return (
            f"policy {name!r} names a dtype, not a preset; for float32 everywhere use "
            f"policy='O0'. Presets are {list(PRESETS)}."
        )
    return None


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
