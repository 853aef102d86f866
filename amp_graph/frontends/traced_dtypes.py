"""The dtypes dynamo traced, as the torch.compile backend meets them (one job: what a graph's
baked dtypes mean for the plan, and the autocast state the backend's graphs run in).

Dynamo runs the model's Python on the values it is called with, and what that Python reads
from a tensor (``w.dtype``, ``x.to(input_dtype)``, ``torch.zeros(n, dtype=w.dtype)``) is
baked into the graph as a constant. ``amp_graph.compile`` captures under the policy, so its
Python reads the planned dtypes (:mod:`amp_graph.capture.planned_dtypes`); the backend gets
dynamo's graph as traced:

* **Called in float32** (the usual ``compiled(x)``), the constants are float32 where the
  plan computes that tensor in low precision. :func:`baked_dtype_nodes` finds where that
  can change what the model computes: a cast the model wrote that changed nothing in the
  trace but converts a low-precision value to float32 in the plan (``x.to(input_dtype)``
  read from a value the plan makes low), and an op whose kernel takes one dtype whose
  inputs the plan had to promote (``zeros(dtype=w.dtype).scatter(1, idx, w)``). The backend
  says so once, at WARNING (:func:`baked_dtypes_warning`).
* **Called under torch.autocast** in the policy's dtype, dynamo traces the dtypes autocast
  gives, and the backend turns autocast off inside its graphs (:func:`autocast_off`,
  :func:`without_autocast`) so that its policy alone decides each op. Under
  ``policy="autocast"`` the graph then computes exactly what eager torch.autocast does.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from amp_graph.passes import AMP
from amp_graph.passes.meta import LOW_PRECISION, TRACED_NOOP_CAST, VAL, has_cast_role, short
from amp_graph.policy import Rule, base_name
from amp_graph.policy.python_ops import ONE_DTYPE_OPS


def baked_dtype_nodes(gm: fx.GraphModule) -> list[str]:
    """The nodes of a rewritten graph whose dtype a float32 trace may have baked wrong."""
    found = []
    for node in gm.graph.nodes:
        amp = node.meta.get(AMP)
        if amp is None or node.op != "call_function":
            continue
        baked_cast = node.meta.get(TRACED_NOOP_CAST) and _converts_low_to_float32(node)
        promoted = (
            amp.rule is Rule.PROMOTE
            and amp.aten is not None
            and base_name(amp.aten) in ONE_DTYPE_OPS
            and any(has_cast_role(arg) for arg in node.all_input_nodes)
        )
        if baked_cast or promoted:
            found.append(node.name)
    return found


def _converts_low_to_float32(node: fx.Node) -> bool:
    source = node.args[0] if node.args else None
    before = source.meta.get(VAL) if isinstance(source, fx.Node) else None
    after = node.meta.get(VAL)
    return (
        isinstance(before, torch.Tensor)
        and isinstance(after, torch.Tensor)
        and before.dtype in LOW_PRECISION
        and after.dtype == torch.float32
    )


def baked_dtypes_warning(
    where: str, nodes: list[str], policy: str, dtype: torch.dtype, device_type: str
) -> str:
    """The WARNING for :func:`baked_dtype_nodes`' findings, with the two ways out."""
    shown = ", ".join(nodes[:6]) + (f" and {len(nodes) - 6} more" if len(nodes) > 6 else "")
    return (
        f"amp_graph: dynamo traced {where} in float32, so a dtype the model reads from a "
        "tensor (x.to(y.dtype), torch.zeros(..., dtype=w.dtype)) is baked into the graph as "
        f"float32 where policy {policy} computes that tensor in {short(dtype)}. At {shown} the "
        f"graph keeps or promotes to float32 where torch.autocast would compute in "
        f"{short(dtype)}. Call the compiled model under torch.autocast('{device_type}', "
        f"torch.{str(dtype).removeprefix('torch.')}) so that dynamo traces the dtypes autocast "
        "gives (the backend turns autocast off inside its graphs; with policy='autocast' they "
        "then compute exactly as torch.autocast), or use amp_graph.compile, which captures "
        "the dtypes the policy gives."
    )


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """torch.autocast off on ``device_type`` while active (a no-op where it is off)."""
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def without_autocast(compiled: Callable[..., Any], device_type: str) -> Callable[..., Any]:
    """``compiled``, run with torch.autocast off on ``device_type``: the backend's graphs
    already compute each op at the dtype the policy decides, and an ambient autocast would
    cast again over that (a float32 override would compute in low precision)."""

    @functools.wraps(compiled)
    def run(*args: Any) -> Any:
        with torch.autocast(device_type, enabled=False):
            return compiled(*args)

    return run
