"""The training step of :class:`amp_graph.Graph` as one graph around the captured ``build``.

:func:`build_step_graph` makes a GraphModule whose nodes zero the gradients, split the
inputs into micro-batches, run the captured ``build`` on each (its forward: the model and
the loss, with amp_graph's casts), scale each loss and run its backward, (O2) move the
gradients to the master weights, unscale and check them (optionally clip), step each
optimizer (skipped on inf/nan), (O2) copy the masters back, update the scale and step the
schedulers. Each stage is one node calling :mod:`amp_graph.training.step_ops`.

This is runtime: it calls the scaler, the optimizers and the master weights. The graph
passes (``amp_graph.passes``) never import it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from amp_graph.passes.meta import AMP, AmpInfo, Role
from amp_graph.policy import Rule
from amp_graph.training import step_ops


def _step_info(op: str, detail: str) -> AmpInfo:
    return AmpInfo(role=Role.RUNTIME, op=op, rule=Rule.FOLLOW, source="step", detail=detail)


@dataclass
class StepPlan:
    """What the step graph does around the captured ``build``.

    The captured ``build`` takes the flat inputs (``inputs``; ``tensor_inputs`` says which
    are tensors, split into micro-batches) and returns flat leaves: those of what ``build``
    returned (``output_positions``, rebuilt with ``output_spec``) and each loss whose
    ``backward`` it called (``loss_positions``). At most one of ``scaler`` (a GradScaler:
    float16 loss scaling) and ``guard`` (a NonFiniteGuard) names the attribute that checks
    gradients; neither, for an evaluation graph (no optimizer).
    """

    inputs: list[str]
    tensor_inputs: list[bool]
    output_positions: list[int]
    output_spec: Any  # a pytree TreeSpec
    loss_positions: list[int]
    micro_batches: int = 1
    optimizers: list[str] = field(default_factory=list)  # attribute names on the root
    fused_steps: list[str] = field(default_factory=list)  # a FusedStep per optimizer
    schedulers: list[str] = field(default_factory=list)
    scaler: str | None = None
    guard: str | None = None
    clip_max_norm: float | None = None
    grads_to_none: bool = True  # False: zeroed in place (a CUDA graph writes them in place)
    master: str | None = None  # attribute name of the MasterWeights (O2)
    weight_casts: list[tuple[str, torch.dtype]] = field(default_factory=list)  # hoisted


# (loss scaling, clipping) -> the node that readies each optimizer's gradients for its step
_GRADIENT_STAGE = {
    (True, False): (step_ops.unscale, "unscale", "unscale and check inf/nan"),
    (True, True): (
        step_ops.unscale_and_clip,
        "unscale_clip",
        "unscale, check inf/nan and clip the 2-norm in one pass",
    ),
    (False, False): (step_ops.check_finite, "check_finite", "check inf/nan (nothing to unscale)"),
    (False, True): (
        step_ops.clip_and_check_finite,
        "clip",
        "clip the 2-norm; a non-finite norm means inf/nan",
    ),
}


def build_step_graph(root: nn.Module, build: fx.GraphModule, plan: StepPlan) -> fx.GraphModule:
    """The full training step as a GraphModule over ``root`` (which holds the optimizers,
    schedulers, scaler or guard, and master weights as attributes); ``build`` is installed
    as the submodule ``build``. Without optimizers: the evaluation step (build, output)."""
    training = bool(plan.optimizers)
    if training and (plan.scaler is None) == (plan.guard is None):
        raise ValueError("a training StepPlan has either a scaler or a guard")
    root.add_module("build", build)
    root.output_spec = (tuple(plan.output_positions), plan.output_spec)  # read by a node
    graph = fx.Graph()

    def call(fn, args: tuple, name: str, detail: str) -> fx.Node:
        node = graph.create_node("call_function", fn, args, {}, name=name)
        node.meta[AMP] = _step_info(fn.__name__, detail)
        return node

    def attr(name: str, detail: str | None = None) -> fx.Node:
        node = graph.create_node("get_attr", name)
        node.meta[AMP] = _step_info("get_attr", detail or f"the step's {name}")
        return node

    inputs = []
    for name in plan.inputs:
        node = graph.placeholder(name)
        node.meta[AMP] = AmpInfo.fixed(Role.INPUT, "input")
        inputs.append(node)
    optimizers = [attr(o) for o in plan.optimizers]
    for i, opt in enumerate(optimizers):
        if plan.grads_to_none:
            call(step_ops.zero_grad, (opt,), f"zero_grad_{i}", "gradients to None before backward")
        else:
            call(step_ops.zero_grad_in_place, (opt,), f"zero_grad_{i}", "gradients zeroed in place")
    micro_inputs = _micro_batches(graph, call, inputs, plan)
    if plan.weight_casts:
        names, dtypes = zip(*plan.weight_casts, strict=True)
        weights = call(
            step_ops.cast_weights,
            (attr("build"), names, dtypes),
            "low_precision_weights",
            "parameters cast once for all micro-batches",
        )
        micro_inputs = [[*args, weights] for args in micro_inputs]
    scaler = attr(plan.scaler) if plan.scaler else None
    results = []
    for i, args in enumerate(micro_inputs):
        leaves = graph.create_node("call_module", "build", tuple(args), {}, name=f"build_{i}")
        leaves.meta[AMP] = _step_info("build", "the captured build: forward and losses")
        for k, position in enumerate(plan.loss_positions):
            _backward(graph, call, scaler, leaves, position, plan.micro_batches, f"{i}_{k}")
        results.append(
            call(
                step_ops.build_output,
                (leaves, attr("output_spec")),
                f"output_{i}",
                "what build returned",
            )
        )
    result = results[0]
    if len(results) > 1:
        result = call(step_ops.mean_of, (results,), "mean_over_micro_batches", "returned losses")
    if training:
        _optimizer_stage(call, attr, optimizers, plan)
    for i, name in enumerate(plan.schedulers):
        call(step_ops.scheduler_step, (attr(name),), f"lr_step_{i}", "advance the LR schedule")
    out = graph.output(result)
    out.meta[AMP] = AmpInfo.fixed(Role.OUTPUT, "output")
    return fx.GraphModule(root, graph, class_name="TrainStep" if training else "EvalStep")


def _micro_batches(graph: fx.Graph, call: Any, inputs: list[fx.Node], plan: StepPlan) -> list:
    """Each micro-batch's inputs: tensors split along dim 0, other inputs as they are."""
    if plan.micro_batches == 1:
        return [inputs]
    chunks = [
        call(torch.chunk, (x, plan.micro_batches), f"{x.name}_micro", "split into micro-batches")
        if is_tensor
        else None
        for x, is_tensor in zip(inputs, plan.tensor_inputs, strict=True)
    ]
    micro = []
    for i in range(plan.micro_batches):
        group = []
        for x, chunk in zip(inputs, chunks, strict=True):
            if chunk is None:
                group.append(x)
                continue
            item = graph.call_function(operator.getitem, (chunk, i))
            item.meta[AMP] = _step_info("getitem", "one micro-batch")
            group.append(item)
        micro.append(group)
    return micro


