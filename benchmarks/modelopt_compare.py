"""amp_graph.export against NVIDIA ModelOpt AutoCast, on the same model with the same
calibration inputs: what each keeps in float32, and how far each program's outputs are from
float32.

Two models, both a small HF GPT-2 (``GPT2LMHeadModel``, width 64, 2 layers, vocabulary
1000, eager attention; the module returns the logits):

* ``gpt2``: random weights;
* ``gpt2-overflow``: the same with ``transformer.h.1.mlp.c_fc``'s weight scaled by 2e5, so
  that MLP's activations reach about 1.3e5, past float16's 65504 (the weight itself stays
  under 65504).

For each, on 4 calibration samples of 2x16 token ids:

* amp_graph: ``amp_graph.export(model, args, policy=P, dtype=torch.float16,
  calibration=samples)`` for P in ``--policies`` (and without calibration, for the error
  column): every op the program computes in float32, with why (the islands
  ``export_info`` lists: a policy table, an override or calibration; the others follow a
  float32 input, as O1's residual adds do), the program's error (run by torch), and the
  error of its ONNX file run by onnxruntime on the CPU.
* ModelOpt AutoCast: the float32 ONNX export of the same model
  (``torch.onnx.export(torch.export.export(model.eval(), args), dynamo=True)``) through
  ``python -m modelopt.onnx.autocast`` with its defaults (fp16, ``data_max`` 512,
  ``init_max`` 65504, ``keep_io_types`` off) and the same samples as its calibration data
  (a folder of .npz files, one per sample); the nodes it keeps in float32 and why (its
  log), and the error of its ONNX file run by onnxruntime on the CPU.

Views (aten) and data-movement nodes (ONNX ``Reshape``, ``Transpose``...) are left out of
both sides' float32 ops: nothing is computed there.

Errors are against the float32 model (eval mode, no autograd), the worst over the
calibration samples and over 4 held-out samples: largest absolute difference and relative
L2 (``|a - b| / |b|``). AutoCast's output is float16 (``keep_io_types`` off); so is
amp_graph's (the logits come from a float16 linear).

ModelOpt is run as a command, by ``--modelopt-python`` (default: this Python when it can
import ``modelopt.onnx.autocast``). Where it cannot run, the script says so and prints
amp_graph's side only. ModelOpt's ``[onnx]`` extra wants onnxruntime-gpu and cupy on Linux
x86 and pins onnx ~= 1.21; AutoCast itself runs on the CPU with the pieces it imports, in a
venv of its own (the run docs/deploy.md records: nvidia-modelopt 0.47.0, onnx 1.23.2,
onnxruntime 1.32.0, polygraphy 0.53.6, torch 2.13.0 CPU):

    python3 -m venv /tmp/vmo
    /tmp/vmo/bin/pip install nvidia-modelopt torch==2.13.0 onnx onnxruntime \\
        onnx-graphsurgeon onnxscript onnxslim lief polygraphy
    python benchmarks/modelopt_compare.py --modelopt-python /tmp/vmo/bin/python   # ~2 min
    python benchmarks/modelopt_compare.py --policies O1 --models gpt2-overflow    # quicker
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn as nn
import torch.utils._pytree as pytree
import transformers

import amp_graph
from amp_graph.deploy.against_float32 import OutputError, error_against_float32, float32_program
from amp_graph.deploy.onnx_target import OnnxRunner, onnx_stats

SAMPLES = 4
SHAPE = (2, 16)
VOCAB = 1000
HOT = "transformer.h.1.mlp.c_fc"  # the MLP the overflow model scales up
HOT_SCALE = 2e5
CASTS = (  # conversions, not computation: left out of the float32 ops
    torch.ops.aten._to_copy.default,
    torch.ops.aten.to.dtype,
    torch.ops.aten.to.dtype_layout,
    torch.ops.prims.convert_element_type.default,
)
MODELS = ("gpt2", "gpt2-overflow")


class Logits(nn.Module):
    """An HF causal LM returning its logits only (one tensor, for every exporter)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids).logits


def gpt2(overflow: bool) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        attn_implementation="eager",
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = Logits(transformers.GPT2LMHeadModel(config)).eval()
    if overflow:
        with torch.no_grad():
            model.model.get_submodule(HOT).weight.mul_(HOT_SCALE)
    return model


def token_samples(seed: int) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, SHAPE, generator=generator),) for _ in range(SAMPLES)]


