"""``amp_graph.replay``: rerun the skipped step a monitor's repro bundle recorded.

The monitor (``repro_dir=``) writes the bundle (:mod:`amp_graph.monitoring.repro`); this
loads it into a Graph of the same class, runs the step once on the same device, checks it
bit for bit against what was recorded, and runs :func:`amp_graph.numerics` on the step's
build graph to name the first node that went non-finite, forward or backward.
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from amp_graph.monitoring.repro import META_FILE, buffers_after, gradients, set_rng
from amp_graph.training.nn_graph import Graph

from .bundle_files import load_bundle_file
from .numerics import numerics as run_numerics
from .replay_compiled import built_from, replay_compiled, same_bits


@dataclass
class ReplayResult:
    """What :func:`replay` found. ``reproduced``: the step ran bit for bit as recorded (the
    same output, every gradient and every buffer it wrote, NaNs in the same places);
    ``mismatches`` names what differs. ``report``: ``amp_graph.numerics`` of the step
    (forward and backward)."""

    path: Path
    step: int
    skipped: bool
    reproduced: bool
    mismatches: list[str] = field(default_factory=list)
    report: Any = None
    note: str = ""

    @property
    def first_nonfinite(self) -> str | None:
        """The first node with inf/nan where float32 is finite, forward then backward."""
        if self.report is None:
            return None
        row = self.report.first_nonfinite
        if row is not None:
            return f"forward: '{row.node}' ({row.op} in module '{row.module or '<root>'}')"
        row = self.report.first_nonfinite_grad
        if row is not None:
            return f"backward: '{row.node}' ({row.op} in module '{row.module or '<root>'}')"
        return None

    def __str__(self) -> str:
        lines = [
            f"replayed step {self.step} from {self.path}: "
            + ("skipped again (inf/nan gradients)" if self.skipped else "NOT skipped this time"),
            "bit for bit: the output, every gradient and every buffer as recorded"
            if self.reproduced
            else f"NOT bit for bit: {', '.join(self.mismatches)} differ",
        ]
        first = self.first_nonfinite
        if first is not None:
            lines.append(f"first non-finite node: {first}")
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)


def _loss_positions(step_graph: Any) -> list[int]:
    """Where the first micro-batch's losses sit in what build returns (the step graph picks
    them: ``loss_0_<k> = build_0[position]``)."""
    return [
        n.args[1]
        for n in step_graph.graph.nodes
        if n.op == "call_function" and n.target is operator.getitem and n.name.startswith("loss_0_")
    ]


def replay(
    path: str | Path,
    graph: Any = None,
    *,
    model: Any = None,
    optimizer: Any = None,
    numerics: bool = True,
    policy: Any = None,
) -> ReplayResult:
    """Rerun the skipped step a monitor's repro bundle recorded, and find where it broke.

    ``graph``: a new instance of the training Graph (built as the training script builds
    it); None builds the recorded class with no arguments. Its state, the batch and the RNG
    are loaded from the bundle, the step runs once on the same device, and its output and
    gradients are compared bit for bit with the recorded ones. Then (``numerics=True``)
    :func:`amp_graph.numerics` runs the step's build graph forward and backward beside a
    float32 shadow, at the step's loss scale, and the result names the first non-finite
    node. It runs with the recorded number of CPU threads (a reduction's order depends on
    it). Prints nothing: ``print(result)``.

    A compiled module's bundle (``amp_graph.monitor(compiled, repro_dir=..., scaler=...,
    optimizer=...)``) takes ``model=``, a new instance of the model (None: the recorded class
    built with no arguments), and optionally ``optimizer=`` (over ``model``'s parameters),
    which gets its state of before the step: the forward and backward run once and are
    compared the same way (:mod:`amp_graph.inspect.replay_compiled`). It compiles under the
    bundle's ``policy.json``, or ``policy=`` (a policy holding a function of yours is stored
    as text only: pass it then).

    No file of the bundle is unpickled into code: each is read with
    ``torch.load(weights_only=True)`` and one holding anything else raises
    :class:`~amp_graph.inspect.bundle_files.BundleRefused` naming it.
    """
    path = Path(path)
    meta_file = path / META_FILE
    if not meta_file.exists():
        raise FileNotFoundError(
            f"{path} is not a repro bundle (no {META_FILE}); the monitor writes them under "
            "repro_dir/step_<N>/"
        )
    meta = json.loads(meta_file.read_text())
    if meta["device"].startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(
            f"step {meta['step']} was recorded on {meta['device']}: replay it on that device"
        )
    compiled = meta.get("kind") == "compile"
    if compiled and graph is not None:
        raise TypeError(
            f"{path} is a compiled module's bundle: pass model= (and optimizer=), not a Graph"
        )
    if not compiled and (model is not None or optimizer is not None or policy is not None):
        raise TypeError(
            f"{path} is a Graph's bundle: pass graph= (it has its policy), not model=, "
            "optimizer= or policy="
        )
    if not compiled and graph is None:
        graph = built_from(
            meta["graph_class"],
            Graph,
            "the Graph",
            "graph= (a new instance of the training Graph, built as the training script builds "
            "it), or --graph FILE.py:factory from the command line",
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(meta["threads"])  # the recorded run's reduction order on the CPU
    try:
        if compiled:
            skipped, mismatches, report, note = replay_compiled(
                path, meta, model, optimizer, numerics, policy
            )
            reproduced = not mismatches
            return ReplayResult(path, meta["step"], skipped, reproduced, mismatches, report, note)
        return _replay(path, meta, graph, numerics)
    finally:
        torch.set_num_threads(threads)


def _replay(path: Path, meta: dict[str, Any], graph: Any, numerics: bool) -> ReplayResult:
    state = load_bundle_file(path / "state.pt")
    inputs = load_bundle_file(path / "batch.pt")
    rng = load_bundle_file(path / "rng.pt")
    recorded = load_bundle_file(path / "step_result.pt")
    graph.load_state_dict(state)
    graph.capture(*inputs)  # capturing draws random numbers: before the RNG is set
    graph.load_state_dict(state)  # again: O2's float32 masters exist once captured
    set_rng(rng)
    before = graph.skipped_steps
    out = graph(*inputs)
    skipped = graph.skipped_steps > before
    mismatches = [] if same_bits(out, recorded["out"]) else ["output"]
    for kind, now in (("grads", gradients(graph)), ("buffers", buffers_after(graph))):
        for name in sorted(set(now) | set(recorded[kind])):
            ours, theirs = now.get(name), recorded[kind].get(name)
            if ours is None or theirs is None or not same_bits(ours, theirs):
                mismatches.append(name if kind == "grads" else f"buffer {name}")
    note = ""
    if torch.__version__ != meta["torch"]:
        note = f"recorded with torch {meta['torch']}, replayed with {torch.__version__}"
    report = None
    if numerics and meta["micro_batches"] == 1:
        positions = _loss_positions(graph.step_graph)
        graph.load_state_dict(state)
        set_rng(rng)
        report = run_numerics(
            graph.build_graph,
            *inputs,
            backward=True,
            loss_fn=lambda result: sum(result[p] for p in positions),
            scale=meta["loss_scale"],
        )
    elif numerics:
        note = (note + "; " if note else "") + (
            "numerics skipped: the step ran in micro-batches (the build graph takes the "
            "weights cast once per step)"
        )
    return ReplayResult(path, meta["step"], skipped, not mismatches, mismatches, report, note)
