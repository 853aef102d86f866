"""Pass fsdp_planned_reads: a warning where an op reads a parameter at a wider dtype than
the all-gather ``amp_graph.plan_fsdp`` planned for it.

``plan_fsdp`` gives an FSDP2 unit ``param_dtype=low`` when, under the policy it plans with,
every read of the unit's parameters is a cast to ``low``: the all-gather then rounds
nothing that an op reads otherwise. Compiled with another policy (an override pinning a
module to float32 since the plan), an op may read such a parameter in float32; it then
reads the values the low all-gather rounded, which a float32 all-gather would not have
rounded. This pass names those parameters in one ``UserWarning`` that says what to do. It
changes nothing.

Reads: ``meta["amp_graph.fsdp_planned"]`` and ``meta["amp_graph.fsdp_gathered_dtype"]`` on
parameter reads (written by the capture), ``meta["amp"]`` of their users. Graphs without
planned units are left alone and warn nothing.
"""

from __future__ import annotations

import warnings

import torch.fx as fx

from .meta import AMP, FSDP_GATHERED_DTYPE, FSDP_PLANNED, Role
from .result import PassResult


def fsdp_planned_reads(gm: fx.GraphModule) -> PassResult:
    """Warn about reads of planned low-gathered parameters cast to another dtype; returns
    the graph unchanged, with ``planned_reads_widened`` counted."""
    widened: dict[str, list[str]] = {}  # what the plan was for -> parameters
    for node in gm.graph.nodes:
        planned = node.meta.get(FSDP_PLANNED)
        if node.op != "get_attr" or planned is None:
            continue
        gathered = node.meta[FSDP_GATHERED_DTYPE]
        if any(
            user.meta[AMP].role is Role.CAST and user.args[1] != gathered for user in node.users
        ):
            widened.setdefault(planned, []).append(str(node.target))
    for planned, names in widened.items():
        warnings.warn(
            f"amp_graph.plan_fsdp planned the FSDP2 all-gather of {len(names)} parameters "
            f"for {planned} (every read a cast to that dtype), but this graph reads them "
            f"wider: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}. They arrive "
            f"rounded by the low all-gather. Plan again with this policy before sharding "
            f"(amp_graph.plan_fsdp(model, units, policy, ...)), or shard without the plan.",
            UserWarning,
            stacklevel=2,
        )
    count = sum(len(names) for names in widened.values())
    return PassResult(gm, modified=False, stats={"planned_reads_widened": count})


__all__ = ["fsdp_planned_reads"]