# ONNX nodes that only move or reshape data (aten views, on amp_graph's side): left out of
# both sides' counts, as views are never cast
DATA_MOVEMENT = {
    "Reshape",
    "Transpose",
    "Split",
    "Squeeze",
    "Unsqueeze",
    "Flatten",
    "Expand",
    "Identity",
    "Slice",
}
FOLLOWS = "follows a float32 input"
MADE = "made in float32 (no floating input)"


@dataclass
class Kept:
    """One op a tool computes in float32."""

    module: str
    op: str
    why: str


@dataclass
class Side:
    """One tool's program of one model: what it keeps in float32 and its errors."""

    name: str
    kept: list[Kept] = field(default_factory=list)
    islands: int | None = None  # amp_graph: len(export_info(program).islands)
    demoted: int = 0  # nodes kept in float32 from the calibration data
    data_movement: int = 0  # AutoCast: float32 data-movement nodes, not in ``kept``
    error: OutputError | None = None  # the program run by torch (amp_graph)
    onnx_error: OutputError | None = None  # its ONNX file, onnxruntime CPU
    held_out: OutputError | None = None  # the ONNX file (or program) on held-out samples
    onnx_bytes: int | None = None
    onnx_casts: int | None = None
    seconds: float = 0.0
    note: str = ""


def short_reason(why: str) -> str:
    """amp_graph's island reasons, shortened for a table cell."""
    if "deny table" in why:
        return "policy table"
    found = re.search(r"(max \|x\||its input) ([\d.e+]+) > float16 max", why)
    if found:
        what = "output" if found.group(1) == "max |x|" else "input"
        return f"calibration: {what} {found.group(2)} > 65504"
    if why.startswith("demoted by autopolicy"):
        return "calibration: " + why.removeprefix("demoted by autopolicy: ")
    if why.endswith("its inputs are float32"):
        return FOLLOWS
    if why.endswith("made in float32 (no input)"):
        return MADE
    return why


def float32_ops(program: torch.export.ExportedProgram) -> list[tuple[torch.fx.Node, str]]:
    """The program's ops that compute a float32 result, and their module paths: not casts,
    not views, whatever the reason, counted from the graph (``export_info(program).islands``
    should list the same ones: the table shows both counts)."""
    found = []
    for node in program.graph.nodes:
        value = node.meta.get("val")
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not isinstance(value, torch.Tensor):
            continue
        if value.dtype != torch.float32 or node.target in CASTS:
            continue
        if any(r.alias_info is not None for r in schema.returns):  # a view
            continue
        stack = list(node.meta.get("nn_module_stack", {}).values())
        found.append((node, stack[-1][0] if stack else ""))
    return found


def floating_input(node: torch.fx.Node) -> bool:
    values = [a.meta.get("val") for a in node.all_input_nodes]
    return any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in values)


def amp_graph_side(
    model: nn.Module,
    samples: Sequence[tuple],
    held_out: Sequence[tuple],
    policy: str,
    calibrate: bool,
    folder: Path,
) -> Side:
    name = f"amp_graph {policy}" + (" + calibration" if calibrate else "")
    start = time.perf_counter()
    program = amp_graph.export(
        model,
        samples[0],
        policy=policy,
        dtype=torch.float16,
        calibration=list(samples) if calibrate else None,
    )
    side = Side(name, seconds=time.perf_counter() - start)
    info = amp_graph.export_info(program)
    side.demoted, side.islands = len(info.demoted), len(info.islands)
    islands = {island.node: island for island in info.islands}
    for node, module in float32_ops(program):
        island = islands.get(node.name)
        why = short_reason(island.why) if island else FOLLOWS if floating_input(node) else MADE
        side.kept.append(Kept(island.module_path if island else module, node.name, why))
    side.error = error_against_float32(program.module(), model, samples)
    path = folder / f"{policy}{'_cal' if calibrate else ''}.onnx"
    try:
        amp_graph.deploy.save(program, path, "onnx")
    except amp_graph.deploy.TargetError as error:
        side.note = f"ONNX: {error}"
        side.held_out = error_against_float32(program.module(), model, held_out)
        return side
    runner = OnnxRunner(path)
    side.onnx_error = error_against_float32(runner, model, samples)
    side.held_out = error_against_float32(runner, model, held_out)
    stats = onnx_stats(path)
    side.onnx_bytes, side.onnx_casts = path.stat().st_size, stats.casts
    return side


