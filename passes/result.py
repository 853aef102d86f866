"""The typed result every pass returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx


@dataclass
class PassResult:
    """A pass's output: the (possibly same) GraphModule, whether it changed, and counters.

    A pass edits ``graph_module.graph`` and leaves the generated code alone: the driver
    (:func:`run_passes`) recompiles once, after the last pass. Running a pass on its own,
    call ``graph_module.recompile()`` before calling the module.

    ``stats`` holds what the pass counted (``{"casts_inserted": 12}``); the driver sums
    them into the compile summary.
    """

    graph_module: fx.GraphModule
    modified: bool
    stats: dict[str, int] = field(default_factory=dict)
