"""The ``amp-graph`` command (also ``python -m amp_graph``).

::

    amp-graph inspect MODEL --input-shape 8,3,32,32 [--dtype bf16] [--policy O1]
                      [--output-dtype policy|float32|none] [--html out.html] [--svg out.svg]
    amp-graph explain MODEL --input-shape 8,3,32,32 NODE
    amp-graph export MODEL --input-shape 8,3,32,32 [--policy O2] [--dtype fp16]
                     [--calibrate samples.pt] [--dynamic-batch] --format pt2|aoti|onnx -o OUT
    amp-graph demo [ARGS...]

``MODEL`` is ``path/to/file.py:Name`` or ``package.module:Name``, where ``Name`` is an
``nn.Module`` subclass (built with no arguments), a function returning a module, or a
module instance. Example inputs of the given shapes (random floats, or zeros for integer
dtypes) are checked by running the model on FakeTensors, so nothing is computed; then
``amp_graph.compile(model, ..., example_inputs=...)`` captures the model with
``torch.export`` and rewrites it, and the commands inspect the resulting graph (aten ops
named by export: ``linear``, ``softmax``...). Mistakes (a missing file or name, a bad
shape, a model that fails on those shapes, a ``--keep-fp32`` path that names no module, a
node name that is not in the graph, a drawing option out of range or without a drawing, a
calibration sample that does not fit the example inputs) are reported in one line on
stderr with exit status 2, before any output.
A model that cannot be captured exits with status 1 and amp_graph's ``CaptureError``,
which names the construct and what to do. ``--debug`` shows tracebacks, and torch's own
warnings, instead.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

PROG = "amp-graph"
DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
}
INPUT_DTYPES = (
    "float32",
    "float",
    "fp32",
    "float16",
    "fp16",
    "bfloat16",
    "bf16",
    "float64",
    "long",
    "int64",
    "int",
    "int32",
    "bool",
)
EXIT_USAGE, EXIT_FAILED = 2, 1


class UsageError(Exception):
    """Something the user gave is wrong; the message says what (exit status 2)."""


def parse_shape(text: str) -> tuple[int, ...]:
    """``"8,3,32,32"`` -> ``(8, 3, 32, 32)``; a UsageError naming the bad part otherwise."""
    parts = [p.strip() for p in text.replace("x", ",").split(",")]
    if not text.strip() or any(not p.isdigit() or int(p) == 0 for p in parts):
        raise UsageError(
            f"bad --input-shape {text!r}: give positive integer sizes separated by commas, "
            "e.g. --input-shape 8,3,32,32 (repeat --input-shape for each input)"
        )
    return tuple(int(p) for p in parts)


def _torch_dtype(name: str) -> Any:
    import torch

    aliases = {
        "float": "float32",
        "fp32": "float32",
        "fp16": "float16",
        "bf16": "bfloat16",
        "long": "int64",
        "int": "int64",
    }
    return getattr(torch, aliases.get(name, name))


def _load_module(where: str) -> Any:
    """The Python module named by the part of MODEL before the colon."""
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise UsageError(f"no such file: {where}")
        spec = importlib.util.spec_from_file_location(f"amp_graph_cli_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise UsageError(f"cannot load {where} as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.resolve().parent))  # so that it can import its neighbours
        try:
            spec.loader.exec_module(module)
        except Exception as error:
            raise UsageError(f"{where} failed to run: {type(error).__name__}: {error}") from error
        finally:
            sys.path.pop(0)
        return module
    try:
        return importlib.import_module(where)
    except ImportError as error:
        raise UsageError(f"cannot import {where!r}: {error}") from error


def load_model(spec: str) -> Any:
    """The ``nn.Module`` named by ``FILE.py:Name`` or ``package.module:Name``."""
    import torch.nn as nn

    from amp_graph.policy import nearest

    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise UsageError(
            f"MODEL is FILE.py:Name or package.module:Name, e.g. models.py:ResNet; got {spec!r}"
        )
    module = _load_module(where)
    if not hasattr(module, name):
        candidates = [
            k
            for k, v in vars(module).items()
            if not k.startswith("_")
            and (
                isinstance(v, nn.Module)
                or (isinstance(v, type) and issubclass(v, nn.Module))
                or (callable(v) and getattr(v, "__module__", None) == module.__name__)
            )
        ]
        raise UsageError(
            f"{where} has no attribute {name!r}.{nearest(name, candidates)}"
            + (f" Models and factories there: {', '.join(candidates)}." if candidates else "")
        )
    target = getattr(module, name)
    if isinstance(target, nn.Module):
        return target
    if not callable(target):
        raise UsageError(
            f"{spec} is not a model, a module class or a factory: it is "
            f"{type(target).__name__} {target!r:.40}"
        )
    try:
        model = target()
    except TypeError as error:
        raise UsageError(
            f"cannot build {name}(): {error}. The CLI calls it with no arguments; add a "
            f"factory function to {where} that builds the model you want"
        ) from error
    if not isinstance(model, nn.Module):
        raise UsageError(f"{name}() returned a {type(model).__name__}, not an nn.Module")
    return model


def example_inputs(shapes: list[str], dtypes: list[str] | None) -> tuple[Any, ...]:
    """One tensor per ``--input-shape``: random floats, or zeros for integer dtypes."""
    import torch

    sizes = [parse_shape(s) for s in shapes]
    names = dtypes or ["float32"]
    if len(names) == 1:
        names = names * len(sizes)
    if len(names) != len(sizes):
        raise UsageError(
            f"{len(sizes)} --input-shape but {len(names)} --input-dtype; give one "
            "--input-dtype for all inputs or one per input"
        )
    inputs = []
    for size, name in zip(sizes, names, strict=True):
        dtype = _torch_dtype(name)
        inputs.append(
            torch.randn(size, dtype=dtype)
            if dtype.is_floating_point
            else torch.zeros(size, dtype=dtype)
        )
    return tuple(inputs)


def check_runs(model: Any, inputs: tuple[Any, ...], debug: bool = False) -> None:
    """Run the model on FakeTensors of the inputs' shapes: shape errors, no computation.

    A model whose Python code reads tensor values (``if x.sum() > 0``) cannot run on
    FakeTensors; it is run once on the real inputs instead. The error is the one line
    this raises: FakeTensorMode's own log of it (a traceback) is kept off stderr, unless
    ``debug``.
    """
    import torch
    from torch._subclasses import fake_tensor
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    state = {k: mode.from_tensor(v) for k, v in [*model.named_parameters(), *model.named_buffers()]}
    fakes = [mode.from_tensor(x) for x in inputs]
    shapes = ", ".join(str(tuple(x.shape)) for x in inputs)
    try:
        try:
            silent = None if debug else logging.CRITICAL + 1
            with mode, torch.no_grad(), _logger_level(fake_tensor.__name__, silent):
                torch.func.functional_call(model, state, tuple(fakes))
        except DataDependentOutputException:
            with torch.no_grad():
                model(*inputs)
    except Exception as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise UsageError(
            f"{type(model).__name__} fails on inputs of shape {shapes}: "
            f"{type(error).__name__}: {message}"
        ) from error


def build_policy(args: argparse.Namespace, model: Any) -> Any:
    """The preset, with ``--keep-fp32`` paths as module overrides checked against the model,
    and ``--output-dtype`` as its ``output_dtype`` unless it is ``policy``."""
    import torch

    import amp_graph

    if not args.keep_fp32 and args.output_dtype == "policy":
        return args.policy
    policy = amp_graph.Policy.preset(args.policy)
    if args.keep_fp32:
        policy = policy.override(modules={path: "fp32" for path in args.keep_fp32})
        try:
            policy.validate_modules([name for name, _ in model.named_modules()])
        except ValueError as error:
            raise UsageError(f"--keep-fp32: {error}") from error
    if args.output_dtype != "policy":
        output_dtype = torch.float32 if args.output_dtype == "float32" else None
        policy = dataclasses.replace(policy, output_dtype=output_dtype)
    return policy


@contextlib.contextmanager
def _logger_level(name: str, level: int | None) -> Iterator[None]:
    """The logger ``name`` at ``level`` while inside (None: as it is); its level restored
    after. (The command is the application, so it may set a library's log level.)"""
    logger = logging.getLogger(name)
    before = logger.level
    if level is not None:
        logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


@contextlib.contextmanager
def quiet_torch(debug: bool) -> Iterator[None]:
    """Keep torch's noise about a failed capture off stderr, unless ``debug``.

    When ``torch.export`` fails it logs warnings about its symbols and prints the partial
    graph to stderr; amp_graph's CaptureError already names the construct and the way out.
    What is written to stderr during a capture that succeeds is passed on. (The command is
    the application, so it may set torch's log level; it restores it.)
    """
    if debug:
        yield
        return
    buffer = io.StringIO()
    with _logger_level("torch", logging.ERROR), contextlib.redirect_stderr(buffer):
        yield
    sys.stderr.write(buffer.getvalue())


def compile_model(args: argparse.Namespace) -> Any:
    """Load, check and compile the model the arguments name: an ``amp_graph.CompiledModule``
    captured with the example inputs."""
    return compile_model_and_inputs(args)[0]


def compile_model_and_inputs(args: argparse.Namespace) -> tuple[Any, tuple[Any, ...]]:
    """:func:`compile_model` and the random example inputs it was captured with."""
    import torch

    import amp_graph

    model = load_model(args.model)
    inputs = example_inputs(args.input_shape, args.input_dtype)
    check_runs(model, inputs, args.debug)
    policy = build_policy(args, model)
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    with quiet_torch(args.debug):
        return amp_graph.compile(model, policy, dtype, example_inputs=inputs), inputs


# inspect's options that only shape the drawing (--svg, --html)
DRAWING_FLAGS = {"--collapse": "collapse", "--focus": "focus", "--max-nodes": "max_nodes"}


def _check_inspect_options(args: argparse.Namespace) -> None:
    """inspect's drawing and grouping options, checked before any work (--focus, which
    names a node or module of the compiled graph, is checked by drawing it first)."""
    limits = {
        "--collapse": (args.collapse, "a module depth >= 1 (1 folds each top-level module)"),
        "--max-nodes": (args.max_nodes, "a number of nodes >= 1"),
        "--depth": (args.depth, "a module depth >= 1 (1 groups by top-level module)"),
    }
    for flag, (value, what) in limits.items():
        if value is not None and value < 1:
            raise UsageError(f"{flag} is {what}; got {value}")
    drawing = [flag for flag, name in DRAWING_FLAGS.items() if getattr(args, name) is not None]
    if drawing and not (args.svg or args.html):
        raise UsageError(f"{drawing[0]} shapes the drawing: give --svg FILE or --html FILE too")


def cmd_inspect(args: argparse.Namespace) -> int:
    import amp_graph
    from amp_graph import inspect

    _check_inspect_options(args)
    compiled = compile_model(args)
    svg = None
    if args.svg or args.html:  # drawn first: a --focus naming nothing is found before output
        try:
            svg = inspect.draw(
                compiled,
                collapse_modules=args.collapse or False,
                focus=args.focus,
                max_nodes=args.max_nodes,
            )
        except KeyError as error:
            raise UsageError(f"--focus: {error.args[0]}") from error
    report = amp_graph.report(compiled)
    flow = inspect.dataflow(compiled, depth=args.depth)
    print(report if not args.summary else report.totals())
    print()
    print(flow)
    if svg is not None:
        if args.svg:
            svg.save(args.svg)
            print(f"\nwrote {args.svg} ({svg.nodes} boxes, drawn by {svg.renderer})")
        if args.html:
            _write_html(args.html, args.model, compiled, report, flow, svg)
            print(f"wrote {args.html}")
    return 0


def _write_html(path: str, title: str, compiled: Any, report: Any, flow: Any, svg: Any) -> None:
    from amp_graph import inspect
    from amp_graph.inspect.html import legend_html, page
    from amp_graph.inspect.report import report_summary_html

    change = inspect.diff(compiled)
    html = page(
        f"amp_graph: {title}",
        [
            ("Summary", report_summary_html(report)),
            ("Data flow per module", flow._repr_html_()),
            ("The compiled graph", legend_html() + svg.text),
            ("What the passes changed", change._repr_html_()),
            ("Every node", report._repr_html_()),
        ],
    )
    Path(path).write_text(html, encoding="utf-8")


def cmd_explain(args: argparse.Namespace) -> int:
    import amp_graph

    compiled = compile_model(args)
    try:
        print(amp_graph.explain(compiled, args.node))
    except KeyError as error:
        raise UsageError(error.args[0]) from error
    return 0


def _cli_loss(output: Any) -> Any:
    """The CLI's loss: the output itself when it is a scalar, else the mean square of its
    floating tensors (a stand-in for a real loss that reaches every output)."""
    import torch
    import torch.utils._pytree as pytree

    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    return sum(t.float().square().mean() for t in leaves if t.is_floating_point())


def cmd_numerics(args: argparse.Namespace) -> int:
    import amp_graph

    compiled, inputs = compile_model_and_inputs(args)
    loss_fn = _cli_loss if args.backward else None
    report = amp_graph.numerics(
        compiled, *inputs, backward=args.backward, loss_fn=loss_fn, scale=args.scale
    )
    if args.worst is not None:
        print("\n".join(report.findings()))
        print()
        print(f"the {args.worst} nodes furthest from float32:")
        for row in report.worst(args.worst):
            print(
                f"  {row.node} ({row.op}, module '{row.module or '-'}', "
                f"{row.dtype}): relative error {row.rel_error:.3g}"
            )
    else:
        print(report)
    if args.svg:
        report.plot().save(args.svg)
        print(f"\nwrote {args.svg}")
    if args.html:
        from amp_graph.inspect.html import page

        Path(args.html).write_text(
            page(
                f"numerics: {args.model}",
                [("numerics", report._repr_html_()), ("error along the graph", str(report.plot()))],
            ),
            encoding="utf-8",
        )
        print(f"wrote {args.html}")
    if args.autopolicy:
        policy = amp_graph.autopolicy(
            compiled.model,
            compiled.policy,
            compiled.dtype,
            sample_inputs=[inputs],
            loss_fn=loss_fn,
            scale=args.scale,
        )
        print()
        if not policy.nodes:
            print(f"autopolicy: {compiled.policy.name} needs no float32 override on this input")
        for node, note in policy.notes.items():
            why = note.removeprefix("demoted by autopolicy: ")
            print(f"autopolicy: keep '{node}' in float32 ({why})")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    """Rerun a repro bundle's skipped step; print whether it is bit for bit, and where it
    broke."""
    import amp_graph

    graph = _built(args.graph, "--graph", "the training Graph")
    model = _built(args.model, "--model", "the model")
    with quiet_torch(args.debug):
        result = amp_graph.replay(args.path, graph, model=model, numerics=not args.no_numerics)
    print(result)
    return 0 if result.reproduced else EXIT_FAILED


def _built(spec: str | None, flag: str, what: str) -> Any:
    """What the factory ``FILE.py:factory`` (or ``package.module:factory``) builds, or None."""
    if not spec:
        return None
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise UsageError(f"{flag} is FILE.py:factory or package.module:factory; got {spec!r}")
    factory = getattr(_load_module(where), name, None)
    if not callable(factory):
        raise UsageError(f"{where} has no callable {name!r} that builds {what}")
    return factory()


def load_samples(path: str) -> list[Any]:
    """The calibration samples ``torch.save`` wrote: a list of tensors, tuples or dicts."""
    import torch

    if not Path(path).is_file():
        raise UsageError(f"no such file: {path}")
    try:
        samples = torch.load(path, weights_only=True)
    except Exception as error:
        raise UsageError(f"cannot read {path} with torch.load: {error}") from error
    if not isinstance(samples, (list, tuple)) or not samples:
        raise UsageError(
            f"{path} holds a {type(samples).__name__}; --calibrate takes a file written by "
            "torch.save(samples, path), samples being a non-empty list of inputs (each a "
            "tensor, a tuple of the forward's arguments, or a dict of keyword arguments)"
        )
    return list(samples)


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    import amp_graph
    from amp_graph.deploy import save
    from amp_graph.deploy.against_float32 import deploy_report, float32_program
    from amp_graph.deploy.program import calibration_samples

    model = load_model(args.model)
    inputs = example_inputs(args.input_shape, args.input_dtype)
    check_runs(model, inputs, args.debug)
    policy = build_policy(args, model)
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    samples = load_samples(args.calibrate) if args.calibrate else None
    batch = torch.export.Dim("batch")
    dynamic = tuple({0: batch} for _ in inputs) if args.dynamic_batch else None
    if samples is not None:  # before any work: each sample fits the forward and the shapes
        try:
            calibration_samples(model, samples, inputs, {}, dynamic)
        except (TypeError, ValueError) as error:
            hint = (  # the command's one dynamic_shapes
                "; here, --dynamic-batch lets dimension 0 vary"
                if isinstance(error, ValueError) and not args.dynamic_batch
                else ""
            )
            raise UsageError(f"--calibrate {args.calibrate}: {error}{hint}") from error
    with quiet_torch(args.debug):
        program = amp_graph.export(
            model, inputs, policy=policy, dtype=dtype, dynamic_shapes=dynamic, calibration=samples
        )
        path = save(program, args.output, args.format)
        float32 = float32_program(model, inputs, {}, dynamic)
        report = deploy_report(model, program, path, args.format, samples or [inputs], float32)
    print(f"wrote {path}")
    print(amp_graph.export_info(program).summary().splitlines()[0])
    print("\n".join(report.lines()))
    return 0


def run_demo(argv: list[str]) -> int:
    """``amp_graph.demo.main(argv)``, imported only now."""
    try:
        from amp_graph.demo import main as demo_main
    except ImportError as error:
        print(f"{PROG} demo: error: the demo is not available: {error}", file=sys.stderr)
        return EXIT_FAILED
    return int(demo_main(argv) or 0)


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="FILE.py:Name or package.module:Name; Name is a module class, a "
        "factory function or a module instance",
    )
    parser.add_argument(
        "--input-shape",
        action="append",
        required=True,
        metavar="SHAPE",
        help="shape of an example input, e.g. 8,3,32,32 (repeat for each input)",
    )
    parser.add_argument(
        "--input-dtype",
        action="append",
        choices=INPUT_DTYPES,
        metavar="DTYPE",
        help="dtype of the example inputs (one for all, or one per input): "
        "float32 (default), long, bool, ...",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="the low-precision dtype (default: bf16 on CPU, as torch.autocast)",
    )
    parser.add_argument(
        "--policy",
        default="O1",
        choices=("O0", "O1", "O2", "O3", "autocast"),
        help="precision policy preset (default O1)",
    )
    parser.add_argument(
        "--output-dtype",
        default="policy",
        choices=("policy", "float32", "none"),
        help="what the outputs computed in low precision are returned in: the policy's "
        "output_dtype (default: float32 under O2 and O3), float32, or none (as computed)",
    )
    parser.add_argument(
        "--keep-fp32",
        action="append",
        metavar="MODULE",
        help="keep a module path (glob) in float32, e.g. --keep-fp32 head",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Automatic mixed precision as a torch.fx graph pass: see "
        "what it does to a model.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect_cmd = commands.add_parser(
        "inspect",
        help="compile a model; print its report and data flow; write a drawing",
        description="Compile MODEL with example inputs of the given shapes, print the report "
        "and the per-module data flow, and optionally write the drawing and an "
        "HTML page.",
    )
    _model_arguments(inspect_cmd)
    inspect_cmd.add_argument("--svg", metavar="FILE", help="write the drawing (SVG) here")
    inspect_cmd.add_argument(
        "--html", metavar="FILE", help="write a page with the report, data flow, drawing and diff"
    )
    inspect_cmd.add_argument(
        "--collapse",
        type=int,
        metavar="DEPTH",
        help="fold modules this deep into one box each in the drawing",
    )
    inspect_cmd.add_argument(
        "--focus", metavar="NODE_OR_MODULE", help="draw only around this node or this module"
    )
    inspect_cmd.add_argument("--max-nodes", type=int, metavar="N", help="draw at most N nodes")
    inspect_cmd.add_argument(
        "--depth",
        type=int,
        metavar="DEPTH",
        help="group the data flow by modules this deep (default: innermost)",
    )
    inspect_cmd.add_argument(
        "--summary", action="store_true", help="print the totals instead of the per-node table"
    )
    inspect_cmd.set_defaults(run=cmd_inspect)
    explain_cmd = commands.add_parser(
        "explain",
        help="why one node of the compiled graph has its dtype",
        description="Compile MODEL as `inspect` does and explain one node's dtype.",
    )
    _model_arguments(explain_cmd)
    explain_cmd.add_argument(
        "node",
        metavar="NODE",
        help="a node name, as `inspect` lists them: aten ops named by torch.export "
        "(linear, linear_1, softmax), parameters (model_fc_weight), casts (linear_fp32)",
    )
    explain_cmd.set_defaults(run=cmd_explain)
    numerics_cmd = commands.add_parser(
        "numerics",
        help="run the compiled model next to a float32 shadow; name the nodes that break",
        description="Compile MODEL as `inspect` does, run it on random inputs of the given "
        "shapes next to a float32 shadow of the same graph, and print per node its dtype, "
        "max |x|, zeros, subnormals, non-finite values and relative error.",
    )
    _model_arguments(numerics_cmd)
    numerics_cmd.add_argument(
        "--backward",
        action="store_true",
        help="also measure gradients (loss: the output if scalar, else its mean square)",
    )
    numerics_cmd.add_argument(
        "--scale", type=float, metavar="S", help="loss scale (default 2**16 for fp16, else 1)"
    )
    numerics_cmd.add_argument(
        "--worst", type=int, metavar="K", help="print the findings and the K worst nodes only"
    )
    numerics_cmd.add_argument("--svg", metavar="FILE", help="write the error plot (SVG) here")
    numerics_cmd.add_argument("--html", metavar="FILE", help="write the report as an HTML page")
    numerics_cmd.add_argument(
        "--autopolicy",
        action="store_true",
        help="also search for the fewest float32 node overrides that make this input pass",
    )
    numerics_cmd.set_defaults(run=cmd_numerics)
    export_cmd = commands.add_parser(
        "export",
        help="export the model for inference in mixed precision: .pt2, AOTInductor or ONNX",
        description="Export MODEL with amp_graph.export (eval mode, every cast explicit, "
        "weights only low-precision ops read stored in the low dtype), write it in FORMAT, "
        "and print its size against the float32 export's, its casts, its float32 islands "
        "and why, and its maximum error against the float32 model on the calibration inputs "
        "(the example inputs without --calibrate).",
    )
    _model_arguments(export_cmd)
    export_cmd.add_argument(
        "--calibrate",
        metavar="SAMPLES.pt",
        help="torch.save'd list of sample inputs: autopolicy keeps in float32 the nodes "
        "that break on them",
    )
    export_cmd.add_argument(
        "--dynamic-batch", action="store_true", help="one program for every batch size"
    )
    export_cmd.add_argument("--format", choices=("pt2", "aoti", "onnx"), default="pt2")
    export_cmd.add_argument("-o", "--output", required=True, metavar="OUT", help="file to write")
    export_cmd.set_defaults(run=cmd_export)
    replay_cmd = commands.add_parser(
        "replay",
        help="rerun the skipped step a monitor's repro bundle recorded; name where it broke",
        description="Load the bundle amp_graph.monitor(repro_dir=...) wrote for the first "
        "skipped step into a new Graph (or, for a compiled module, a new model) of the "
        "recorded class, rerun that step on the same "
        "device, check it bit for bit, and run numerics on it (forward and backward). Exit "
        "status 0 when the step reran bit for bit.",
    )
    replay_cmd.add_argument("path", metavar="PATH", help="the bundle: repro_dir/step_<N>")
    replay_cmd.add_argument(
        "--graph",
        metavar="FILE.py:factory",
        help="a function (or class) that builds the training Graph (default: the recorded "
        "class, called with no arguments, only where its module is imported: a bundle's "
        "names are never imported)",
    )
    replay_cmd.add_argument(
        "--model",
        metavar="FILE.py:factory",
        help="a compiled module's bundle: a function (or class) that builds the model "
        "(default: the recorded class, called with no arguments, only where its module is "
        "imported)",
    )
    replay_cmd.add_argument("--no-numerics", action="store_true", help="only rerun the step")
    replay_cmd.add_argument("--debug", action="store_true", help="show tracebacks")
    replay_cmd.set_defaults(run=cmd_replay)
    demo_cmd = commands.add_parser(
        "demo",
        help="run amp_graph's demo (what `make demo` runs)",
        description="Run amp_graph.demo: the arguments after `demo` are passed to it "
        "(`amp-graph demo -- --help` for its own options).",
    )
    demo_cmd.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the demo")
    demo_cmd.set_defaults(run=lambda args: run_demo(args.args), debug=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``amp-graph``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"] and argv[1:2] not in (["-h"], ["--help"]):
        rest = argv[1:]  # the demo parses its own options
        return run_demo(rest[1:] if rest[:1] == ["--"] else rest)
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except UsageError as error:
        if args.debug:
            raise
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as error:  # compile failures: say what failed, without the traceback
        if args.debug:
            raise
        print(
            f"{PROG} {args.command}: error: {type(error).__name__}: {error}\n"
            "(run again with --debug for the traceback)",
            file=sys.stderr,
        )
        return EXIT_FAILED


__all__ = ["build_parser", "load_model", "main", "parse_shape"]