def modelopt_python(requested: str | None) -> tuple[str | None, str]:
    """The Python to run ModelOpt with, and its versions (or why there is none)."""
    python = requested or os.environ.get("MODELOPT_PYTHON")
    if python is None:
        if importlib.util.find_spec("modelopt") is None:
            return None, (
                "nvidia-modelopt is not installed in this Python; pass --modelopt-python "
                "(a venv with nvidia-modelopt and its onnx dependencies)"
            )
        python = sys.executable
    probe = (
        "import importlib.metadata as m, modelopt.onnx.autocast; "
        "print(', '.join(f'{p} {m.version(p)}' for p in "
        "('nvidia-modelopt', 'onnx', 'onnxruntime', 'polygraphy')))"
    )
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"{python} cannot import modelopt.onnx.autocast: {last}"
    return python, done.stdout.strip()


def onnx_module_and_op(node: onnx.NodeProto) -> tuple[str, str]:
    """The module path and fx node name torch.onnx recorded on an ONNX node."""
    meta = {p.key: p.value for p in node.metadata_props}
    module = ""
    if "pkg.torch.onnx.name_scopes" in meta:
        scopes = ast.literal_eval(meta["pkg.torch.onnx.name_scopes"])
        module = scopes[-2] if len(scopes) >= 2 else ""
    found = re.match(r"%(\w+)", meta.get("pkg.torch.onnx.fx_node", ""))
    fx = found.group(1) if found else node.name
    return module, f"{node.op_type} ({fx})"


def autocast_reason(text: str) -> str:
    init = re.search(r"initializer (\S+) out of range: min=(\S+), max=(\S+),", text)
    if init:
        worst = max(abs(float(init.group(2))), abs(float(init.group(3))))
        return f"initializer {init.group(1)} absmax {worst:.3g} > init_max"
    io = re.search(r"reference IO out of range: .*absmax=([^,]+),", text)
    if io:
        return f"I/O absmax {float(io.group(1)):.3g} > data_max"
    return text


def autocast_side(
    python: str,
    model: nn.Module,
    samples: Sequence[tuple],
    held_out: Sequence[tuple],
    folder: Path,
) -> Side:
    source, converted, calib = folder / "fp32.onnx", folder / "autocast.onnx", folder / "calib"
    program = float32_program(model, samples[0], {})  # eval mode, no autograd
    onnx_program = torch.onnx.export(program, dynamo=True, verbose=False)
    onnx_program.save(str(source), external_data=False)
    graph = onnx.load(str(source)).graph
    inputs = [i.name for i in graph.input]
    calib.mkdir()
    for i, sample in enumerate(samples):
        tensors = [t for t in pytree.tree_leaves(sample) if isinstance(t, torch.Tensor)]
        arrays = {n: t.numpy() for n, t in zip(inputs, tensors, strict=True)}
        np.savez(calib / f"{i:03d}.npz", **arrays)
    command = [
        python,
        "-m",
        "modelopt.onnx.autocast",
        "--onnx_path",
        str(source),
        "--output_path",
        str(converted),
        "--calibration_data",
        str(calib),
        "--log_level",
        "DEBUG",
    ]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    side = Side("ModelOpt AutoCast + calibration", seconds=time.perf_counter() - start)
    log = done.stdout + done.stderr
    if done.returncode != 0:
        side.note = f"AutoCast failed: {log.strip().splitlines()[-1]}"
        return side
    reasons = {
        m.group(1): autocast_reason(m.group(2))
        for m in re.finditer(r"Skipping node (\S+): (.*)", log)
    }
    for m in re.finditer(r"Node (\S+) \(op type: (\w+)\) is not supported in low precision", log):
        reasons[m.group(1)] = f"{m.group(2)} has no low-precision ONNX schema"
    listed = re.search(r"High Precision Nodes: (\[.*\])", log)
    names = ast.literal_eval(listed.group(1)) if listed else list(reasons)
    names += [n for n in reasons if n not in names]
    nodes = {n.name: n for n in graph.node}
    for name in names:
        if name in nodes and nodes[name].op_type in DATA_MOVEMENT:
            side.data_movement += 1
            continue
        module, op = onnx_module_and_op(nodes[name]) if name in nodes else ("", name)
        side.kept.append(Kept(module, op, reasons.get(name, "")))
    side.demoted = sum("> data_max" in k.why for k in side.kept)
    runner = OnnxRunner(converted)
    side.onnx_error = error_against_float32(runner, model, samples)
    side.held_out = error_against_float32(runner, model, held_out)
    stats = onnx_stats(converted)
    side.onnx_bytes, side.onnx_casts = converted.stat().st_size, stats.casts
    side.note = f"float32 ONNX {source.stat().st_size / 1e3:.0f} kB"
    return side


