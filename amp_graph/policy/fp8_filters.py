"""Which linears run in fp8: a table of rules, each returning a decision with its reason.

Pure functions of a layer's facts (its dims, where it runs, the policy rule it already has)
and an :class:`~amp_graph.policy.fp8_recipe.Fp8Config`. The first rule that returns a decision
wins; a layer no rule stops runs in fp8. The reason (``"fp8: ..."`` or ``"not fp8: ..."``)
is what ``explain`` shows for the node.

Example::

    >>> from amp_graph.policy.fp8_filters import Fp8Config, LinearFacts, decide
    >>> head = LinearFacts("aten.linear", "head", None, in_features=128, out_features=10)
    >>> print(decide(head, Fp8Config()).reason)
    not fp8: out_features=10 is not a multiple of 16 (a torch._scaled_mm requirement)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn

from .fp8_cost import Fp8CostModel
from .fp8_recipe import FORMAT_NAMES, Fp8Config, Granularity
from .precision_policy import Rule

_DIM_MULTIPLE = 16


@dataclass(frozen=True)
class LinearFacts:
    """What the rules know about one linear-like op: ``out = x @ W.T (+ b)``, W is (N, K)."""

    op: str  # "aten.linear", "aten.matmul", ...
    path: str  # the module the op runs in ("" is the model itself)
    module: nn.Module | None  # that module, when the caller has the model
    in_features: int  # K, the contraction dim
    out_features: int  # N
    policy_rule: Rule | None = None  # the rule classify gave the node; None: not classified
    policy_source: str = ""  # which policy level decided that rule
    tokens: int | None = None  # M: the rows of x (its leading dims' product); None: unknown


@dataclass(frozen=True)
class Fp8Decision:
    fp8: bool
    reason: str


Fp8Rule = Callable[[LinearFacts, Fp8Config], "Fp8Decision | None"]


def _where(facts: LinearFacts) -> str:
    return f"'{facts.path}'" if facts.path else "the model itself"


def keep_policy_choice(facts: LinearFacts, config: Fp8Config) -> Fp8Decision | None:
    """An override that keeps the op out of low precision (``modules={"head": "fp32"}``)
    outranks fp8: fp8 replaces only what the policy would run in bf16."""
    if facts.policy_rule is None or facts.policy_rule is Rule.ALLOW:
        return None
    return Fp8Decision(
        False,
        f"not fp8: the policy gives it rule {facts.policy_rule} "
        f"(decided by {facts.policy_source or 'the policy'}), which fp8 does not override",
    )


def dims_multiple_of_16(facts: LinearFacts, config: Fp8Config) -> Fp8Decision | None:
    """torch._scaled_mm needs K and N to be multiples of 16 (cuBLASLt's fp8 alignment)."""
    bad = [
        f"{name}={value}"
        for name, value in (
            ("in_features", facts.in_features),
            ("out_features", facts.out_features),
        )
        if value % _DIM_MULTIPLE
    ]
    if not bad:
        return None
    verb = "is" if len(bad) == 1 else "are"
    return Fp8Decision(
        False,
        f"not fp8: {' and '.join(bad)} {verb} not a multiple of {_DIM_MULTIPLE} "
        "(a torch._scaled_mm requirement)",
    )


def user_module_filter(facts: LinearFacts, config: Fp8Config) -> Fp8Decision | None:
    """The user's ``module_filter(module, path)``: False keeps the layer in bf16."""
    if config.module_filter is None:
        return None
    verdict = config.module_filter(facts.module, facts.path)
    if not isinstance(verdict, bool):
        raise TypeError(
            f"Fp8Config.module_filter must return True (fp8) or False (bf16); for {_where(facts)} "
            f"it returned {verdict!r}"
        )
    return None if verdict else Fp8Decision(False, "not fp8: module_filter returned False")


# torchao's auto-filter thresholds (torchao.float8.float8_linear_utils, measured on H100):
# a layer whose (K, N) satisfies the predicate is too small for fp8 to beat bf16.
TOO_SMALL: dict[Granularity, tuple[Callable[[int, int], bool], str]] = {
    Granularity.TENSORWISE: (lambda k, n: k <= 4096 and n <= 1024, "K <= 4096 and N <= 1024"),
    Granularity.ROWWISE: (
        lambda k, n: n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048),
        "N <= 2048, or K <= 1024, or N <= 4096 and K <= 2048",
    ),
}


def auto_filter(facts: LinearFacts, config: Fp8Config) -> Fp8Decision | None:
    """Opt-in (``Fp8Config(auto_filter=True)``): keep layers too small to gain in bf16."""
    if not config.auto_filter:
        return None
    too_small, rule = TOO_SMALL[config.recipe_spec.granularity]
    k, n = facts.in_features, facts.out_features
    if not too_small(k, n):
        return None
    return Fp8Decision(
        False,
        f"not fp8: too small to gain from fp8 (K={k}, N={n}; torchao's {config.recipe} "
        f"auto-filter keeps {rule} in high precision)",
    )


def _cost_model(config: Fp8Config) -> Fp8CostModel | None:
    cost = config.cost_model
    if isinstance(cost, str):  # "measured": the entry point measures before the passes run
        raise ValueError(
            "Fp8Config(cost_model='measured') reached the fp8 pass unmeasured: the entry "
            "points (compile, the backend, Graph, export) measure the model's device first. "
            "Calling the pass yourself, pass amp_graph.ops.fp8_speed.measured_fp8_cost(device)"
        )
    return cost


def cost_model_filter(facts: LinearFacts, config: Fp8Config) -> Fp8Decision | None:
    """Opt-in (``Fp8Config(cost_model=...)``): keep in bf16 a GEMM the device's cost model
    predicts fp8 does not make faster, by its shape, tokens included."""
    cost = _cost_model(config)
    if cost is None or facts.tokens is None:
        return None
    m, k, n = facts.tokens, facts.in_features, facts.out_features
    if cost.pays(m, k, n):
        return None
    return Fp8Decision(False, f"not fp8: {cost.explain(m, k, n)}")


RULES: tuple[Fp8Rule, ...] = (
    keep_policy_choice,  # explicit fp32 / follow overrides win
    dims_multiple_of_16,  # hardware requirement
    user_module_filter,  # the user's exclusions
    auto_filter,  # opt-in size heuristic
    cost_model_filter,  # opt-in, by the device's measured costs
)


def decide(facts: LinearFacts, config: Fp8Config) -> Fp8Decision:
    """The first rule's decision, else fp8."""
    for rule in RULES:
        decision = rule(facts, config)
        if decision is not None:
            return decision
    spec = config.recipe_spec
    cost = _cost_model(config)
    why = ""
    if cost is not None:
        why = (
            f"; {cost.explain(facts.tokens, facts.in_features, facts.out_features)}"
            if facts.tokens is not None
            else "; its tokens are not known at capture, so the cost model was not asked"
        )
    return Fp8Decision(
        True,
        f"fp8: {facts.op} with K={facts.in_features}, N={facts.out_features} runs as a float8 "
        f"scaled matmul ({spec.name} scales; e4m3 operands, "
        f"{FORMAT_NAMES[spec.grad_dtype]} output gradient, bf16 out){why}",
    )
