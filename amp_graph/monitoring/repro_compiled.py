"""The repro bundle of the first skipped step of a compiled module trained in the user's own
loop (:func:`amp_graph.replay` reruns its forward and backward bit for bit).

``amp_graph.monitor(compiled, repro_dir=..., optimizer=opt, scaler=scaler)``. A step is one
call of the compiled module with gradients enabled, followed by the loop's backward and
``scaler.step(opt)``; one forward per optimizer step (a loop that accumulates gradients over
several calls is not what the bundle describes). For the step running, the recorder keeps:

* the call's arguments (a reference: do not write into a batch in place before the next
  call), the CPU RNG state (and each GPU's);
* copies of the buffers the steps write (every buffer before the first step, whose end shows
  which it wrote; those alone after), the optimizer's hyperparameters and the scheduler's
  state (a scheduler steps on a skipped step too), the scaler's scale and counters (device
  copies);
* as backward makes them: the gradient reaching each output of the call (the loss's
  gradient at the step's scale: replay's backward starts there; a reference) and a copy of
  each parameter's gradient, taken when backward has accumulated it: the loop changes the
  gradient in place afterwards (``scaler.step`` and ``unscale_`` divide it by the scale,
  ``clip_grad_norm_`` multiplies it, ``zero_grad(set_to_none=False)`` zeroes it), and
  replay compares the gradient backward computed, at the step's scale. Kept until the next
  call's: one more gradient's worth of memory on the parameters' device, and one device
  copy of every gradient per step.

At the next call (or when ``monitor.repro_path`` is read, or the monitor is closed) it asks
the scaler whether that step was skipped: one host read per step, only with ``repro_dir``.
amp_graph's ``GradScaler`` counts its skipped steps; torch's lowers its scale on a skip.

The first skipped step's bundle, ``repro_dir/step_<N>/``: ``batch.pt`` (``(args, kwargs)``),
``rng.pt``, ``state.pt`` (``model``, ``optimizer``, ``scheduler``, ``scaler`` as they were
before the step: the skip left parameters and optimizer state as they were, so those are
read then), ``step_result.pt`` (the output, the output gradients, the parameters' gradients,
the buffers after), ``policy.txt`` and ``policy.json`` (the policy as plain data),
``graph.txt`` and ``meta.json`` (``"kind": "compile"``).
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from amp_graph.frontends.front_door import COMPILE_META

from .repro import (
    META_FILE,
    _same,
    detached,
    hyperparameters,
    restore_hyperparameters,
    rng_states,
    write_policy,
)

log = logging.getLogger(__name__)


@dataclass
class _Step:
    """What one call of the compiled module needs to be replayed (see the module)."""

    step: int
    args: tuple
    kwargs: dict
    rng: dict[str, Any]
    buffers: dict[str, torch.Tensor]
    hyperparameters: list[dict[str, Any]]
    scheduler: dict[str, Any] | None
    scaler: dict[str, Any]
    training: bool
    out: Any = None
    output_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


class CompiledReproRecorder:
    """Keeps the running call's :class:`_Step` of ``compiled`` (hooked on ``target``, the
    module the loop calls); writes the bundle of the first skipped one (:meth:`check`)."""

    def __init__(
        self,
        directory: str | Path,
        target: nn.Module,
        compiled: Any,
        optimizer: torch.optim.Optimizer,
        scaler: Any,
        scheduler: Any = None,
    ) -> None:
        self.directory = Path(directory)
        self.compiled, self.optimizer, self.scaler = compiled, optimizer, scaler
        self.scheduler = scheduler
        self.model: nn.Module = compiled._orig_mod
        self.written: Path | None = None
        self.steps = 0
        self._last: _Step | None = None
        self._written_buffers: set[str] | None = None
        self._handles = [
            target.register_forward_pre_hook(self._before, with_kwargs=True),
            target.register_forward_hook(self._after),
        ]
        self._handles += [
            p.register_post_accumulate_grad_hook(self._grad_keeper(name))
            for name, p in self.model.named_parameters()
            if p.requires_grad
        ]

    def remove(self) -> None:
        """Take the hooks off the module and its parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---- per call ----------------------------------------------------------------------

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or torch.compiler.is_exporting():
            return  # an evaluation call (not a step), or compile_'s capture tracing it
        self.check()
        step, self.steps = self.steps, self.steps + 1
        if self.written is not None:
            return  # the first skipped step only
        self._last = _Step(
            step=step,
            args=args,
            kwargs=dict(kwargs),
            rng=rng_states(),
            buffers=self._buffers_to_keep(),
            hyperparameters=hyperparameters(self.optimizer),
            scheduler=_state_copy(self.scheduler),
            scaler=_scaler_before(self.scaler),
            training=self.model.training,
        )

    def _after(self, module: nn.Module, args: tuple, out: Any) -> None:
        last = self._last
        skipped = not torch.is_grad_enabled() or torch.compiler.is_exporting()
        if last is None or last.out is not None or skipped:
            return
        if self._written_buffers is None:  # the first step: which buffers it wrote
            now = dict(self.model.named_buffers())
            self._written_buffers = {k for k, v in last.buffers.items() if not _same(v, now[k])}
        last.out = detached(out)
        for i, leaf in enumerate(pytree.tree_leaves(out)):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self._output_grad_keeper(last, i))

    def _output_grad_keeper(self, last: _Step, index: int) -> Any:
        def keep(grad: torch.Tensor) -> None:
            last.output_grads[index] = grad

        return keep

    def _grad_keeper(self, name: str) -> Any:
        def keep(param: torch.Tensor) -> None:
            # a copy: the loop's scaler unscales this very tensor in place after backward
            if self._last is not None and param.grad is not None:
                self._last.grads[name] = param.grad.detach().clone()

        return keep

    def _buffers_to_keep(self) -> dict[str, torch.Tensor]:
        return {
            name: b.detach().clone()
            for name, b in self.model.named_buffers()
            if self._written_buffers is None or name in self._written_buffers
        }

    # ---- the skipped step --------------------------------------------------------------

    def check(self) -> Path | None:
        """If the step kept was skipped, write its bundle (once); the path, or None."""
        last, self._last = self._last, None
        if last is None or last.out is None or self.written is not None:
            return self.written
        if not _was_skipped(self.scaler, last.scaler):  # the one host read per step
            return None
        self.written = self._write(self.directory / f"step_{last.step}", last)
        log.warning(
            "amp_graph.monitor: step %d was skipped (inf/nan gradients); its repro bundle is in "
            "%s: amp_graph.replay(%r, model=..., optimizer=...) reruns it",
            last.step,
            self.written,
            str(self.written),
        )
        return self.written

    def _write(self, path: Path, last: _Step) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        model_state = self.model.state_dict()
        model_state.update(last.buffers)
        optimizer_state = self.optimizer.state_dict()
        restore_hyperparameters(optimizer_state, last.hyperparameters)
        state = {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": last.scheduler,
            "scaler": _scaler_state(self.scaler, last.scaler),
        }
        torch.save((last.args, last.kwargs), path / "batch.pt")
        torch.save(last.rng, path / "rng.pt")
        torch.save(state, path / "state.pt")
        outputs = pytree.tree_leaves(last.out)
        result = {
            "out": last.out,
            "output_grads": [last.output_grads.get(i) for i in range(len(outputs))],
            "grads": last.grads,
            "buffers": {n: b.detach().clone() for n, b in self.model.named_buffers()},
        }
        torch.save(result, path / "step_result.pt")
        graph = self.compiled.graph_module
        record = graph.meta[COMPILE_META]
        write_policy(path, record)
        (path / "graph.txt").write_text(f"# the compiled module's graph\n{graph.code}\n")
        cls = type(self.model)
        meta = {
            "kind": "compile",
            "step": last.step,
            "model_class": f"{cls.__module__}:{cls.__qualname__}",
            "skipped_by": "scaler",
            "loss_scale": state["scaler"].get("scale"),
            "dtype": str(record.dtype),
            "policy": record.policy.name,
            "device": str(_device_of(self.model)),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),  # a CPU reduction's order depends on it
            "training": last.training,
            "grads_kept": True,
            "note": "",
        }
        (path / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        return path


def _scaler_before(scaler: Any) -> dict[str, Any]:
    """Device copies of what a step changes in the scaler (no host read)."""
    if hasattr(scaler, "pre_step_state"):  # amp_graph.GradScaler
        return {
            "amp_graph": scaler.pre_step_state(),
            "skipped": _copy(scaler.skipped_steps_counter),
        }
    return {
        "scale": _copy(getattr(scaler, "_scale", None)),
        "init_scale": float(getattr(scaler, "_init_scale", 2.0**16)),
        "growth_tracker": _copy(getattr(scaler, "_growth_tracker", None)),
    }


def _state_copy(scheduler: Any) -> dict[str, Any] | None:
    return None if scheduler is None else copy.deepcopy(scheduler.state_dict())


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _was_skipped(scaler: Any, before: dict[str, Any]) -> bool:
    """Whether the step whose scaler state was ``before`` skipped its optimizer step."""
    if "amp_graph" in before:
        now = torch.as_tensor(scaler.skipped_steps_counter)
        return bool((now > torch.as_tensor(before["skipped"]).to(now.device)).item())
    scale = getattr(scaler, "_scale", None)
    if scale is None:
        return False  # never scaled: no step of it
    was = before["scale"]
    was = torch.tensor(before["init_scale"]) if was is None else was
    return bool((scale.detach().cpu() < was.cpu()).item())  # torch lowers its scale on a skip


def _scaler_state(scaler: Any, before: dict[str, Any]) -> dict[str, Any]:
    """The scaler's ``state_dict()`` as it was before the step."""
    if "amp_graph" in before:
        return scaler.state_dict_from(before["amp_graph"])
    state = scaler.state_dict()
    if before["scale"] is not None:
        state["scale"] = float(before["scale"].item())
    else:
        state["scale"] = before["init_scale"]
    if before["growth_tracker"] is not None:
        state["_growth_tracker"] = int(before["growth_tracker"].item())
    return state


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


__all__ = ["CompiledReproRecorder"]