def fmt(error: OutputError | None) -> str:
    if error is None:
        return "-"
    if math.isinf(error.max_abs):
        return "inf"
    return f"{error.max_abs:.2g} / {error.rel_l2:.2g}"


def kept_table(sides: Sequence[Side]) -> list[str]:
    """Markdown: per module, what each tool keeps in float32 and why."""
    modules: list[str] = []
    for side in sides:
        modules += [k.module for k in side.kept if k.module not in modules]
    order = {m: i for i, m in enumerate(sorted(modules, key=_module_order))}
    header = "| module | " + " | ".join(s.name for s in sides) + " |"
    lines = [header, "|" + "---|" * (len(sides) + 1)]
    for module in sorted(order, key=order.__getitem__):
        cells = []
        for side in sides:
            kept = [k for k in side.kept if k.module == module]
            here = [f"{k.op}: {k.why}" for k in kept if k.why not in (FOLLOWS, MADE)]
            for label in (FOLLOWS, MADE):
                if grouped := [k.op for k in kept if k.why == label]:
                    here.append(f"{', '.join(grouped)}: {label}")
            cells.append("<br>".join(here).replace("|", "\\|") or "-")
        lines.append(f"| `{module or '(top)'}` | " + " | ".join(cells) + " |")
    return lines


def _module_order(path: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in path.split(".")] if path else []


def summary_table(sides: Sequence[Side], float32_onnx: str) -> list[str]:
    lines = [
        "| program | float32 ops | in `islands` | from calibration data | ONNX file (kB) "
        "| ONNX Casts | error, program (abs / rel L2) | error, ONNX on onnxruntime CPU "
        "| held-out, ONNX | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sides:
        size = "-" if s.onnx_bytes is None else f"{s.onnx_bytes / 1e3:.0f}"
        islands = "-" if s.islands is None else str(s.islands)
        lines.append(
            f"| {s.name} | {len(s.kept)} | {islands} | {s.demoted} | {size} "
            f"| {s.onnx_casts or '-'} "
            f"| {fmt(s.error)} | {fmt(s.onnx_error)} | {fmt(s.held_out)} | {s.seconds:.1f} |"
        )
    lines.append(f"\n({float32_onnx}; errors: max absolute / relative L2 against float32)")
    for s in sides:
        if s.data_movement:
            lines.append(
                f"({s.name} also keeps {s.data_movement} data-movement nodes in float32, "
                "Reshape and the like: left out of both sides, as views are never cast)"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modelopt-python", help="a Python that imports modelopt.onnx.autocast")
    parser.add_argument("--policies", default="O1,O2", help="amp_graph policies (comma list)")
    parser.add_argument(
        "--models", default=",".join(MODELS), help="comma list of " + ", ".join(MODELS)
    )
    args = parser.parse_args()
    for name in args.models.split(","):
        if name not in MODELS:
            parser.error(f"unknown model {name!r}: the models are {', '.join(MODELS)}")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    python, versions = modelopt_python(args.modelopt_python)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    if python is None:
        print(f"ModelOpt AutoCast: NOT RUN ({versions}). Only amp_graph's side is printed.")
    else:
        print(f"ModelOpt AutoCast: {versions} (run by {python})")
    samples, held_out = token_samples(1), token_samples(2)
    print(f"{SAMPLES} calibration samples and {SAMPLES} held-out samples of {list(SHAPE)} ids")
    for name in args.models.split(","):
        model = gpt2(overflow=name == "gpt2-overflow")
        with torch.no_grad():
            peak = max(model(*s).abs().max().item() for s in samples)
        print(f"\n## {name} (float32 logits max |x| {peak:.3g})\n")
        sides: list[Side] = []
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            for policy in args.policies.split(","):
                sides.append(amp_graph_side(model, samples, held_out, policy, False, folder))
                sides.append(amp_graph_side(model, samples, held_out, policy, True, folder))
            float32_onnx = "AutoCast not run"
            if python is not None:
                autocast = autocast_side(python, model, samples, held_out, folder)
                if autocast.onnx_error is None:  # AutoCast or its file did not run
                    print(f"ModelOpt AutoCast: NOT RUN on {name}: {autocast.note}")
                else:
                    float32_onnx = autocast.note
                    sides.append(autocast)
        print("\n".join(summary_table(sides, float32_onnx)))
        print()
        shown = [s for s in sides if "calibration" in s.name]
        print("\n".join(kept_table(shown)))
        for side in sides:
            if side.note and side.name.startswith("amp_graph"):
                print(f"{side.name}: {side.note}")


if __name__ == "__main__":
    main()
