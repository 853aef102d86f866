"""fp8 training recipes and configuration: pure data, no kernels.

A recipe says how each operand of a linear is scaled into float8, following torchao's float8
training recipes (``torchao.float8.Float8LinearConfig.from_recipe_name``):

============  ==================  =================  ======================  ================
recipe        scale granularity   forward operands   gradient of the output  scales
============  ==================  =================  ======================  ================
tensorwise    one per tensor      e4m3               e5m2                    exact
rowwise       one per row         e4m3               e4m3 (*)                powers of two
============  ==================  =================  ======================  ================

Both scale dynamically: each call scales each operand by its current amax (``scale =
format max / amax``), as torchao does since it removed delayed scaling. The forward matmul
may use fast accumulation; the two gradient matmuls never do.

(*) torchao's rowwise recipe casts gradients to e4m3: CUDA's rowwise-scaled kernels take
e4m3 operands only, and a per-row scale already gives each row the range e5m2 would add.

Example::

    >>> from amp_graph.policy import Fp8Config
    >>> Fp8Config(recipe="rowwise").recipe_spec.grad_dtype
    torch.float8_e4m3fn
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn as nn

from .fp8_cost import Fp8CostModel

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
FORMAT_NAMES = {E4M3: "e4m3", E5M2: "e5m2"}
AMAX_FLOOR = 1e-12
"""The smallest amax a scale is computed from (torchao's EPS): all-zero tensors stay finite."""

OUT_DTYPE = torch.bfloat16
"""What an fp8 linear returns, and the dtype every other op of the fp8 policy runs in."""

ModuleFilter = Callable[[nn.Module, str], bool]
"""``fn(module, path) -> bool``: True converts the layer to fp8 (torchao's module_filter_fn)."""


class Granularity(str, Enum):
    TENSORWISE = "tensorwise"  # one scale per tensor
    ROWWISE = "rowwise"  # one scale per row along the contraction dim (torchao: axiswise)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Fp8Recipe:
    """How the operands of one fp8 linear are scaled (see the module table)."""

    name: str
    granularity: Granularity
    grad_dtype: torch.dtype  # the output gradient's float8 format
    power_of_2_scales: bool  # round each scale down to a power of two (exact rescaling)


RECIPES: dict[str, Fp8Recipe] = {
    "tensorwise": Fp8Recipe("tensorwise", Granularity.TENSORWISE, E5M2, False),
    "rowwise": Fp8Recipe("rowwise", Granularity.ROWWISE, E4M3, True),
}


def get_recipe(name: str) -> Fp8Recipe:
    """The recipe called ``name``; a ValueError naming the valid ones otherwise."""
    try:
        return RECIPES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown fp8 recipe {name!r}; use one of {sorted(RECIPES)} "
            "(torchao's 'tensorwise' and 'rowwise'; delayed scaling is not offered: "
            "torchao removed it in favour of dynamic scaling)"
        ) from None


@dataclass(frozen=True)
class Fp8Config:
    """Which linears run in fp8, and how.

    ``recipe``: a name in :data:`RECIPES`. ``module_filter``: ``fn(module, path) -> bool``,
    called for each eligible layer with the module the op runs in and its path in the model;
    False keeps the layer in bf16 (e.g. ``lambda m, path: path != "head"``). ``auto_filter``:
    also keep layers too small to gain from fp8 in bf16, by torchao's H100 thresholds
    (opt-in: the right thresholds depend on the GPU). ``cost_model``: decide per GEMM, its
    tokens included, by what fp8 and bf16 are predicted to take on the device
    (:mod:`amp_graph.policy.fp8_cost`): ``"measured"`` measures the model's device once
    (:func:`amp_graph.ops.fp8_speed.measured_fp8_cost`), or pass an
    :class:`~amp_graph.policy.fp8_cost.Fp8CostModel` of given figures. One of
    ``auto_filter`` and ``cost_model``, not both.
    """

    recipe: str = "tensorwise"
    module_filter: ModuleFilter | None = None
    auto_filter: bool = False
    cost_model: Fp8CostModel | str | None = None

    def __post_init__(self) -> None:
        get_recipe(self.recipe)
        if self.module_filter is not None and not callable(self.module_filter):
            raise TypeError(
                "Fp8Config.module_filter is a function fn(module, path) -> bool; got "
                f"{type(self.module_filter).__name__}"
            )
        if not isinstance(self.auto_filter, bool):
            raise TypeError(f"Fp8Config.auto_filter is a bool; got {self.auto_filter!r}")
        cost = self.cost_model
        if cost is not None and cost != "measured" and not isinstance(cost, Fp8CostModel):
            raise TypeError(
                "Fp8Config.cost_model is 'measured' (the model's device, measured once), an "
                f"amp_graph.policy.fp8_cost.Fp8CostModel, or None; got {cost!r}"
            )
        if cost is not None and self.auto_filter:
            raise ValueError(
                "Fp8Config: auto_filter (torchao's fixed thresholds) and cost_model (the "
                "device's measured costs) both decide which layers are too small for fp8; "
                "pass one of them"
            )

    @property
    def recipe_spec(self) -> Fp8Recipe:
        return get_recipe(self.recipe)


def check_fp8_low_dtype(dtype: torch.dtype) -> torch.dtype:
    """The fp8 policy's dtype for everything that is not an fp8 linear: bfloat16 only.

    Raises:
        ValueError: for float16 (its range is too narrow for what the fp8 matmuls return,
            and it would need a loss scaler that fp8 training otherwise does without) and
            for anything else.
    """
    if dtype == OUT_DTYPE:
        return dtype
    if dtype == torch.float16:
        raise ValueError(
            "policy='fp8' runs the non-fp8 ops in bfloat16, not float16: fp8 linears return "
            "bfloat16, and float16's range (max 65504) would need a loss scaler that fp8 "
            "training does without (e5m2 gradients have the range). Pass "
            "dtype=torch.bfloat16 or leave dtype unset"
        )
    raise ValueError(
        f"policy='fp8' runs the non-fp8 ops in bfloat16; got dtype={dtype}. Pass "
        "dtype=torch.bfloat16 or leave dtype unset"
    )
