"""The monitor: per-step statistics of chosen nodes, off the training step's critical path.

A target (a module from ``compile``/``compile_``, or a ``Graph``) asks
:meth:`Monitor.graph_for_step` once per step which graph to run (a compiled module's call
under ``torch.no_grad``, an evaluation, is no step: it runs the graph as it is). A step
that is not a logging step gets the graph as it is: the monitor adds no node, hook or
branch to it. A logging step gets an instrumented copy (``passes.instrument``, made once
per graph) whose probes add their statistics into one device buffer for that step. Nothing
is read on the host until the user asks (:attr:`Monitor.history`, :meth:`Monitor.flush`),
or, with a ``log_dir``, once ``flush_every`` logging steps are pending; each read is one
transfer of every pending buffer.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from amp_graph.ops.tensor_stats import STAT_GROUPS, STATS, StatsSink
from amp_graph.passes.graph_copy import copy_graph_module
from amp_graph.passes.instrument import Probe, computed_order, instrument
from amp_graph.policy import nearest

from .history import History, make_row, write_csv, write_jsonl
from .plot import Heatmap, heatmap
from .repro import ReproRecorder
from .selection import NodeSelection

log = logging.getLogger(__name__)

JSONL_NAME = "monitor.jsonl"
CSV_NAME = "monitor.csv"


@dataclass
class _Instrumented:
    source: weakref.ref[fx.GraphModule]  # the graph it stands in for
    graph_module: fx.GraphModule  # what a logging step runs
    probes: tuple[Probe, ...]
    sink: StatsSink
    device: torch.device
    order: list[int]  # computed_order(probes): the order of a step's rows


@dataclass
class _Pending:
    step: int
    instrumented: _Instrumented
    buffer: torch.Tensor
    loss_scale: torch.Tensor | None  # the scale this step's backward ran at (a device copy)


def _scale_tensor(scaler: Any) -> torch.Tensor | None:
    """The loss scale tensor of an amp_graph or torch GradScaler (None before its first
    ``scale()``, or disabled)."""
    state = getattr(scaler, "_scale_state", None)  # amp_graph.GradScaler
    if state is not None:
        return state.scale if getattr(scaler, "_enabled", True) else None
    return getattr(scaler, "_scale", None)  # torch.amp.GradScaler


def _columns(stats: Any) -> tuple[str, ...]:
    """The STATS names ``stats=`` switches on, in STATS order."""
    if stats is None:
        groups = list(STAT_GROUPS)
    elif isinstance(stats, str) or not hasattr(stats, "__iter__"):
        raise TypeError(f"monitor stats= is a list of {list(STAT_GROUPS)}; got {stats!r}")
    else:
        groups = list(stats)
    for group in groups:
        if group not in STAT_GROUPS:
            raise ValueError(
                f"monitor stats= has no statistic {group!r}; choose from "
                f"{list(STAT_GROUPS)}.{nearest(str(group), STAT_GROUPS)}"
            )
    wanted = {name for group in groups for name in STAT_GROUPS[group]}
    return tuple(name for name in STATS if name in wanted)


def _device(gm: nn.Module) -> torch.device:
    for tensor in (*gm.parameters(), *gm.buffers()):
        return tensor.device
    for node in gm.graph.nodes if isinstance(gm, fx.GraphModule) else ():
        value = node.meta.get("val")
        if node.op == "placeholder" and isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


class Monitor:
    """Statistics of chosen nodes every ``every`` steps; made by :func:`amp_graph.monitor`
    (see there for the arguments)."""

    def __init__(
        self,
        every: int = 100,
        *,
        nodes: Any = None,
        stats: Any = None,
        log_dir: str | Path | None = None,
        flush_every: int = 1,
        tensorboard: bool | None = None,
        scaler: Any = None,
        group: dist.ProcessGroup | None = None,
        repro_dir: str | Path | None = None,
    ) -> None:
        for name, value in (("every", every), ("flush_every", flush_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"monitor {name}= is an int >= 1; got {value!r}")
        if scaler is not None and not (
            hasattr(scaler, "_scale_state") or hasattr(scaler, "_init_scale")
        ):
            raise TypeError(
                "monitor scaler= is the amp_graph.GradScaler or torch.amp.GradScaler that scales "
                f"this model's losses; got {type(scaler).__name__}"
            )
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                "monitor group= is a torch.distributed.ProcessGroup (e.g. dist.new_group(ranks) "
                f"or dist.group.WORLD) over which to reduce the statistics; got {group!r}"
            )
        self.every = every
        self.flush_every = flush_every
        self.scaler = scaler
        self.group = group
        # a Graph's; amp_graph.monitor sets a compiled module's (repro_compiled)
        self.repro: Any = None if repro_dir is None else ReproRecorder(repro_dir)
        # the rank a row was measured on; None for rows reduced over a group
        self._rank = None if group is not None else (dist.get_rank() if _distributed() else 0)
        self.selection = NodeSelection(nodes)
        self.stats = _columns(stats)
        self._column_ids = frozenset(STATS.index(s) for s in (*self.stats, "numel"))
        self.log_dir = None if log_dir is None else Path(log_dir)
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self._tensorboard = self._tensorboard_writer(tensorboard)
        self.steps = 0  # steps seen (graph_for_step calls)
        self._instrumented: dict[int, _Instrumented] = {}
        self._pending: list[_Pending] = []
        self._rows: list[dict] = []
        self._files_started = False
        self._slot: tuple[Any, str] | None = None  # (target, attribute) it is attached as

    # ---- what a step runs -----------------------------------------------------------------

    def is_logging_step(self, step: int) -> bool:
        return step % self.every == 0

    def graph_for_step(
        self, gm: fx.GraphModule, *, owner: Any = None, inputs: tuple = ()
    ) -> fx.GraphModule:
        """The graph this step runs instead of ``gm``: ``gm`` itself, or on a logging step
        its instrumented copy, writing into a fresh buffer. Called once per step; a Graph
        passes itself and its inputs (``owner``, ``inputs``) for the repro bundle."""
        if owner is None and not torch.is_grad_enabled():
            return gm  # a compiled module's evaluation call: not a training step
        step = self.steps
        self.steps += 1
        if self.repro is not None and owner is not None:
            self.repro.before(owner, inputs, owner.steps)
        if self.log_dir is not None and len(self._pending) >= self.flush_every:
            self.flush()  # the logging steps before this one have finished their backward
        if not self.is_logging_step(step):
            return gm
        instrumented = self._instrumented_for(gm)
        if instrumented is None:
            return gm
        buffer = instrumented.sink.start(instrumented.device)
        self._pending.append(_Pending(step, instrumented, buffer, self._loss_scale(gm)))
        return instrumented.graph_module

    def replayable(self, run: fx.GraphModule) -> contextlib.AbstractContextManager[None]:
        """Around a step a CUDA graph replayer runs (``config.enable_cuda_graph``): if ``run``
        is this step's logging graph, its probes write into one buffer kept for that graph,
        the one its capture records, and this step's buffer gets a copy after the step
        (:meth:`StatsSink.through_fixed_buffer`); otherwise nothing."""
        current = self._pending[-1] if self._pending else None
        if current is None or current.instrumented.graph_module is not run:
            return contextlib.nullcontext()
        return current.instrumented.sink.through_fixed_buffer()

    def after_step(self, owner: Any, out: Any) -> None:
        """A Graph's step has run (``out`` is what it returned): for the repro bundle."""
        if self.repro is not None:
            self.repro.after(owner, out)

    @property
    def repro_path(self) -> Path | None:
        """The repro bundle of the first skipped step, or None (checks the last step first:
        a host read of its skip counter)."""
        return None if self.repro is None else self.repro.check()

    def _loss_scale(self, gm: fx.GraphModule) -> torch.Tensor | None:
        """A copy of the scale this step multiplies its loss by (before the step updates
        it): the step graph's scaler, or the one given as ``scaler=``. No host read."""
        scaler = self.scaler if self.scaler is not None else getattr(gm, "scaler", None)
        if scaler is None:
            return None
        scale = _scale_tensor(scaler)
        if scale is None:  # before the first scale(): it will be created at init_scale
            init = getattr(getattr(scaler, "_scale_state", None), "init_scale", None)
            init = getattr(scaler, "_init_scale", init)
            return None if init is None else torch.tensor(float(init), dtype=torch.float64)
        return scale.detach().clone()

    def _instrumented_for(self, gm: fx.GraphModule) -> _Instrumented | None:
        known = self._instrumented.get(id(gm))
        if known is not None and known.source() is gm:
            return known
        build = gm.get_submodule("build") if _is_step_graph(gm) else None
        inner = gm if build is None else getattr(build, "_orig_mod", build)
        self.selection.validate(inner)
        result = instrument(inner, self.selection.predicate(inner), self._column_ids)
        if not result.probes:
            warnings.warn(
                "amp_graph.monitor: the selection measures no node of this graph (it has no "
                "matrix product, convolution or fp8 quantization, or nodes= matches none); "
                "its steps run unmonitored",
                stacklevel=4,
            )
        runs = result.graph_module
        if build is not None:  # a Graph's step: the same step around the instrumented build
            runs = copy_graph_module(gm)
            runs.build = result.graph_module
        made = _Instrumented(
            weakref.ref(gm),
            runs,
            result.probes,
            result.sink,
            _device(inner),
            computed_order(result.probes),
        )
        self._instrumented[id(gm)] = made
        return made if result.probes else None

    # ---- reading ----------------------------------------------------------------------------

    def flush(self) -> None:
        """Read every pending logging step's buffer (one host transfer), add its rows to
        :attr:`history`, and write them under ``log_dir``. Call it after the last step's
        backward: a step still running backward would be read incomplete."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        cpu = torch.device("cpu")
        buffers = torch.cat([p.buffer.flatten() for p in pending])
        if self.group is not None:
            buffers = _reduced(buffers, self.group)
        parts = [buffers.to(cpu, torch.float64)]
        parts += [
            p.loss_scale.reshape(1).to(cpu, torch.float64)
            for p in pending
            if p.loss_scale is not None
        ]
        values = torch.cat(parts).tolist()  # the one read
        scales = iter(values[buffers.numel() :])
        rows = []
        offset, width = 0, len(STATS)
        for entry in pending:
            loss_scale = next(scales) if entry.loss_scale is not None else None
            probes = entry.instrumented.probes
            for i in entry.instrumented.order:  # the order the step computed them
                row = values[offset + i * width : offset + (i + 1) * width]
                if row[STATS.index("numel")]:  # a probe that never ran this step
                    rows.append(
                        make_row(probes[i], entry.step, row, self.stats, loss_scale, self._rank)
                    )
            offset += width * len(probes)
        self._rows.extend(rows)
        self._write(rows)

    @property
    def history(self) -> History:
        """Every row so far (reads what is pending first: one host transfer)."""
        self.flush()
        return History(self._rows, self.stats)

    def plot(self, stat: str = "underflow", by: str = "node") -> Heatmap:
        """A heatmap of ``stat`` per probe (``by="node"``) or per module and role
        (``by="module"``) over the logging steps: rows labelled with their dtype, a log-scale
        legend. Reads what is pending (:attr:`history`)."""
        return heatmap(self.history, stat, by)

    @property
    def probes(self) -> list[Probe]:
        """What the logging steps measure, for the graphs instrumented so far."""
        return [p for made in self._instrumented.values() for p in made.probes]

    def close(self) -> None:
        """Flush, write the repro bundle if the last step was skipped, and close the
        TensorBoard writer."""
        self.flush()
        _ = self.repro_path  # the last step may be the first skipped one
        if self._tensorboard is not None:
            self._tensorboard.close()

    def attach(self, holder: Any, attribute: str, what: str) -> Monitor:
        """Become ``holder.<attribute>``, the slot a target asks for its step's graph (a
        compiled module's ``_monitor``, a Graph config's ``monitor``); returns ``self``."""
        if getattr(holder, attribute) is not None:
            raise ValueError(f"this {what} already has a monitor; call its detach() first")
        setattr(holder, attribute, self)
        self._slot = (holder, attribute)
        return self

    def detach(self) -> None:
        """Stop monitoring: the target runs its own graphs only. Flushes first."""
        self.close()
        if self.repro is not None:
            self.repro.remove()
        if self._slot is not None:
            setattr(*self._slot, None)
            self._slot = None

    def __repr__(self) -> str:
        where = f", log_dir={str(self.log_dir)!r}" if self.log_dir is not None else ""
        return (
            f"amp_graph.Monitor(every={self.every}, steps={self.steps}, "
            f"probes={len(self.probes)}, rows={len(self._rows)}, pending={len(self._pending)}"
            f"{where})"
        )

    # ---- files -----------------------------------------------------------------------------

    def _tensorboard_writer(self, wanted: bool | None) -> Any:
        if wanted is False or self.log_dir is None:
            if wanted and self.log_dir is None:
                raise ValueError("monitor tensorboard=True writes under log_dir: give log_dir=")
            return None
        installed = importlib.util.find_spec("tensorboard") is not None
        if not installed:
            if wanted:
                raise ImportError(
                    "monitor tensorboard=True needs the tensorboard package: "
                    "pip install 'amp_graph[tensorboard]'"
                )
            return None
        from .tensorboard import TensorBoardLog

        return TensorBoardLog(self.log_dir)

    def _write(self, rows: list[dict]) -> None:
        if self.log_dir is None or not rows:
            return
        columns = History([], self.stats).columns
        append = self._files_started
        write_jsonl(self.log_dir / JSONL_NAME, rows, append=append)
        write_csv(self.log_dir / CSV_NAME, rows, columns, append=append)
        self._files_started = True
        if self._tensorboard is not None:
            self._tensorboard.write(rows, self.stats)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _reduced(flat: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Rows of every rank in ``group`` combined: ``amax`` by maximum, the counts summed (a
    collective: every rank of the group reads at the same step)."""
    rows = flat.reshape(-1, len(STATS)).clone()
    amax = rows[:, 0].clone()
    dist.all_reduce(rows, dist.ReduceOp.SUM, group=group)
    dist.all_reduce(amax, dist.ReduceOp.MAX, group=group)
    rows[:, 0] = amax
    return rows.flatten()


def _is_step_graph(gm: fx.GraphModule) -> bool:
    """A Graph's step graph: it calls its captured build as the submodule ``build``."""
    return any(n.op == "call_module" and n.target == "build" for n in gm.graph.nodes)
