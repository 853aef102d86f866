"""The repro bundle of the first skipped step (:func:`amp_graph.replay` reruns it).

With ``repro_dir``, the monitor of an :class:`amp_graph.Graph` keeps, for the step running,
what it needs to replay it, and when a step is skipped (the loss scaler or the non-finite
guard found inf/nan gradients) writes ``repro_dir/step_<N>/``:

* ``batch.pt``: the step's inputs; ``rng.pt``: the RNG states it started from;
* ``state.pt``: ``Graph.state_dict()`` as it was before the step: modules, optimizers,
  schedulers, scaler, step counter;
* ``step_result.pt``: what the step returned, the gradients it computed and the buffers it
  wrote (to check the replay bit for bit);
* ``policy.txt`` and ``policy.json`` (the policy as plain data, never a pickle: a bundle is
  read with ``weights_only=True``, :mod:`amp_graph.inspect.bundle_files`), ``graph.txt``
  (the step graph and the build graph, as printed), ``meta.json``.

What is kept per step, and what is not copied: a skipped step changes no parameter and no
optimizer state, so those are read after it, not copied before it. Per step the monitor
keeps a reference to the inputs (not a copy: do not write into a batch in place before the
next step), the CPU RNG state (5 KB on the host, and each GPU's), a copy of the buffers the
steps write (BatchNorm's running statistics: two values per channel; none in a model
without such buffers: before the first step every buffer is copied, and compared after it
to learn which the steps write), the optimizers' hyperparameters and the schedulers' states (the
schedulers step even on a skipped step), and a device copy of the scale and skip
counters. Deciding whether a step was skipped reads its skip counter on the host, at the
start of the next step: one read per step (on a GPU a synchronization, waiting for the
step to finish), only with ``repro_dir``.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from amp_graph.frontends.front_door import COMPILE_META
from amp_graph.policy.policy_data import PolicyNotData, policy_as_data

log = logging.getLogger(__name__)

META_FILE = "meta.json"


@dataclass
class _PreStep:
    """What one step of a Graph needs to be replayed (see the module)."""

    step: int
    inputs: tuple
    rng: dict[str, Any]
    buffers: dict[str, dict[str, torch.Tensor]]
    hyperparameters: list[list[dict[str, Any]]]
    schedulers: list[dict[str, Any]]
    scaler: dict[str, torch.Tensor | None] | None
    skipped_before: torch.Tensor | int
    out: Any = None
    skipped_after: torch.Tensor | int | None = None


class ReproRecorder:
    """Keeps the running step's :class:`_PreStep`; writes the bundle of the first one that
    was skipped (:meth:`resolve`, at the start of the next step, or at the monitor's
    ``close``)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.written: Path | None = None
        self.graph: Any = None  # the Graph whose steps it keeps
        self._last: _PreStep | None = None
        self._written: set[tuple[str, str]] | None = None  # (module, buffer) a step writes

    def before(self, graph: Any, inputs: tuple, step: int) -> None:
        self.graph = graph
        self.resolve(graph)
        if self.written is not None:
            return  # the first skipped step only
        scaler = graph.grad_scaler
        self._last = _PreStep(
            step=step,
            inputs=inputs,
            rng=rng_states(),
            buffers=self._buffers_to_keep(graph),
            hyperparameters=[hyperparameters(opt) for opt in graph.optimizers],
            schedulers=[copy.deepcopy(s.state_dict()) for s in graph.lr_schedulers],
            scaler=None if scaler is None else scaler.pre_step_state(),
            skipped_before=graph.skipped_steps_counter,
        )

    def _buffers_to_keep(self, graph: Any) -> dict[str, dict[str, torch.Tensor]]:
        """Copies of the buffers the steps write: every buffer before the first step, whose
        end shows which it wrote (:meth:`after`); those alone after it."""
        kept: dict[str, dict[str, torch.Tensor]] = {}
        for name, module in graph.registered_modules.items():
            for key, buffer in module.named_buffers():
                if self._written is None or (name, key) in self._written:
                    kept.setdefault(name, {})[key] = buffer.detach().clone()
        return kept

    def after(self, graph: Any, out: Any) -> None:
        if self._written is None and self._last is not None:  # the first step: which changed
            modules = graph.registered_modules
            self._written = {
                (name, key)
                for name, copies in self._last.buffers.items()
                for key, before in copies.items()
                if not _same(before, modules[name].get_buffer(key))
            }
        if self._last is not None:
            self._last.out = out
            self._last.skipped_after = graph.skipped_steps_counter

    def check(self) -> Path | None:
        """The bundle's path, once the step kept is known (a host read: see the module)."""
        if self.graph is not None:
            self.resolve(self.graph)
        return self.written

    def remove(self) -> None:
        """Nothing to take off: a Graph calls its monitor itself."""

    def resolve(self, graph: Any) -> Path | None:
        """If the step kept was skipped, write its bundle (once); the path, or None."""
        last, self._last = self._last, None
        if last is None or last.skipped_after is None:
            return None
        skipped = torch.as_tensor(last.skipped_after) > torch.as_tensor(last.skipped_before)
        if not bool(skipped.item()):  # the one host read per step
            return None
        self.written = write_bundle(self.directory / f"step_{last.step}", graph, last)
        log.warning(
            "amp_graph.monitor: step %d was skipped (inf/nan gradients); its repro bundle is "
            "in %s: amp_graph.replay(%r) (or amp-graph replay %s) reruns it",
            last.step,
            self.written,
            str(self.written),
            self.written,
        )
        return self.written


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same values, NaNs in the same places (a host read: once, after the first step)."""
    if a.shape != b.shape:
        return False
    nan_a, nan_b = a.isnan(), b.isnan()
    return torch.equal(nan_a, nan_b) and torch.equal(
        a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)
    )


def _pre_step_state(graph: Any, last: _PreStep) -> dict[str, Any]:
    """``graph.state_dict()`` as it was before the skipped step ``last``: read now (the skip
    left parameters and optimizer state as they were), with the buffers, hyperparameters,
    schedulers, scaler and counters of before the step."""
    state = graph.state_dict()
    for name, buffers in last.buffers.items():
        state["modules"][name].update(buffers)
    for optimizer_state, groups in zip(state["optimizers"], last.hyperparameters, strict=True):
        restore_hyperparameters(optimizer_state, groups)
    state["schedulers"] = last.schedulers
    scaler = graph.grad_scaler
    if scaler is not None and last.scaler is not None:
        state["scaler"] = scaler.state_dict_from(last.scaler)
    if scaler is None:
        state["nonfinite_guard"] = {"skipped_steps": int(torch.as_tensor(last.skipped_before))}
    state["step"] = last.step
    return state


def buffers_after(graph: Any) -> dict[str, torch.Tensor]:
    """Every buffer of the graph's modules, copied, by ``<module>.<buffer>``: what the step's
    forward wrote (BatchNorm's running statistics) stays finite where its inputs were, so it
    tells two runs of an overflowing step apart where the gradients are all NaN."""
    return {
        f"{name}.{key}": b.detach().clone()
        for name, module in graph.registered_modules.items()
        for key, b in module.named_buffers()
    }


def gradients(graph: Any) -> dict[str, torch.Tensor]:
    """Every ``.grad`` of the graph's modules, copied, by ``<module>.<parameter>``."""
    return {
        f"{name}.{key}": p.grad.detach().clone()
        for name, module in graph.registered_modules.items()
        for key, p in module.named_parameters()
        if p.grad is not None
    }


def write_bundle(path: Path, graph: Any, last: _PreStep) -> Path:
    """Write the bundle of the skipped step ``last`` (see the module) into ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    record = graph.build_graph.meta[COMPILE_META]
    scaler = graph.grad_scaler
    state = _pre_step_state(graph, last)
    loss_scale = None if scaler is None else state["scaler"].get("scale")
    torch.save(last.inputs, path / "batch.pt")
    torch.save(last.rng, path / "rng.pt")
    torch.save(state, path / "state.pt")
    out = last.out.detach() if isinstance(last.out, torch.Tensor) else last.out
    result = {"out": out, "grads": gradients(graph), "buffers": buffers_after(graph)}
    torch.save(result, path / "step_result.pt")
    write_policy(path, record)
    (path / "graph.txt").write_text(
        f"# the step graph\n{graph.step_graph.code}\n\n# build\n{graph.build_graph.code}\n"
    )
    cls = type(graph)
    meta = {
        "step": last.step,
        "graph_class": f"{cls.__module__}:{cls.__qualname__}",
        "skipped_by": "scaler" if scaler is not None else "nonfinite guard",
        "loss_scale": loss_scale,
        "dtype": str(record.dtype),
        "policy": record.policy.name,
        "device": str(_device_of(graph)),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),  # a CPU reduction's order depends on it
        "micro_batches": graph.config.accumulation_steps,
    }
    (path / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return path


def rng_states() -> dict[str, Any]:
    """The RNG states a step starts from: the CPU's, and each GPU's where CUDA is in use."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def set_rng(rng: dict[str, Any]) -> None:
    """Start from the states :func:`rng_states` kept."""
    torch.set_rng_state(rng["cpu"])
    if rng.get("cuda") is not None:
        torch.cuda.set_rng_state_all(rng["cuda"])


def detached(tree: Any) -> Any:
    """``tree`` with each tensor detached (what a step returned, kept without its graph)."""
    return pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, tree)


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's hyperparameters, copied (a scheduler changes them on a skipped
    step too)."""
    return [
        copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups
    ]


def restore_hyperparameters(optimizer_state: dict[str, Any], groups: list[dict]) -> None:
    """Put :func:`hyperparameters`' copies back into an optimizer's ``state_dict()``."""
    for group, kept in zip(optimizer_state["param_groups"], groups, strict=True):
        group.update(kept)


def write_policy(path: Path, record: Any) -> None:
    """``policy.txt`` (always) and ``policy.json`` (the policy as plain data, where it is
    data: :mod:`amp_graph.policy.policy_data`) of a bundle. Never a pickle: a bundle is
    shared, and replaying it must not run code."""
    (path / "policy.txt").write_text(f"{record.policy!r}\ndtype: {record.dtype}\n")
    try:
        data = policy_as_data(record.policy)
    except PolicyNotData as error:  # a function in the policy: policy.txt has it
        log.info("amp_graph: the policy is not plain data (%s); policy.txt has it", error)
        return
    (path / "policy.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _device_of(graph: Any) -> torch.device:
    for _, module in graph.registered_modules.items():
        for p in module.parameters():
            return p.device
    return torch.device("cpu")
