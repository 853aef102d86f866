"""Activation checkpoints in dynamo's graphs, kept as checkpoints through the backend.

Dynamo records ``torch.utils.checkpoint`` as ``tag_activation_checkpoint(body, *inputs)``
over a body submodule. The backend's retrace cannot take that op as it is, and the passes
take one flat graph; so the backend inlines each body, marked with its region
(:func:`inline_checkpoints`), moves the marks where ``outline_checkpoints`` reads them after
the retrace (:func:`mark_checkpoint_regions`), which makes each region a checkpoint again as
for :func:`amp_graph.compile`, and hands an inner backend other than eager the regions as
dynamo's op (:func:`checkpoints_as_dynamo_records_them`), which AOTAutograd recomputes.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from amp_graph.capture import CaptureError
from amp_graph.passes.graph_copy import copy_graph_module
from amp_graph.passes.meta import CHECKPOINT_REGION

# dynamo's record of torch.utils.checkpoint: tag_activation_checkpoint(body, *inputs)
CHECKPOINT_HOP = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)


def inline_checkpoints(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm``, or where it holds activation checkpoints, a copy in which each one (dynamo's
    ``tag_activation_checkpoint`` over a body submodule) is replaced by its body's nodes, each
    marked with its region (``meta["custom"][CHECKPOINT_REGION]``).

    Why: the passes take one flat graph, and the retrace cannot take dynamo's checkpoint as
    it is (torch's pre-dispatch rule reads ``meta["_checkpoint_context_fn"]``, which dynamo
    sets only when a ``context_fn`` is given). ``make_fx`` carries ``meta["custom"]`` to the
    aten ops of the retrace; :func:`mark_checkpoint_regions` moves the mark where
    ``outline_checkpoints`` reads it, which makes each region a checkpoint again, as it does
    for :func:`amp_graph.compile`. Guarantees: ``gm`` itself is not modified; the copy
    computes every value ``gm`` computes.

    Raises:
        CaptureError: a checkpoint given ``context_fn`` (selective checkpointing, whose policy
            the outlined region would drop) or holding another (a nested checkpoint).
    """
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is CHECKPOINT_HOP]
    if not calls:
        return gm
    flat = copy_graph_module(gm)
    calls = [n for n in flat.graph.nodes if n.op == "call_function" and n.target is CHECKPOINT_HOP]
    for region, call in enumerate(calls):
        _inline_checkpoint(flat, call, region)
    flat.graph.eliminate_dead_code()  # the bodies' get_attr nodes
    flat.delete_all_unused_submodules()
    flat.recompile()
    return flat


def _inline_checkpoint(gm: fx.GraphModule, call: fx.Node, region: int) -> None:
    """Replace ``call``, one ``tag_activation_checkpoint(body, *inputs)``, by the body's
    nodes marked with ``region``; its ``getitem`` users read the body's outputs directly."""
    body = getattr(gm, call.args[0].target)
    _check_plain_checkpoint(body, call)
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    env: dict[fx.Node, Any] = dict(zip(placeholders, call.args[1:], strict=True))
    with gm.graph.inserting_before(call):
        for node in body.graph.nodes:
            if node.op == "get_attr":  # a custom autograd Function's bodies, moved to gm
                env[node] = _moved_attribute(gm, body, node)
        outputs = gm.graph.graph_copy(body.graph, env)
    for node in env.values():
        if isinstance(node, fx.Node) and node.graph is gm.graph and node not in call.args:
            node.meta["custom"] = {**node.meta.get("custom", {}), CHECKPOINT_REGION: region}
    for user in list(call.users):
        if user.target is not operator.getitem or not isinstance(outputs, (tuple, list)):
            raise CaptureError(_checkpoint_refused(call, "its outputs are read whole"))
        user.replace_all_uses_with(outputs[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(call)


def _moved_attribute(gm: fx.GraphModule, body: fx.GraphModule, node: fx.Node) -> fx.Node:
    """A ``get_attr`` node of ``gm`` for the attribute ``node`` reads from ``body``, which
    is set on ``gm`` under a fresh name."""
    value = operator.attrgetter(node.target)(body)
    name = node.target.replace(".", "_")
    while hasattr(gm, name):
        name = f"{name}_"
    if isinstance(value, torch.nn.Module):
        gm.add_submodule(name, value)
    else:
        setattr(gm, name, value)
    moved = gm.graph.get_attr(name)
    moved.meta = dict(node.meta)
    return moved


def _check_plain_checkpoint(body: fx.GraphModule, call: fx.Node) -> None:
    if "_checkpoint_context_fn" in body.meta:
        raise CaptureError(_checkpoint_refused(call, "it is given context_fn="))
    if any(n.target is CHECKPOINT_HOP for n in body.graph.nodes):
        raise CaptureError(_checkpoint_refused(call, "it holds another checkpoint"))


def _checkpoint_refused(call: fx.Node, why: str) -> str:
    lines = [ln.strip() for ln in call.meta.get("stack_trace", "").splitlines()]
    where = next((ln for ln in reversed(lines) if ln.startswith("File")), "")
    return (
        f"amp_graph's torch.compile backend cannot keep the torch.utils.checkpoint call "
        f"{where or call.name}: {why}. Checkpoint plain functions "
        "(checkpoint(fn, *args, use_reentrant=False), no context_fn), or use "
        "amp_graph.compile(model, ...), which keeps checkpoints (docs/backend.md)."
    )


def mark_checkpoint_regions(aten_gm: fx.GraphModule) -> None:
    """Move the region marks :func:`inline_checkpoints` left in ``meta["custom"]`` to
    ``meta[CHECKPOINT_REGION]``, where ``outline_checkpoints`` reads them."""
    for node in aten_gm.graph.nodes:
        custom = node.meta.get("custom")
        if custom and CHECKPOINT_REGION in custom:
            node.meta[CHECKPOINT_REGION] = custom[CHECKPOINT_REGION]
            rest = {k: v for k, v in custom.items() if k != CHECKPOINT_REGION}
            if rest:
                node.meta["custom"] = rest
            else:
                del node.meta["custom"]


def checkpoints_as_dynamo_records_them(gm: fx.GraphModule) -> None:
    """Call each outlined checkpoint (``torch.utils.checkpoint.checkpoint(self.checkpoint_k,
    ...)``) through ``tag_activation_checkpoint`` instead, as dynamo hands checkpoints to a
    backend; in place. Why: AOTAutograd traces through a plain checkpoint call (nothing
    would be recomputed), but recomputes the higher-order op's body, as under
    ``torch.compile`` with torch.autocast (the same tensors saved; tested)."""
    calls = [n for n in gm.graph.nodes if n.target is torch.utils.checkpoint.checkpoint]
    for node in calls:
        node.target = CHECKPOINT_HOP
    if calls:
        gm.recompile()


__all__ = [
    "CHECKPOINT_HOP",
    "checkpoints_as_dynamo_records_them",
    "inline_checkpoints",
    "mark_checkpoint_regions",
]
