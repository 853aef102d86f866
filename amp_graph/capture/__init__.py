"""The capture layer: model code as people write it, to an aten-level FX graph with exact dtypes.

* :mod:`~amp_graph.capture.model_capture` - ``torch.export`` (non-strict) of the model on fake
  tensors, under the policy's autocast; :func:`capture_for_policy` is the entry point;
* :mod:`~amp_graph.capture.planned_dtypes` - the torch-function mode that makes the fake
  values carry the dtypes the plan will give them (O2/O3, FSDP2's gathered parameters);
* :mod:`~amp_graph.capture.casts` - casts to a dtype read from a tensor, recorded as the plan
  means them;
* :mod:`~amp_graph.capture.fsdp_units` - FSDP2 units and their mixed-precision policies;
* :mod:`~amp_graph.capture.host_random` - random numbers the forward draws on the host, which
  one graph would replay on every call;
* :mod:`~amp_graph.capture.autograd_functions` - custom ``torch.autograd.Function`` s kept
  whole, one node calling their own ``apply``, so that their backward runs;
* :mod:`~amp_graph.capture.dynamo_retrace` - the torch.compile backend's capture: dynamo's graph
  retraced to aten ops (:func:`capture_graph`);
* :mod:`~amp_graph.capture.capture_error` - :class:`CaptureError`, what could not be captured.
"""

from .dynamo_retrace import capture_graph
from .model_capture import (
    EXPORT_FACTS,
    MODEL_ATTR,
    Captured,
    CaptureError,
    ExportFacts,
    ShapeGuard,
    capture_autocast,
    capture_for_policy,
    capture_module,
    export_refused,
    gc_paused,
    set_dotted_attr,
)

__all__ = [
    "EXPORT_FACTS",
    "MODEL_ATTR",
    "CaptureError",
    "Captured",
    "ExportFacts",
    "ShapeGuard",
    "capture_autocast",
    "capture_for_policy",
    "capture_graph",
    "capture_module",
    "export_refused",
    "gc_paused",
    "set_dotted_attr",
]
