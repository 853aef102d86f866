"""Training-step passes for :class:`amp_graph.Graph`.

* :func:`scale_losses`: every ``loss.backward()`` in the captured ``build`` graph receives
  the scaled loss instead (``scale_loss(scaler, loss, micro_batches)``); the graph still
  returns the unscaled loss.
* :func:`build_step_graph`: the whole training step as one graph around the captured
  ``build``: zero the gradients, run each micro-batch, (O2) move gradients to the master
  weights, unscale and check (optionally clip), step each optimizer (skipped on overflow),
  (O2) copy the masters back, update the scale, step the schedulers.

Reads: call_method ``backward`` nodes. Writes: new nodes with ``meta["amp"]`` of role
``STEP``. Guarantees: the forward part of the graph is untouched; each backward sees the
loss times the scale (divided by the number of micro-batches); nothing between backward
and the optimizer step reads gradients except the nodes listed above, in that order.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn

from amp_graph import step_ops
from amp_graph.policy import Rule

from .meta import AMP, AmpInfo, Role
from .result import PassResult


def _step_info(op: str, detail: str) -> AmpInfo:
    return AmpInfo(role=Role.STEP, op=op, rule=Rule.FOLLOW, source="step", detail=detail)


def backward_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "backward"]


def scale_losses(gm: fx.GraphModule, scaler_attr: str, micro_batches: int = 1) -> PassResult:
    """Make every ``backward`` run on ``scale_loss(scaler, loss, micro_batches)``.

    The scaler is read from the GraphModule attribute ``scaler_attr``.
    """
    scaled = 0
    for backward in backward_nodes(gm):
        loss = backward.args[0]
        with gm.graph.inserting_before(backward):
            # create_node: graph.get_attr warns for attributes that are not tensors/modules
            scaler = gm.graph.create_node("get_attr", scaler_attr)
            scaler.meta[AMP] = _step_info("get_attr", "the loss scaler")
            node = gm.graph.create_node(
                "call_function",
                step_ops.scale_loss,
                (scaler, loss, micro_batches),
                {},
                name=f"{loss.name}_scaled",
            )
        node.meta[AMP] = _step_info("scale_loss", "loss times the loss scale, before backward")
        backward.replace_input_with(loss, node)
        scaled += 1
    gm.recompile()
    return PassResult(gm, modified=bool(scaled), stats={"losses_scaled": scaled})


@dataclass
class StepPlan:
    """What the step graph does around the captured ``build``."""

    inputs: list[str]
    micro_batches: int = 1
    optimizers: list[str] = field(default_factory=list)  # attribute names on the root
    schedulers: list[str] = field(default_factory=list)
    scaler: str = "scaler"
    clip_max_norm: float | None = None
    master: str | None = None  # attribute name of the MasterWeights (O2)


def build_step_graph(root: nn.Module, micro_step: fx.GraphModule, plan: StepPlan) -> fx.GraphModule:
    """The full training step as a GraphModule over ``root`` (which holds the optimizers,
    schedulers, scaler and master weights as attributes); ``micro_step`` is installed as
    the submodule ``build``."""
    root.add_module("build", micro_step)
    graph = fx.Graph()

    def call(fn, args: tuple, name: str, detail: str) -> fx.Node:
        node = graph.create_node("call_function", fn, args, {}, name=name)
        node.meta[AMP] = _step_info(fn.__name__, detail)
        return node

    def attr(name: str) -> fx.Node:
        node = graph.create_node("get_attr", name)
        node.meta[AMP] = _step_info("get_attr", f"the step's {name}")
        return node

    inputs = []
    for name in plan.inputs:
        node = graph.placeholder(name)
        node.meta[AMP] = AmpInfo.fixed(Role.INPUT, "input")
        inputs.append(node)
    optimizers = [attr(o) for o in plan.optimizers]
    for i, opt in enumerate(optimizers):
        call(step_ops.zero_grad, (opt,), f"zero_grad_{i}", "gradients to None before backward")
    if plan.micro_batches == 1:
        micro_inputs = [inputs]
    else:
        chunks = [
            call(
                torch.chunk, (x, plan.micro_batches), f"{x.name}_micro", "split into micro-batches"
            )
            for x in inputs
        ]
        micro_inputs = [
            [graph.call_function(operator.getitem, (c, i)) for c in chunks]
            for i in range(plan.micro_batches)
        ]
        for group in micro_inputs:
            for node in group:
                node.meta[AMP] = _step_info("getitem", "one micro-batch")
    results = []
    for i, args in enumerate(micro_inputs):
        node = graph.create_node("call_module", "build", tuple(args), {}, name=f"build_{i}")
        node.meta[AMP] = _step_info("build", "forward, scaled backward (the captured build)")
        results.append(node)
    result = results[0]
    if len(results) > 1:
        result = call(step_ops.mean_of, (results,), "mean_over_micro_batches", "returned losses")
    scaler = attr(plan.scaler)
    if plan.master:
        call(step_ops.master_grads, (attr(plan.master),), "grads_to_master", "O2 gradients to fp32")
    for i, opt in enumerate(optimizers):
        if plan.clip_max_norm is None:
            call(step_ops.unscale, (scaler, opt), f"unscale_{i}", "unscale and check inf/nan")
        else:
            call(
                step_ops.unscale_and_clip,
                (scaler, opt, plan.clip_max_norm),
                f"unscale_clip_{i}",
                "unscale, check inf/nan and clip the 2-norm in one pass",
            )
    for i, opt in enumerate(optimizers):
        call(step_ops.optimizer_step, (scaler, opt), f"step_{i}", "step unless inf/nan was found")
    if plan.master:
        call(step_ops.master_to_model, (attr(plan.master),), "master_to_model", "O2 copy back")
    call(step_ops.update_scale, (scaler,), "update_scale", "grow or back off the loss scale")
    for i, name in enumerate(plan.schedulers):
        call(step_ops.scheduler_step, (attr(name),), f"lr_step_{i}", "advance the LR schedule")
    out = graph.output(result)
    out.meta[AMP] = AmpInfo.fixed(Role.OUTPUT, "output")
    gm = fx.GraphModule(root, graph, class_name="TrainStep")
    return gm
