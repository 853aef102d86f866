"""A fused optimizer's step as a step graph calls it: torch's kernel call, without torch.optim's
per-call Python.

``torch.optim.AdamW(..., fused=True).step()`` spends much of a small model's step in Python
around its one kernel: a profiler range, the hooks, the state gathered parameter by parameter
with its checks for lazy initialization, complex and sparse tensors, and the tensors grouped
by device and dtype. On a CPU that was about 230 us of a 700 us ``step()`` for a GPT of 36
parameters (BENCHMARKS.md, "The optimizer step without torch.optim's Python"). A
:class:`~amp_graph.Graph` calls the same optimizer every step, so :class:`FusedStep` checks
only what could make torch's step differ and then makes torch's own call:
``torch._fused_adam_`` / ``torch._fused_adamw_`` / ``torch._fused_sgd_`` with the lists
``step()`` would build, the step counts advanced (and, on a skipped step, taken back) as
torch does. Weights and optimizer state are bit-identical to ``optimizer.step()``'s, on the
CPU and on CUDA (``tests/test_fused_step.py``; the CUDA cases run in ``make gpu-check``).

It defers to ``optimizer.step()`` (the same result, torch's cost) whenever torch's step could
do something else:

* an optimizer that is not exactly ``torch.optim.Adam``, ``AdamW`` or ``SGD`` (a subclass may
  change ``step``), or a group with ``fused`` off or ``differentiable`` on;
* a step hook (the optimizer's or a global one), ``step`` replaced on the instance (except by
  an LR scheduler's counting wrapper, whose count it keeps), arguments to ``step``;
* the profiler running (its trace then shows torch's ``Optimizer.step`` range);
* parameters of one group on more than one device, or elsewhere than the CPU or CUDA; a CUDA
  graph being captured (torch's step checks ``capturable``; a replay runs no Python anyway);
  ``found_inf``, ``grad_scale`` or a tensor learning rate on another device than the
  parameters (torch's step would move them);
* state not created yet (the first step creates it; SGD's momentum buffers and its check of
  the parameters' device and dtype likewise), a sparse gradient, parameters of more than one
  dtype in a group, betas given as tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer

__all__ = ["FusedStep"]

# torch.optim classes whose fused step this module reproduces, by exact type
_ADAM = {torch.optim.Adam: False, torch.optim.AdamW: True}  # -> decoupled weight decay default
_KernelCall = tuple[Any, tuple, dict[str, Any], list[torch.Tensor]]  # fn, args, kwargs, steps


@dataclasses.dataclass
class _Group:
    """One parameter group as a kernel call sees it: the parameters that have gradients, their
    gradients, and the keyword arguments both kernels take alike."""

    options: dict[str, Any]  # the param_groups entry
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    common: dict[str, Any]


class FusedStep:
    """``optimizer.step()`` for a fused torch Adam, AdamW or SGD, with torch's kernel call and
    none of its per-call Python (see the module docstring for when it defers to
    ``optimizer.step()``). Call it as ``optimizer.step`` is called, ``found_inf`` and
    ``grad_scale`` attributes on the optimizer included.

    ``direct_steps`` counts the steps it took without ``optimizer.step()``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.direct_steps = 0
        kind = type(optimizer)
        self._plan = None
        if kind in _ADAM:
            self._plan = self._adam_calls
        elif kind is torch.optim.SGD:
            self._plan = self._sgd_calls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        optimizer = self.optimizer
        calls = None if args or kwargs or self._plan is None else self._calls()
        if calls is None:
            return optimizer.step(*args, **kwargs)
        with torch.no_grad():
            for fn, fn_args, fn_kwargs, steps in calls:
                if steps:
                    torch._foreach_add_(steps, 1)
                fn(*fn_args, **fn_kwargs)
                found_inf = fn_kwargs["found_inf"]
                if steps and found_inf is not None:  # a skipped step is not counted
                    torch._foreach_sub_(steps, [found_inf] * len(steps))
        optimizer._opt_called = True  # type: ignore[attr-defined]  # what schedulers check
        self.direct_steps += 1
        return None

    def _calls(self) -> list[_KernelCall] | None:
        """Every group's kernel call, or None if torch's ``step()`` must run instead. Nothing
        runs before every group has passed its checks."""
        optimizer = self.optimizer
        if not _plain_step(optimizer):
            return None
        found_inf = getattr(optimizer, "found_inf", None)
        grad_scale = getattr(optimizer, "grad_scale", None)
        calls = []
        for group in optimizer.param_groups:
            if not group["fused"] or group["differentiable"]:
                return None
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue  # torch's step does nothing for this group
            grads = [p.grad for p in params]
            device = _one_device_dtype_dense(params, grads)
            if device is None:
                return None
            lr = group["lr"]
            # torch would move these to the parameters' device (a CPU lr it takes as a number)
            on_device = [found_inf, grad_scale]
            if isinstance(lr, torch.Tensor) and not lr.is_cpu:
                on_device.append(lr)
            if any(t is not None and t.device != device for t in on_device):
                return None
            # the arguments both kernels take alike
            common = {
                "lr": lr,
                "weight_decay": group["weight_decay"],
                "maximize": group["maximize"],
                "grad_scale": grad_scale,
                "found_inf": found_inf,
            }
            call = self._plan(_Group(group, params, grads, common))
            if call is None:
                return None
            calls.append(call)
        return calls

    def _adam_calls(self, g: _Group) -> _KernelCall | None:
        """torch.optim.adam._fused_adam's call for one group (one device, one dtype)."""
        group, params = g.options, g.params
        beta1, beta2 = group["betas"]
        if isinstance(beta1, torch.Tensor) or isinstance(beta2, torch.Tensor):
            return None
        amsgrad = group["amsgrad"]
        states = [self.optimizer.state.get(p) for p in params]
        try:
            steps = [state["step"] for state in states]
            exp_avgs = [state["exp_avg"] for state in states]
            exp_avg_sqs = [state["exp_avg_sq"] for state in states]
            max_exp_avg_sqs = [state["max_exp_avg_sq"] for state in states] if amsgrad else []
        except (KeyError, TypeError):  # no state yet (None, or empty): the first step makes it
            return None
        decoupled = group.get("decoupled_weight_decay", _ADAM[type(self.optimizer)])
        fn = torch._fused_adamw_ if decoupled else torch._fused_adam_
        kwargs = {"amsgrad": amsgrad, "beta1": beta1, "beta2": beta2, "eps": group["eps"]}
        kwargs.update(g.common)
        return fn, (params, g.grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps), kwargs, steps

    def _sgd_calls(self, g: _Group) -> _KernelCall | None:
        """torch.optim.sgd._fused_sgd's call for one group, once momentum buffers exist."""
        group = g.options
        if getattr(self.optimizer, "_need_device_dtype_check_for_fused", True):
            return None  # torch's first step checks the parameters' device and dtype
        momentum = group["momentum"]
        buffers = []
        if momentum != 0:
            states = self.optimizer.state
            buffers = [states.get(p, {}).get("momentum_buffer") for p in g.params]
            if any(buffer is None for buffer in buffers):
                return None  # the first step allocates the buffers
        kwargs = {
            "momentum": momentum,
            "dampening": group["dampening"],
            "nesterov": group["nesterov"],
            "is_first_step": False,
        }
        kwargs.update(g.common)
        return torch._fused_sgd_, (g.params, g.grads, buffers), kwargs, []


