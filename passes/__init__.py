"""amp_graph's graph passes: each takes a GraphModule and returns a :class:`PassResult`.

One pass per module, named as the module: ``from amp_graph.passes.classify import classify``
(this package re-exports the pipeline and the vocabulary, never a name that would hide a
module of its own).

Installed as ``amp_graph.passes``. The passes talk through ``node.meta["amp"]``
(:class:`~passes.meta.AmpInfo`). The graph they take is flat: :func:`inline_regions` makes the
model's autocast / no_grad blocks flat, each node recording its block, as part of the captured
form (``amp_graph.frontends.front_door.rewrite`` runs it). Then :func:`run_passes` runs, in order:

1. :mod:`classify` - each node's policy rule and what decided it;
2. :mod:`assign_dtypes` - compute dtype and output dtype of every node;
3. :mod:`place_casts` - under O2 (``Policy.place_casts``, its default), the ops only its
   default rule makes low labelled low or float32 by an exact minimum cut of the cast bytes
   (:mod:`cast_cut`); it only raises ops to float32;
4. :mod:`widen_parameters` - given O2's low copies of float32 masters (a ``Graph``), those
   the plan reads only in float32 planned stored in float32;
5. :mod:`low_extremes` - float32's extremes baked as a scalar (``finfo(x.dtype).min`` read
   where dynamo traced float32) made the low dtype's, where the op is planned low;
6. :mod:`insert_casts` - the plan as cast nodes, one per (consumer, input); with
   ``Policy.output_dtype``, :mod:`cast_outputs` - the outputs computed narrower than float32
   returned in float32;
7. :mod:`simplify_casts` - a rule table removes casts that change nothing;
8. :mod:`verify` - lint plus dtype consistency with the plan;
9. :mod:`absorb_casts` - a widening cast folded into the one op that reads it, where that op
   takes ``dtype=`` (softmax, log_softmax, sum, mean);
10. :mod:`fsdp_hooks` - FSDP2's forward hooks called at each unit's boundary (sharded models);
11. :mod:`fsdp_planned_reads` - a warning where a parameter ``plan_fsdp`` gathers low is read
   wider (reads only);
12. :func:`outline_checkpoints` - the model's activation checkpoints, recomputed in backward;
13. :mod:`recompute_casts` - casts whose source outlives the forward, cast again in backward
   instead of kept (weights' low-precision copies, widened activations).

They take one IR: the aten-level GraphModule amp_graph's capture makes, with an example value
on every node (:func:`~passes.pipeline.require_captured_graph` says so where it is not).

Invariants no pass may break: the user's module is never modified; parameters are never
copied (casts read them); casts the model wrote and in-place ops are never altered;
integer, bool and float64 values are never cast; a cast chain is folded only if lossless.
"""

from .assign_dtypes import propagate_dtypes
from .checkpoints import outline_checkpoints
from .meta import AMP, CHECKPOINT_REGION, REGION, UNKNOWN, AmpInfo, Role
from .pipeline import PassError, PipelineResult, run_passes
from .regions import AutocastRegion, inline_regions
from .result import PassResult
from .simplify_casts import CAST_RULES
from .verify import VerificationError

__all__ = [
    "AMP",
    "CAST_RULES",
    "CHECKPOINT_REGION",
    "REGION",
    "UNKNOWN",
    "AmpInfo",
    "AutocastRegion",
    "PassError",
    "PassResult",
    "PipelineResult",
    "Role",
    "VerificationError",
    "inline_regions",
    "outline_checkpoints",
    "propagate_dtypes",
    "run_passes",
]
