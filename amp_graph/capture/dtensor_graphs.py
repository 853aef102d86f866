"""Dynamo's graphs that compute on DTensors, captured for the torch.compile backend (one job:
a graph dynamo traced on a tensor-parallel model -> aten ops on DTensors, with DTensor's
conversions kept whole).

The backend's usual retrace (:func:`~amp_graph.capture.dynamo_retrace.capture_graph`,
``make_fx`` on dynamo's fake values) cannot run DTensor's dispatch. ``torch.export`` can, and
it is how :func:`amp_graph.compile` captures tensor-parallel models: :func:`capture_dtensor_graph`
exports dynamo's graph as a module, on dynamo's own fake inputs (its fake mode and symbolic
sizes), under the policy's capture, with DTensor's ``from_local`` / ``redistribute`` /
``to_local`` and the model's own autograd Functions kept whole
(:mod:`~amp_graph.capture.autograd_functions`): inlined, a row-parallel layer's reduction
would be a bare ``all_reduce`` with no derivative.

Guarantees: the graph returned has one placeholder per example input, in order, with
dynamo's names and what dynamo recorded about each (``grapharg``, ``example_value``), and
returns what dynamo's graph returns, as a tuple; it reads no state of its own (dynamo lifts
parameters and buffers to inputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from amp_graph.capture.capture_error import CaptureError
from amp_graph.capture.dynamo_retrace import carry_dynamo_records
from amp_graph.capture.model_capture import capture_for_policy
from amp_graph.policy import Policy


def capture_dtensor_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    policy: Policy,
    dtype: torch.dtype,
    device_type: str,
) -> fx.GraphModule:
    """Dynamo's ``gm`` exported to aten ops on DTensors (see the module's docstring)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    captured = capture_for_policy(
        gm, tuple(example_inputs), {}, policy, dtype, device_type=device_type
    )
    traced = captured.graph_module
    new_placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    if len(new_placeholders) != len(placeholders):
        raise CaptureError(
            f"amp_graph's torch.compile backend exported dynamo's tensor-parallel graph with "
            f"{len(new_placeholders)} inputs where dynamo gives {len(placeholders)}; use "
            "amp_graph.compile(model, policy, dtype), which captures tensor-parallel models."
        )
    carry_dynamo_records(gm, traced)
    _return_a_tuple(traced)
    return traced


def _return_a_tuple(gm: fx.GraphModule) -> None:
    """Dynamo calls the compiled graph and unpacks a tuple; export returns its flat list."""
    [output] = [n for n in gm.graph.nodes if n.op == "output"]
    values = output.args[0]
    if not isinstance(values, tuple):
        output.args = (tuple(values) if isinstance(values, list) else (values,),)
    gm.recompile()