def _backward(
    graph: fx.Graph,
    call: Any,
    scaler: fx.Node | None,
    leaves: fx.Node,
    position: int,
    micro_batches: int,
    suffix: str,
) -> None:
    """``backward`` of one loss build computed: scaled (float16), or averaged over the
    micro-batches, or as it is."""
    loss = graph.call_function(operator.getitem, (leaves, position))
    loss.meta[AMP] = _step_info("getitem", "a loss build called backward on")
    loss.name = f"loss_{suffix}"
    if scaler is not None:
        loss = call(
            step_ops.scale_loss,
            (scaler, loss, micro_batches),
            f"loss_{suffix}_scaled",
            "loss times the loss scale, before backward",
        )
    elif micro_batches > 1:
        loss = call(
            step_ops.average_loss,
            (loss, micro_batches),
            f"loss_{suffix}_averaged",
            "loss over the number of micro-batches, before backward",
        )
    call(step_ops.backward, (loss,), f"backward_{suffix}", "the backward pass of this loss")


def _optimizer_stage(call: Any, attr: Any, optimizers: list[fx.Node], plan: StepPlan) -> None:
    checker = attr(plan.scaler or plan.guard)
    if plan.master:
        call(step_ops.master_grads, (attr(plan.master),), "grads_to_master", "O2 gradients to fp32")
    scaling = plan.scaler is not None
    fn, label, detail = _GRADIENT_STAGE[scaling, plan.clip_max_norm is not None]
    for i, opt in enumerate(optimizers):
        clip = () if plan.clip_max_norm is None else (plan.clip_max_norm,)
        call(fn, (checker, opt, *clip), f"{label}_{i}", detail)
    step_fn = step_ops.optimizer_step if scaling else step_ops.step_if_finite
    for i, opt in enumerate(optimizers):
        fused = ()
        if plan.fused_steps:
            detail = f"steps optimizer_{i} without torch.optim's per-call Python (FusedStep)"
            fused = (attr(plan.fused_steps[i], detail),)
        call(step_fn, (checker, opt, *fused), f"step_{i}", "step unless inf/nan was found")
    if plan.master:
        call(step_ops.master_to_model, (attr(plan.master),), "master_to_model", "O2 copy back")
    if scaling:
        call(step_ops.update_scale, (checker,), "update_scale", "grow or back off the loss scale")
    else:
        call(step_ops.end_step, (checker,), "end_step", "count a skipped step, reset the flag")


__all__ = ["StepPlan", "build_step_graph"]
