"""fp8 training: linears as float8 scaled matmuls (e4m3 forward, e5m2 gradients).

* :mod:`~amp_graph.fp8.recipe` - recipes (tensorwise, rowwise) and :class:`Fp8Config`;
* :mod:`~amp_graph.fp8.filters` - which layers run in fp8, each decision with its reason;
* :mod:`~amp_graph.fp8.custom_ops` - the ``amp_graph::fp8_*`` custom ops and :func:`linear`.

The graph pass that rewrites a captured model's linears is
:func:`amp_graph.passes.fp8_linears.fp8_linears`.
"""

from .custom_ops import (
    Fp8UnsupportedError,
    fp8_matmul_error,
    fp8_quantize,
    fp8_scale,
    linear,
    require_fp8_matmul,
)
from .filters import RULES, Fp8Decision, LinearFacts, decide
from .recipe import (
    E4M3,
    E5M2,
    RECIPES,
    Fp8Config,
    Fp8Recipe,
    Granularity,
    check_fp8_low_dtype,
    get_recipe,
)

__all__ = [
    "E4M3",
    "E5M2",
    "RECIPES",
    "RULES",
    "Fp8Config",
    "Fp8Decision",
    "Fp8Recipe",
    "Fp8UnsupportedError",
    "Granularity",
    "LinearFacts",
    "check_fp8_low_dtype",
    "decide",
    "fp8_matmul_error",
    "fp8_quantize",
    "fp8_scale",
    "get_recipe",
    "linear",
    "require_fp8_matmul",
]