def _plain_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` would run only torch's step: no hooks, no replaced step
    (an LR scheduler's counting wrapper aside), no profiler to show its range to."""
    global_pre = getattr(torch_optimizer, "_global_optimizer_pre_hooks", None)
    global_post = getattr(torch_optimizer, "_global_optimizer_post_hooks", None)
    if global_pre is None or global_post is None or global_pre or global_post:
        return False
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return False
    replaced = vars(optimizer).get("step")
    if replaced is not None and not getattr(replaced, "_wrapped_by_lr_sched", False):
        return False
    return not torch._C._autograd._profiler_enabled()


def _one_device_dtype_dense(
    params: list[torch.Tensor], grads: list[torch.Tensor]
) -> torch.device | None:
    """The device of ``params`` if they are all on the CPU, or all on one CUDA device with no
    CUDA graph being captured, and of one dtype, with dense gradients: torch's grouping by
    device and dtype then makes one group, in this order. None otherwise."""
    first = params[0]
    dtype = first.dtype
    if first.is_cpu:
        same = [
            p.is_cpu and p.dtype is dtype and not g.is_sparse
            for p, g in zip(params, grads, strict=True)
        ]
    elif first.is_cuda and not torch.cuda.is_current_stream_capturing():
        # (a capture: torch's step checks `capturable`, and a replay runs no Python anyway)
        index = first.get_device()
        same = [
            p.is_cuda and p.get_device() == index and p.dtype is dtype and not g.is_sparse
            for p, g in zip(params, grads, strict=True)
        ]
    else:
        return None
    return first.device if all(same) else None
