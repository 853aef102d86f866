"""amp_graph's graph passes: each takes a GraphModule and returns a :class:`PassResult`.

Installed as ``amp_graph.passes``. The passes talk through ``node.meta["amp"]``
(:class:`~passes.meta.AmpInfo`). The graph they take is flat: :func:`inline_regions` makes the
model's autocast / no_grad blocks flat, each node recording its block, as part of the captured
form (``amp_graph.compiler.rewrite`` runs it). Then :func:`run_passes` runs, in order:

1. :func:`classify` - each node's policy rule and what decided it;
2. :func:`assign_dtypes` - compute dtype and output dtype of every node;
3. :func:`insert_casts` - the plan as cast nodes, one per (consumer, input);
4. :func:`simplify_casts` - a rule table removes casts that change nothing;
5. :func:`verify` - lint plus dtype consistency with the plan;
6. :func:`absorb_casts` - a widening cast folded into the one op that reads it, where that op
   takes ``dtype=`` (softmax, log_softmax, sum, mean);
7. :func:`fsdp_hooks` - FSDP2's forward hooks called at each unit's boundary (sharded models);
8. :func:`fsdp_planned_reads` - a warning where a parameter ``plan_fsdp`` gathers low is read
   wider (reads only);
9. :func:`outline_checkpoints` - the model's activation checkpoints, recomputed in backward;
10. :func:`recompute_casts` - casts whose source outlives the forward, cast again in backward
   instead of kept (weights' low-precision copies, widened activations).

They take one IR: the aten-level GraphModule amp_graph's capture makes, with an example value
on every node (:func:`~passes.pipeline.require_captured_graph` says so where it is not).

Invariants no pass may break: the user's module is never modified; parameters are never
copied (casts read them); casts the model wrote and in-place ops are never altered;
integer, bool and float64 values are never cast; a cast chain is folded only if lossless.
"""

from .absorb_casts import absorb_casts
from .assign_dtypes import assign_dtypes, propagate_dtypes
from .checkpoints import outline_checkpoints
from .classify import classify
from .fsdp_hooks import fsdp_hooks
from .fsdp_planned_reads import fsdp_planned_reads
from .insert_casts import insert_casts
from .meta import AMP, CHECKPOINT_REGION, UNKNOWN, AmpInfo, Role
from .pipeline import PassError, PipelineResult, run_passes
from .recompute_casts import recompute_casts
from .regions import REGION, AutocastRegion, inline_regions
from .result import PassResult
from .simplify_casts import RULES as SIMPLIFY_RULES
from .simplify_casts import simplify_casts
from .verify import VerificationError, verify

__all__ = [
    "AMP",
    "CHECKPOINT_REGION",
    "REGION",
    "SIMPLIFY_RULES",
    "UNKNOWN",
    "AmpInfo",
    "AutocastRegion",
    "PassError",
    "PassResult",
    "PipelineResult",
    "Role",
    "VerificationError",
    "absorb_casts",
    "assign_dtypes",
    "classify",
    "fsdp_hooks",
    "fsdp_planned_reads",
    "inline_regions",
    "insert_casts",
    "outline_checkpoints",
    "propagate_dtypes",
    "recompute_casts",
    "run_passes",
    "simplify_casts",
    "verify",
]
