"""The policy layer: which ops compute low and which in float32, as data.

* :mod:`~amp_graph.policy.precision_policy` - :class:`Policy`, its presets (O0-O3,
  ``"autocast"``, ``"fp8"``) and :class:`Rule`, the vocabulary every layer above shares;
* :mod:`~amp_graph.policy.autocast_lists` - torch.autocast's op lists, per device and version;
* :mod:`~amp_graph.policy.python_ops` - the aten op a Python-level call stands for;
* :mod:`~amp_graph.policy.fp8_recipe` - fp8 recipes (tensorwise, rowwise) and
  :class:`Fp8Config`;
* :mod:`~amp_graph.policy.fp8_filters` - which linears run in fp8, each decision with its
  reason;
* :mod:`~amp_graph.policy.fp8_cost` - whether one fp8 linear pays on a device, by its shape
  (:class:`Fp8CostModel`; its figures measured by :mod:`amp_graph.ops.fp8_speed`).

Nothing here imports torch's graph machinery or any other layer: a policy is read by the
passes, never the other way round.
"""

from .fp8_cost import Fp8CostModel, GemmSpeed
from .fp8_recipe import (
    E4M3,
    E5M2,
    RECIPES,
    Fp8Config,
    Fp8Recipe,
    Granularity,
    check_fp8_low_dtype,
    get_recipe,
)
from .precision_policy import (
    KEEP_FP32,
    PRESETS,
    Decision,
    OpFacts,
    OpKey,
    Policy,
    Rule,
    as_rule,
    autocast_tables,
    base_name,
    check_output_dtype,
    known_op_names,
    nearest,
    op_key_name,
    resolve_policy,
)

__all__ = [
    "E4M3",
    "E5M2",
    "KEEP_FP32",
    "PRESETS",
    "RECIPES",
    "Decision",
    "Fp8Config",
    "Fp8CostModel",
    "Fp8Recipe",
    "GemmSpeed",
    "Granularity",
    "OpFacts",
    "OpKey",
    "Policy",
    "Rule",
    "as_rule",
    "autocast_tables",
    "base_name",
    "check_fp8_low_dtype",
    "check_output_dtype",
    "get_recipe",
    "known_op_names",
    "nearest",
    "op_key_name",
    "resolve_policy",
]
