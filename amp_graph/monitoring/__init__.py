"""Numerics while training: statistics of chosen nodes every N steps, as a graph pass.

>>> import torch, amp_graph
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
>>> compiled = amp_graph.compile(model, policy="O1", dtype=torch.bfloat16)
>>> monitor = amp_graph.monitor(compiled, every=2)
>>> for step in range(4):
...     compiled(torch.randn(8, 4)).sum().backward()
>>> monitor.history.steps
[0, 2]
>>> sorted({row["role"] for row in monitor.history})
['grad_output', 'grad_weight', 'input', 'output', 'weight']
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from amp_graph.frontends.compiler import CompiledModule, compiled_in_place

from .core import CSV_NAME, JSONL_NAME, Monitor
from .history import History
from .repro_compiled import CompiledReproRecorder
from .selection import DEFAULT_OPS, SELECTOR_FIELDS, NodeSelection

__all__ = [
    "CSV_NAME",
    "DEFAULT_OPS",
    "JSONL_NAME",
    "SELECTOR_FIELDS",
    "History",
    "Monitor",
    "NodeSelection",
    "monitor",
]


def monitor(
    target: Any,
    every: int = 100,
    *,
    nodes: Any = None,
    stats: Any = None,
    log_dir: str | Path | None = None,
    flush_every: int = 1,
    tensorboard: bool | None = None,
    scaler: Any = None,
    group: Any = None,
    repro_dir: str | Path | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
) -> Monitor:
    """Measure ``target``'s chosen nodes every ``every`` steps; returns the :class:`Monitor`.

    Args:
        target: a module from ``amp_graph.compile`` / ``compile_`` (a step is one call with
            gradients enabled; an evaluation call under ``torch.no_grad`` is none) or an
            ``amp_graph.Graph`` (a step is one call of the graph; the same as
            ``graph.config.enable_monitor(...)``).
        every: steps 0, every, 2*every, ... are logging steps; the others run the graph
            exactly as without a monitor.
        nodes: None: every matrix product, convolution and fp8 quantization. Or selectors as
            a Policy's overrides take them: ``{"modules": ["blocks.*.mlp"], "ops": ["matmul"],
            "module_types": [nn.Conv2d], "nodes": ["linear_3"]}`` (any match counts). A
            selector that selects no op is a ValueError at the first call.
        stats: the statistics to compute, from ``amax``, ``zeros``, ``underflow``,
            ``nonfinite``, ``whatif`` (fp16/bf16/e4m3/e5m2 underflow and overflow); all by
            default (:mod:`amp_graph.ops.tensor_stats` defines each).
        log_dir: write ``monitor.jsonl`` and ``monitor.csv`` there (and TensorBoard scalars,
            where the ``tensorboard`` package is installed), reading the device once every
            ``flush_every`` logging steps, at the start of the step after.
        tensorboard: None: where installed and ``log_dir`` is given; True: required.
        scaler: the GradScaler (amp_graph's or torch's) that scales a compiled module's
            losses: each row then records the ``loss_scale`` the step's gradients were
            measured at. A Graph's own scaler is known without it.
        group: under DDP or FSDP2 each rank measures its own tensors and its rows are its
            own (``rank`` says whose). Given a process group, each read reduces the pending
            steps over it (``amax`` the largest, counts summed): a collective, so every rank
            of the group must read at the same step (``log_dir`` flushes do). Never the world
            group unless it is the one given.
        repro_dir: when a step is skipped for inf/nan gradients, write what
            :func:`amp_graph.replay` needs to rerun it bit for bit under
            ``repro_dir/step_<N>/`` (the first such step; :mod:`amp_graph.monitoring.repro`
            and, for a compiled module, :mod:`amp_graph.monitoring.repro_compiled` say what
            is kept per step, and what it costs). A compiled module's monitor needs the
            loop's ``scaler=`` (which knows the step was skipped) and ``optimizer=`` (and
            its ``scheduler=``, if any) for it.
        optimizer / scheduler: (a compiled module, with ``repro_dir``) the optimizer that
            ``scaler.step`` steps, and its LR scheduler: their state before the skipped step
            goes into the bundle.
    """
    compiled = compiled_in_place(target) or target
    is_compiled = isinstance(compiled, CompiledModule)
    if is_compiled and repro_dir is not None:
        _check_compiled_repro(scaler, optimizer, scheduler)
    elif optimizer is not None or scheduler is not None:
        raise ValueError(
            "monitor optimizer= and scheduler= go with repro_dir= on a compiled module (a "
            "Graph knows its own); drop them, or pass repro_dir="
        )
    made = Monitor(
        every,
        nodes=nodes,
        stats=stats,
        log_dir=log_dir,
        flush_every=flush_every,
        tensorboard=tensorboard,
        scaler=scaler,
        group=group,
        repro_dir=None if is_compiled else repro_dir,
    )
    if is_compiled:
        made.attach(compiled, "_monitor", "compiled module")
        if repro_dir is not None:
            made.repro = CompiledReproRecorder(
                repro_dir, target, compiled, optimizer, scaler, scheduler
            )
        return made
    config = getattr(target, "config", None)
    if callable(getattr(config, "attach_monitor", None)):  # an amp_graph.Graph
        config.attach_monitor(made)
        return made
    raise TypeError(
        "amp_graph.monitor takes a module made by amp_graph.compile or amp_graph.compile_, or "
        f"an amp_graph.Graph; got {type(target).__name__}. Compile the model first: "
        "monitor(amp_graph.compile(model, policy=...))"
    )


def _check_compiled_repro(scaler: Any, optimizer: Any, scheduler: Any) -> None:
    """A compiled module's repro bundle needs the loop's scaler and optimizer: early, named."""
    if scaler is None:
        raise ValueError(
            "repro_dir= on a compiled module needs scaler=, the GradScaler (amp_graph's or "
            "torch.amp's) whose step() skips the optimizer step on inf/nan gradients: it is "
            "how the monitor knows which step to write. monitor(compiled, repro_dir=..., "
            "scaler=scaler, optimizer=optimizer)"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            "repro_dir= on a compiled module needs optimizer=, the torch.optim.Optimizer that "
            f"scaler.step(optimizer) steps (its state goes into the bundle); got {optimizer!r}"
        )
    if scheduler is not None and not callable(getattr(scheduler, "state_dict", None)):
        raise TypeError(
            "monitor scheduler= is the optimizer's LR scheduler (with state_dict()); got "
            f"{type(scheduler).__name__}"
        )
