"""Pass reuse_parameter_casts: a graph run once per token casts each weight once per generation.

A decode graph runs once per generated token over the same weights; torch.autocast around
``generate`` casts each weight once (its cast cache lives as long as the autocast region),
the graph as written casts it at every step. This pass makes each cast of a parameter a
call of :func:`~amp_graph.ops.parameter_casts.cast_reused`, which returns the cast a
:class:`~amp_graph.ops.parameter_casts.ParameterCasts` holds while the parameter is
unchanged (the same tensor, version and storage).

Reads: the parameter casts that one cast made before the graph may serve
(:func:`~passes.hoist_parameter_casts.hoistable_parameter_casts`: not of what the graph
writes in place, not inside ``no_grad``). Writes: one ``get_attr`` of ``casts`` (set on
``gm`` as ``parameter_casts``) and a ``cast_reused`` node in place of each such cast, with
its name and metadata. Guarantees: each consumer receives a tensor equal to the cast it
received before (the same value, bit for bit); with grad enabled each cast is made anew
as before, a recomputed cast still recomputed in backward.
"""

from __future__ import annotations

import warnings

import torch.fx as fx

from amp_graph.ops.parameter_casts import ParameterCasts, cast_reused

from .hoist_parameter_casts import hoistable_parameter_casts
from .result import PassResult

CASTS_ATTRIBUTE = "parameter_casts"


def reuse_parameter_casts(gm: fx.GraphModule, casts: ParameterCasts) -> PassResult:
    """Each hoistable cast of a parameter in ``gm`` becomes ``cast_reused(casts, ...)``."""
    found = hoistable_parameter_casts(gm)
    if not found:
        return PassResult(gm, modified=False, stats={"casts_reused": 0})
    setattr(gm, CASTS_ATTRIBUTE, casts)
    with gm.graph.inserting_before(found[0]), warnings.catch_warnings():  # the first in order
        # fx warns of a get_attr of anything but a module, parameter or buffer; the generated
        # code reads any attribute (self.parameter_casts)
        warnings.filterwarnings("ignore", "Attempted to insert a get_attr Node")
        held = gm.graph.get_attr(CASTS_ATTRIBUTE)
    for cast in found:
        param, dtype, *kept_by = cast.args
        with gm.graph.inserting_before(cast):
            reused = gm.graph.call_function(cast_reused, (held, param, dtype, *kept_by))
        reused.meta = dict(cast.meta)
        cast.replace_all_uses_with(reused)
        name = cast.name
        gm.graph.erase_node(cast)
        reused.name = name
    gm.recompile()
    return PassResult(gm, modified=True, stats={"casts_reused": len(found)})


__all__ = ["CASTS_ATTRIBUTE", "reuse_parameter_casts"]
